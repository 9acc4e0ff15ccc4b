"""Policy losses (PPO clip, GSPO, CISPO, SAPO, GPG, clip-cov, kl-cov, GMPO), their aggregation, and the
clipped value loss.

A policy loss returns per-token (or per-sequence) losses; `aggregate` turns them into a scalar
using normalisers counted over the whole mini-batch (`LossNorm`), so accumulating micro-batch
gradients equals one pass over the mini-batch. Conventions follow verl's `core_algos` (named in
each docstring); metric sums are token sums (divide by the token count to average).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rlx.algorithms.config import LossConfig
from rlx.algorithms.core import masked_mean, masked_sum

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass
class LossNorm:
    """Normalisers of one mini-batch (not of a micro-batch)."""

    num_tokens: float
    """Unmasked response tokens in the mini-batch."""
    num_seqs: float
    """Sequences with at least one unmasked token in the mini-batch."""
    scale_factor: float
    """Constant length for 'seq-mean-token-sum-norm' (Dr.GRPO's MAX_TOKENS)."""


@dataclass
class PolicyLossOutput:
    """Per-token losses [B, R] (or per-sequence [B]) plus metric token sums."""

    token_loss: torch.Tensor | None = None
    seq_loss: torch.Tensor | None = None
    agg_mode: str | None = None
    """Aggregation this loss requires (overrides the configured mode), e.g. SAPO's seq-mean-token-mean."""
    sums: dict[str, torch.Tensor] = field(default_factory=dict)


def aggregate(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, norm: LossNorm) -> torch.Tensor:
    """Scalar loss from per-token losses [B, R] (verl `agg_loss` with global batch normalisers).

    token-mean: sum / tokens; seq-mean-token-sum: sum over sequences of token sums / seqs;
    seq-mean-token-mean: sum of per-sequence token means / seqs; seq-mean-token-sum-norm: token
    sums / scale_factor, then the sequence mean (Dr.GRPO).
    """
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":
        return masked_sum(loss_mat, mask) / norm.num_tokens
    seq_sums = masked_sum(loss_mat, mask, dim=-1)
    if mode == "seq-mean-token-sum":
        return seq_sums.sum() / norm.num_seqs
    if mode == "seq-mean-token-mean":
        return (seq_sums / mask.sum(dim=-1).clamp(min=1)).sum() / norm.num_seqs
    if mode == "seq-mean-token-sum-norm":
        return (seq_sums / norm.scale_factor).sum() / norm.num_seqs
    raise ValueError(f"unknown loss aggregation {mode!r} (valid: {', '.join(AGG_MODES)})")


def _log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    return torch.clamp(logprobs - old_logprobs, min=-20.0, max=20.0)


def _sums(mask: torch.Tensor, log_ratio: torch.Tensor, clipped=None, clipped_lower=None) -> dict:
    with torch.no_grad():
        zeros = torch.zeros_like(log_ratio)
        return {
            "pg_clipfrac": masked_sum((clipped if clipped is not None else zeros).to(log_ratio.dtype), mask),
            "pg_clipfrac_lower": masked_sum(
                (clipped_lower if clipped_lower is not None else zeros).to(log_ratio.dtype), mask
            ),
            "ppo_kl": masked_sum(-log_ratio, mask),
        }


def ppo(logp, old, adv, mask, p: LossConfig) -> PolicyLossOutput:
    """PPO clip (verl 'vanilla'): max(-A r, -A clip(r, 1-low, 1+high)), and for A < 0 capped at
    -A * clip_ratio_c (dual-clip; 0 turns it off). r = exp(clamp(logp - old, -20, 20))."""
    log_ratio = _log_ratio(logp, old)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - p.clip_ratio_low, 1 + p.clip_ratio_high)
    loss = torch.maximum(unclipped, clipped)
    is_clipped, is_lower = clipped > unclipped, torch.zeros_like(mask)
    if p.clip_ratio_c:
        cap = -adv * p.clip_ratio_c
        is_lower = (loss > cap) & (adv < 0)
        loss = torch.where(adv < 0, torch.minimum(loss, cap), loss)
    return PolicyLossOutput(token_loss=loss, sums=_sums(mask, log_ratio, is_clipped, is_lower))


def gspo(logp, old, adv, mask, p: LossConfig) -> PolicyLossOutput:
    """GSPO (verl 'gspo'): sequence ratio s = exp(mean_t(logp - old)), applied per token as
    sg[s] * pi / sg[pi] (log clamped at 10), clipped like PPO. Aggregated with the configured loss_agg_mode
    as verl 0.9.1 does; the GSPO paper's sequence-level objective is seq-mean-token-mean."""
    log_ratio = logp - old
    seq_log_ratio = masked_sum(log_ratio, mask, dim=-1) / mask.sum(dim=-1).clamp(min=1)
    token_log = torch.clamp(logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1), max=10.0)
    ratio = torch.exp(token_log)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - p.clip_ratio_low, 1 + p.clip_ratio_high)
    loss = torch.maximum(unclipped, clipped)
    return PolicyLossOutput(token_loss=loss, sums=_sums(mask, log_ratio, clipped > unclipped))


def cispo(logp, old, adv, mask, p: LossConfig) -> PolicyLossOutput:
    """CISPO (MiniMax-M1; verl 'cispo'): -sg(clip(r, 1-low, 1+high)) * A * logp: the importance
    weight is clipped and detached, so every token keeps its gradient through logp."""
    log_ratio = _log_ratio(logp, old)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1 - p.clip_ratio_low, 1 + p.clip_ratio_high).detach()
    loss = -weight * adv * logp
    return PolicyLossOutput(token_loss=loss, sums=_sums(mask, log_ratio, weight != ratio.detach()))


def sapo(logp, old, adv, mask, p: LossConfig) -> PolicyLossOutput:
    """SAPO (verl 'sapo'): -f(r) * A with the soft gate f(r) = sigmoid(tau (r - 1)) * 4 / tau,
    tau = tau_pos for A > 0 else tau_neg; always seq-mean-token-mean."""
    log_ratio = _log_ratio(logp, old)
    ratio = torch.exp(log_ratio)
    tau = torch.where(adv > 0, torch.full_like(adv, p.tau_pos), torch.full_like(adv, p.tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return PolicyLossOutput(token_loss=-gate * adv, agg_mode="seq-mean-token-mean", sums=_sums(mask, log_ratio))


def gpg(logp, old, adv, mask, p: LossConfig) -> PolicyLossOutput:
    """GPG (verl 'gpg'): plain policy gradient -logp * A, no ratio and no clipping."""
    return PolicyLossOutput(token_loss=-logp * adv, sums=_sums(mask, _log_ratio(logp, old).detach()))


def clip_cov(logp, old, adv, mask, p: LossConfig) -> PolicyLossOutput:
    """Clip-Cov (verl 'clip_cov'): PPO without dual-clip, and a random clip_cov_ratio share of the
    tokens whose centred covariance (A - mean A)(logp - mean logp) lies in (lb, ub) get no gradient.
    Means and the random pick are over the micro-batch (as verl); the pick uses torch's seeded RNG."""
    log_ratio = logp - old
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - p.clip_ratio_low, 1 + p.clip_ratio_high)
    clipped_by_ppo = (clipped > unclipped) & mask
    cov = (adv - masked_mean(adv, mask)) * (logp - masked_mean(logp.detach(), mask))
    cov = cov.detach().masked_fill(~mask | clipped_by_ppo, float("-inf"))
    candidates = torch.nonzero((cov > p.clip_cov_lb) & (cov < p.clip_cov_ub) & mask)
    keep = torch.ones_like(adv)
    if len(candidates):
        count = max(int(p.clip_cov_ratio * int(mask.sum())), 1)
        pick = candidates[torch.randperm(len(candidates))[:count]]
        keep[pick[:, 0], pick[:, 1]] = 0
    loss = torch.maximum(unclipped, clipped) * keep
    return PolicyLossOutput(token_loss=loss, sums=_sums(mask, log_ratio, keep == 0))


def kl_cov(logp, old, adv, mask, p: LossConfig) -> PolicyLossOutput:
    """KL-Cov (verl 'kl_cov'): -A r, plus ppo_kl_coef * |logp - old| on the kl_cov_ratio share of
    tokens with the largest centred covariance (A - mean A)(logp - mean logp) (over the micro-batch)."""
    log_ratio = logp - old
    loss = -adv * torch.exp(log_ratio)
    flat = torch.nonzero(mask.reshape(-1), as_tuple=True)[0]
    if len(flat):
        a, lp = adv.reshape(-1)[flat].detach(), logp.reshape(-1)[flat].detach()
        cov = (a - a.mean()) * (lp - lp.mean())
        top = flat[torch.topk(cov, max(1, int(len(cov) * p.kl_cov_ratio))).indices]
        penalty = torch.zeros(adv.numel(), dtype=loss.dtype, device=loss.device)
        penalty[top] = 1.0
        loss = loss + p.ppo_kl_coef * log_ratio.abs() * penalty.view_as(loss)
    return PolicyLossOutput(token_loss=loss, sums=_sums(mask, _log_ratio(logp, old).detach()))


def geo_mean(logp, old, adv, mask, p: LossConfig) -> PolicyLossOutput:
    """GMPO (verl 'geo_mean'): per-token log ratios clipped to [-low, high] on the side the advantage
    sign makes pessimistic, ratio = exp(mean_t clipped log ratio), loss = -mean_t(A) * ratio per
    sequence, averaged over sequences (sequence-level advantages)."""
    log_ratio = logp - old
    sign = torch.sign(adv)
    clamped = torch.clamp(log_ratio, -p.clip_ratio_low, p.clip_ratio_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clamped)
    lengths = mask.sum(dim=-1)
    ratio = torch.exp(masked_sum(pessimistic, mask, dim=-1) / (lengths + 1e-8))
    seq_adv = masked_sum(adv, mask, dim=-1) / (lengths + 1e-8)
    changed = log_ratio != clamped
    return PolicyLossOutput(
        seq_loss=-seq_adv * ratio, sums=_sums(mask, log_ratio, changed & (adv > 0), changed & (adv < 0))
    )


POLICY_LOSSES: dict[str, Callable[..., PolicyLossOutput]] = {
    "ppo": ppo,
    "gspo": gspo,
    "cispo": cispo,
    "sapo": sapo,
    "gpg": gpg,
    "clip_cov": clip_cov,
    "kl_cov": kl_cov,
    "geo_mean": geo_mean,
}


def compute_policy_loss(
    name: str,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    norm: LossNorm,
    agg_mode: str = "token-mean",
    params: LossConfig | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """Policy loss `name` aggregated over a micro-batch with mini-batch normalisers.  Tensors [B, R].

    `is_weights` (detached rollout-correction weights) multiply the per-token losses; for
    sequence-level losses their per-sequence geometric mean is used (as verl).
    Returns (loss, token sums of the metrics).
    """
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r} (valid: {', '.join(POLICY_LOSSES)})")
    mask = mask.bool()
    out = POLICY_LOSSES[name](logprobs, old_logprobs, advantages, mask, params or LossConfig())
    if out.seq_loss is not None:
        seq_loss = out.seq_loss
        if is_weights is not None:
            lengths = mask.sum(dim=-1).clamp(min=1)
            seq_loss = seq_loss * torch.exp(masked_sum(torch.log(is_weights + 1e-10), mask, dim=-1) / lengths)
        loss = (seq_loss * (mask.sum(dim=-1) > 0)).sum() / norm.num_seqs
    else:
        token_loss = out.token_loss if is_weights is None else out.token_loss * is_weights
        loss = aggregate(token_loss, mask, out.agg_mode or agg_mode, norm)
    return loss, out.sums


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    norm: LossNorm,
    cliprange_value: float = 0.5,
    agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, dict]:
    """Clipped value loss (verl `compute_value_loss`): 0.5 * agg(max((v - R)^2, (clip(v, old ± c) - R)^2)).
    Returns (loss, token sums: vf_clipfrac)."""
    clipped_values = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    unclipped_err, clipped_err = (values - returns).square(), (clipped_values - returns).square()
    loss = 0.5 * aggregate(torch.maximum(unclipped_err, clipped_err), mask, agg_mode, norm)
    with torch.no_grad():
        sums = {"vf_clipfrac": masked_sum((clipped_err > unclipped_err).float(), mask.float())}
    return loss, sums
