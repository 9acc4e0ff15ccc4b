"""Token sampling: temperature, top-k, top-p, and seeded inverse-CDF draws, one stream per sample.

Each sample's random numbers come from a CPU generator seeded by (seed, prompt id, sample index),
so a sample's tokens do not depend on which other samples share its batch, on the batch size, on
the device, or on how prompts are split across ranks.
"""

from __future__ import annotations

import torch

from rlx.engine.device import derive_seed


def sample_uniforms(seed: int, sample_ids: list[str], num_steps: int) -> torch.Tensor:
    """Uniform draws in [0, 1) for each sample and decoding step: float64 [B, num_steps] on CPU."""
    if not sample_ids:
        return torch.zeros((0, num_steps), dtype=torch.float64)
    rows = []
    for sample_id in sample_ids:
        gen = torch.Generator(device="cpu").manual_seed(derive_seed("rollout", seed, sample_id))
        rows.append(torch.rand(num_steps, generator=gen, dtype=torch.float64))
    return torch.stack(rows)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask tokens outside top-k / top-p with -inf.  logits: [B, V] float32, already temperature-scaled."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked before it already reach top_p (the top token always stays)
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def draw_tokens(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Sample one token per row by inverse CDF.  logits: [B, V] (filtered), uniforms: [B] in [0, 1)."""
    probs = torch.softmax(logits.double(), dim=-1)
    cdf = probs.cumsum(dim=-1)
    target = uniforms.to(cdf.device, torch.float64).unsqueeze(-1) * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    # rounding can push the target past the last positive-probability token: take the most likely then
    overflow = tokens >= logits.shape[-1]
    if overflow.any():
        tokens = torch.where(overflow, probs.argmax(dim=-1), tokens)
    return tokens
