"""Rollout engines: sample N responses per prompt and keep the sampler's per-token logprobs."""
