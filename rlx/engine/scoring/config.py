"""Scoring settings shared by `rlx score` and the `[score]` table of a recipe (no torch import)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlx.config import check, check_choices


@dataclass(kw_only=True)
class ScoreConfig:
    """How rollouts become rewards, advantages and a training batch."""

    reward: str | None = None
    """Reward function: arith, gsm8k, math, module:function or file.py:function; unset = by data_source."""
    estimator: Literal["grpo"] = "grpo"
    """Advantage estimator: 'grpo' (group mean/std over the N samples of a prompt)."""
    norm_adv_by_std: bool = True
    """GRPO: divide by the group std (false gives Dr.GRPO's mean-centred advantages)."""
    kl_coef: float = 0.0
    """In-reward KL penalty coefficient (needs a reference model): token reward -= kl_coef * KL."""
    kl_estimator: Literal["k1", "k2", "k3", "abs"] = "k1"
    """KL estimator for the in-reward penalty and the reported actor/ref_kl metric."""
    on_reward_error: Literal["raise", "zero"] = "raise"
    """When a reward function raises or returns NaN: 'raise' stops naming the sample; 'zero' scores it 0
    and counts it in reward/num_errors."""
    old_logprobs: Literal["actor", "rollout"] = "actor"
    """PPO's old logprobs: recomputed by the actor ('actor', as verl) or the sampler's ('rollout', no forward)."""
    micro_batch_size: int = 16
    """Sequences per forward pass when computing logprobs."""
    device: Literal["auto", "cpu", "cuda", "npu"] = "auto"
    """Where to run the actor and reference models."""
    precision: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute precision for the logprob forward passes."""

    def __post_init__(self) -> None:
        check_choices(self)
        check(self.kl_coef >= 0, "kl_coef", f"must be >= 0, got {self.kl_coef}")
        check(self.micro_batch_size >= 1, "micro_batch_size", f"must be at least 1, got {self.micro_batch_size}")
