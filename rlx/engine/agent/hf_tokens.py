"""A stop-gap `generate_tokens` over today's hf engine, until the engines expose the token-level call.

It decodes requests in batches with the hf engine's batch decoder: each request draws from the
stream seeded by (seed, request key), so its tokens do not depend on its batch. A batch decodes up to
its longest `max_new_tokens` and each continuation is cut back to its own limit (the draws of a step
do not depend on how many steps follow, so the cut is what decoding to that limit gives).
"""

from __future__ import annotations

import dataclasses

import torch

from rlx.engine.agent.protocol import Generated, TokenRequest
from rlx.engine.rollout.config import RolloutConfig
from rlx.engine.rollout.sampling import sample_uniforms


def as_token_engine(engine):
    """`engine` itself when it has `generate_tokens`, else the hf adapter around it."""
    return engine if hasattr(engine, "generate_tokens") else HFTokenEngine(engine)


class HFTokenEngine:
    """`generate_tokens` for an `HFRolloutEngine` held in this process (one process: no lockstep ranks)."""

    def __init__(self, engine):
        if getattr(engine, "ctx", None) is not None:
            raise NotImplementedError("multi-turn rollouts over the hf engine run in one process for now")
        self.engine = engine

    def generate_tokens(self, requests: list[TokenRequest], sampling: RolloutConfig) -> list[Generated]:
        out: list[Generated] = []
        model = self.engine.model
        was_training = model.training
        model.eval()
        try:
            with self.engine._decoding_attention():
                for lo in range(0, len(requests), sampling.batch_size):
                    out += self._generate_batch(requests[lo : lo + sampling.batch_size], sampling)
        finally:
            model.train(was_training)
        return out

    def _generate_batch(self, batch: list[TokenRequest], sampling: RolloutConfig) -> list[Generated]:
        longest = max(r.max_new_tokens for r in batch)
        if min(r.max_new_tokens for r in batch) < 1:
            raise ValueError("every token request needs max_new_tokens >= 1")
        cfg = dataclasses.replace(sampling, max_new_tokens=longest)
        uniforms = sample_uniforms(sampling.seed, [r.key for r in batch], longest)
        greedy = torch.tensor([r.greedy or sampling.temperature == 0 for r in batch])
        generated = self.engine._generate_batch([r.prompt_ids for r in batch], uniforms, greedy, cfg)
        return [_cut(g, r.max_new_tokens) for g, r in zip(generated, batch)]


def _cut(gen: Generated, limit: int) -> Generated:
    if len(gen.response_ids) <= limit:
        return gen
    return Generated(gen.response_ids[:limit], gen.logprobs[:limit], "length")
