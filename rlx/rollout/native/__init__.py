"""rlx's own rollout engine ('native'): a paged KV cache, continuous batching, the trainer's own module."""
