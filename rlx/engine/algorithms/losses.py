"""Policy-gradient losses and KL estimators.

Losses return a sum over tokens divided by an explicit `num_tokens` (the token count of the whole
mini-batch, not the micro-batch), so accumulating micro-batch gradients equals one big batch.
Conventions follow verl's `core_algos`.
"""

from __future__ import annotations

import torch

from rlx.engine.algorithms.core import masked_sum

KL_ESTIMATORS = ("k1", "k2", "k3", "abs")


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || ref) from sampled-token logprobs.  [B, R] -> [B, R].

    k1: logp - ref (unbiased, high variance); abs: |logp - ref|; k2: 0.5 (logp - ref)^2;
    k3: exp(ref - logp) - (ref - logp) - 1 (unbiased, low variance, always >= 0), clamped to
    [-10, 10] as verl's 'low_var_kl'.
    """
    diff = logprobs - ref_logprobs
    if kind == "k1":
        return diff
    if kind == "abs":
        return diff.abs()
    if kind == "k2":
        return 0.5 * diff.square()
    if kind == "k3":
        log_ratio = -diff
        return torch.clamp(log_ratio.exp() - log_ratio - 1, min=-10, max=10)
    raise ValueError(f"unknown KL estimator {kind!r} (expected one of {', '.join(KL_ESTIMATORS)})")


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    num_tokens: int | torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = 3.0,
) -> tuple[torch.Tensor, dict]:
    """PPO clipped surrogate, token-mean over `num_tokens`.  All tensors [B, R]; mask bool.

    ratio = exp(clamp(logp - old, -20, 20)); loss = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)),
    and for A < 0 it is further capped at -A * dual_clip (dual-clip PPO; None turns it off).
    Returns (loss, metrics) where metrics hold token sums (divide by tokens to average):
    'pg_clipfrac', 'pg_clipfrac_lower', 'ppo_kl' and the token count 'tokens'.
    """
    mask = mask.to(logprobs.dtype)
    log_ratio = torch.clamp(logprobs - old_logprobs, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(loss_unclipped, loss_clipped)
    clipped = (loss_clipped > loss_unclipped).to(mask.dtype)
    clipped_lower = torch.zeros_like(mask)
    if dual_clip is not None:
        cap = -advantages * dual_clip
        clipped_lower = ((loss > cap) & (advantages < 0)).to(mask.dtype)
        loss = torch.where(advantages < 0, torch.minimum(loss, cap), loss)
    total = masked_sum(loss, mask) / num_tokens
    with torch.no_grad():
        sums = {
            "pg_clipfrac": masked_sum(clipped, mask),
            "pg_clipfrac_lower": masked_sum(clipped_lower, mask),
            "ppo_kl": masked_sum(-log_ratio, mask),
            "tokens": mask.sum(),
        }
    return total, sums
