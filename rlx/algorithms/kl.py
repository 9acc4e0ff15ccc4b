"""KL estimators between the policy and the reference, and the in-reward KL coefficient controllers.

Estimator names follow verl's `kl_penalty` (with its aliases): k1/kl, abs, k2/mse, k3/low_var_kl.
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3", "abs")
_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || ref) from sampled-token logprobs.  [B, R] -> [B, R].

    k1: logp - ref (unbiased, high variance); abs: |logp - ref|; k2: 0.5 (logp - ref)^2;
    k3: exp(ref - logp) - (ref - logp) - 1 with the log-ratio clamped to [-20, 20] and the result
    to [-10, 10] (verl's 'low_var_kl'; unbiased, low variance, never negative).
    """
    kind = _ALIASES.get(kind, kind)
    diff = logprobs - ref_logprobs
    if kind == "k1":
        return diff
    if kind == "abs":
        return diff.abs()
    if kind == "k2":
        return 0.5 * diff.square()
    if kind == "k3":
        log_ratio = torch.clamp(-diff, min=-20, max=20)
        return torch.clamp(log_ratio.exp() - log_ratio - 1, min=-10, max=10)
    raise ValueError(f"unknown KL estimator {kind!r} (valid: {', '.join(KL_ESTIMATORS)})")


def adaptive_kl_coef(coef: float, current_kl: float, target_kl: float, horizon: int, num_samples: int) -> float:
    """Next coefficient of the adaptive controller (Ziegler et al. 2019, verl `AdaptiveKLController`):
    coef * (1 + clip(kl / target - 1, -0.2, 0.2) * num_samples / horizon)."""
    error = min(max(current_kl / target_kl - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * num_samples / horizon)
