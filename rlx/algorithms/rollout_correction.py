"""Rollout correction: importance weights and rejection masks for the gap between the sampler's
logprobs and the trainer's, and the mismatch metrics logged every step.

With `old` the trainer's logprobs of the sampling policy and `rollout` the sampler's own, the
per-token ratio is rho_t = exp(old - rollout) (verl's decoupled mode). Truncated importance
sampling multiplies the loss by min(rho, threshold) per token or per sequence (prod_t rho_t);
rejection sampling drops tokens or whole sequences whose ratio (token, product, or geometric mean)
leaves [lower, upper]; a veto drops sequences containing a token with rho below a floor. Ratios
are bounded to [exp(-20), exp(20)] before use (as verl).
"""

from __future__ import annotations

import torch

from rlx.algorithms.config import CorrectionConfig
from rlx.algorithms.core import masked_mean, masked_sum

_BOUND = 20.0


def correct(
    old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, cfg: CorrectionConfig
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """(IS weights [B, R] or None, the mask after rejection [B, R], metrics).  All inputs [B, R]."""
    mask = mask.bool()
    log_ratio = torch.clamp(old - rollout, -_BOUND, _BOUND) * mask
    seq_log = log_ratio.sum(dim=-1)
    lengths = mask.sum(dim=-1).clamp(min=1)
    weights = None
    if cfg.rollout_is == "token":
        weights = torch.exp(log_ratio).clamp(max=cfg.rollout_is_threshold) * mask
    elif cfg.rollout_is == "sequence":
        seq_w = torch.exp(torch.clamp(seq_log, -_BOUND, _BOUND)).clamp(max=cfg.rollout_is_threshold)
        weights = seq_w.unsqueeze(-1) * mask
    keep = mask.clone()
    if cfg.rollout_rs != "none":
        upper = cfg.rollout_rs_threshold or cfg.rollout_is_threshold
        lower = cfg.rollout_rs_threshold_lower or 1.0 / upper
        if cfg.rollout_rs == "token":
            ratio = torch.exp(log_ratio)
            keep &= (ratio >= lower) & (ratio <= upper)
        else:
            log_seq = seq_log if cfg.rollout_rs == "sequence" else seq_log / lengths
            ratio = torch.exp(torch.clamp(log_seq, -_BOUND, _BOUND))
            keep &= ((ratio >= lower) & (ratio <= upper)).unsqueeze(-1)
    if cfg.rollout_veto_threshold > 0:
        raw = torch.exp(torch.clamp(old - rollout, max=_BOUND))
        vetoed = ((raw < cfg.rollout_veto_threshold) & mask).any(dim=-1, keepdim=True)
        keep &= ~vetoed
    metrics = {
        "rollout_corr/rejected_token_frac": 1.0 - float(keep.sum()) / max(float(mask.sum()), 1.0),
        "rollout_corr/rejected_seq_frac": float(((mask.sum(-1) > 0) & (keep.sum(-1) == 0)).float().mean()),
    }
    if weights is not None:
        metrics["rollout_corr/is_weight_mean"] = float(masked_mean(weights, mask))
        metrics["rollout_corr/is_weight_max"] = float(weights.max())
    return weights, keep, metrics


def mismatch_metrics(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the trainer's logprobs are from the sampler's: abs diff, KL(rollout || old) as k1 and
    k3, and quantiles of the token IS ratio exp(old - rollout) and of the sequence ratio."""
    mask = mask.bool()
    if not mask.any():
        return {}
    diff = old - rollout
    ratio = torch.exp(torch.clamp(diff, -_BOUND, _BOUND))[mask].double()
    seq_ratio = torch.exp(torch.clamp(masked_sum(diff, mask, dim=-1), -_BOUND, _BOUND))
    k3 = torch.exp(torch.clamp(diff, -_BOUND, _BOUND)) - diff - 1
    quantiles = torch.quantile(ratio, torch.tensor([0.01, 0.05, 0.5, 0.95, 0.99], dtype=torch.float64))
    out = {
        "rollout_corr/logprob_abs_diff_mean": float(masked_mean(diff.abs(), mask)),
        "rollout_corr/logprob_abs_diff_max": float(diff.abs()[mask].max()),
        "rollout_corr/kl_k1": float(masked_mean(-diff, mask)),
        "rollout_corr/kl_k3": float(masked_mean(k3, mask)),
        "rollout_corr/is_ratio_min": float(ratio.min()),
        "rollout_corr/is_ratio_max": float(ratio.max()),
        "rollout_corr/seq_is_ratio_mean": float(seq_ratio.mean()),
        "rollout_corr/seq_is_ratio_max": float(seq_ratio.max()),
    }
    for q, value in zip(("p01", "p05", "p50", "p95", "p99"), quantiles.tolist()):
        out[f"rollout_corr/is_ratio_{q}"] = value
    return out
