"""The loss and rollout-correction settings: `[train.loss]` and `[train.correction]` of a recipe, `rlx train-step`'s
loss options. The losses (rlx/algorithms/losses.py) and the correction (rollout_correction.py) read these objects
as they are (no torch import here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlx.config import check, check_choices

PolicyLoss = Literal["ppo", "gspo", "cispo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean"]
AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@dataclass(kw_only=True)
class LossConfig:
    """What the update minimises: the policy loss and its clipping, its aggregation, the KL, entropy and MoE terms,
    and the critic's value clip."""

    policy_loss: PolicyLoss = "ppo"
    """Policy loss: ppo (clip + dual-clip), gspo, cispo, sapo, gpg, clip_cov, kl_cov, geo_mean."""
    loss_agg_mode: AggMode = "token-mean"
    """How token losses become a scalar: token-mean, seq-mean-token-sum, seq-mean-token-mean,
    seq-mean-token-sum-norm (normalisers are counted over the whole mini-batch; GSPO's paper objective is
    seq-mean-token-mean, SAPO always uses it)."""
    loss_scale_factor: int = 0
    """seq-mean-token-sum-norm's constant length (Dr.GRPO's MAX_TOKENS); 0 = the batch's response width."""
    clip_ratio_low: float = 0.2
    """PPO clip: ratio is clipped below at 1 - clip_ratio_low (also GSPO, CISPO, GMPO, clip-cov)."""
    clip_ratio_high: float = 0.2
    """PPO clip: ratio is clipped above at 1 + clip_ratio_high (0.28 is DAPO's clip-higher)."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages (loss capped at -A * c); 0 turns dual-clip off."""
    tau_pos: float = 1.0
    """SAPO gate temperature for positive advantages."""
    tau_neg: float = 1.05
    """SAPO gate temperature for negative advantages."""
    clip_cov_ratio: float = 0.0002
    """Clip-Cov: share of tokens whose gradient is removed."""
    clip_cov_lb: float = 1.0
    """Clip-Cov: lower covariance bound of the candidates."""
    clip_cov_ub: float = 5.0
    """Clip-Cov: upper covariance bound of the candidates."""
    kl_cov_ratio: float = 0.0002
    """KL-Cov: share of tokens with the |log ratio| penalty."""
    ppo_kl_coef: float = 1.0
    """KL-Cov: weight of the |log ratio| penalty."""
    kl_loss_coef: float = 0.0
    """Weight of a KL(policy || ref) loss term (needs ref logprobs in the batch: score with --ref)."""
    kl_loss_type: Literal["k1", "k2", "k3", "abs"] = "k3"
    """KL estimator for the KL loss term ('k3' is verl's low_var_kl)."""
    entropy_coef: float = 0.0
    """Entropy bonus weight (loss -= entropy_coef * aggregated token entropy)."""
    moe_aux_loss_coef: float = 0.0
    """Mixture-of-experts actors: weight of the routers' load-balancing loss (0 = off); the metrics
    actor/moe_aux_loss and actor/moe_max_expert_load are logged for any MoE actor."""
    router_z_loss_coef: float = 0.0
    """Mixture-of-experts actors: weight of the routers' z-loss, the mean squared log-sum-exp of the router logits
    (0 = off; ST-MoE uses 1e-3); actor/moe_router_z_loss is logged for any MoE actor."""
    cliprange_value: float = 0.5
    """Critic: value predictions are clipped to old value +/- cliprange_value."""

    def __post_init__(self) -> None:
        check_choices(self)
        check(0 <= self.clip_ratio_low < 1, "clip_ratio_low", f"must be in [0, 1), got {self.clip_ratio_low}")
        check(self.clip_ratio_high >= 0, "clip_ratio_high", f"must be >= 0, got {self.clip_ratio_high}")
        check(
            self.clip_ratio_c == 0 or self.clip_ratio_c > 1,
            "clip_ratio_c",
            f"must be > 1 (or 0 for off), got {self.clip_ratio_c}",
        )
        check(self.tau_pos > 0 and self.tau_neg > 0, "tau_pos", "SAPO temperatures must be > 0")
        check(self.kl_loss_coef >= 0, "kl_loss_coef", f"must be >= 0, got {self.kl_loss_coef}")
        check(self.moe_aux_loss_coef >= 0, "moe_aux_loss_coef", f"must be >= 0, got {self.moe_aux_loss_coef}")
        check(self.router_z_loss_coef >= 0, "router_z_loss_coef", f"must be >= 0, got {self.router_z_loss_coef}")
        check(self.cliprange_value > 0, "cliprange_value", f"must be > 0, got {self.cliprange_value}")
        check(self.loss_scale_factor >= 0, "loss_scale_factor", f"must be >= 0, got {self.loss_scale_factor}")


@dataclass(kw_only=True)
class CorrectionConfig:
    """Rollout correction: importance weights and rejection for the gap between the sampler's logprobs and the
    trainer's (rlx/algorithms/rollout_correction.py)."""

    rollout_is: Literal["none", "token", "sequence"] = "none"
    """Rollout correction: truncated importance weights exp(old - rollout) per token or per sequence."""
    rollout_is_threshold: float = 2.0
    """Rollout correction: upper bound of the importance weights."""
    rollout_rs: Literal["none", "token", "sequence", "geometric"] = "none"
    """Rollout correction: reject tokens or sequences whose ratio (token, product, geometric mean) is out of bounds."""
    rollout_rs_threshold: float = 0.0
    """Rejection upper bound; 0 = rollout_is_threshold."""
    rollout_rs_threshold_lower: float = 0.0
    """Rejection lower bound; 0 = 1 / upper bound."""
    rollout_veto_threshold: float = 0.0
    """Reject a whole sequence when any token's ratio is below this (0 = off; e.g. 1e-4)."""

    def __post_init__(self) -> None:
        check_choices(self)
        check(self.rollout_is_threshold > 0, "rollout_is_threshold", f"must be > 0, got {self.rollout_is_threshold}")

    @property
    def active(self) -> bool:
        """Whether the correction changes anything (weights, rejection or veto)."""
        return self.rollout_is != "none" or self.rollout_rs != "none" or self.rollout_veto_threshold > 0
