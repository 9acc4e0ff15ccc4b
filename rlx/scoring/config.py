"""Scoring settings shared by `rlx score` and the `[score]` table of a recipe (no torch import)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rlx.config import check, check_choices
from rlx.models.vision.config import VisionConfig

Estimator = Literal[
    "grpo", "gae", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "opo", "gpg", "grpo_passk"
]


@dataclass(kw_only=True)
class ScoreConfig:
    """How rollouts become rewards, advantages and a training batch."""

    reward: list[str] | str = field(default_factory=list)
    """Reward functions, each NAME or NAME=WEIGHT: arith, gsm8k, math, module:function, file.py:function.
    Empty = the built-in named by each sample's data_source. The reward is the weighted sum."""
    reward_model: str | None = None
    """A sequence-classification reward model (HF dir or checkpoint), scored at the last token."""
    reward_model_weight: float = 1.0
    """Weight of the reward model's score in the sum."""
    estimator: Estimator = "grpo"
    """Advantage estimator: grpo, gae (needs a critic), rloo, reinforce_plus_plus, reinforce_plus_plus_baseline,
    remax (needs rollout --remax-baseline), opo, gpg, grpo_passk."""
    norm_adv_by_std: bool = True
    """GRPO and pass@k: divide by the group std (false gives Dr.GRPO)."""
    gamma: float = 1.0
    """Discount factor (gae, reinforce_plus_plus)."""
    lam: float = 1.0
    """GAE lambda: trades bias for variance in the advantage (1 = Monte Carlo returns minus values)."""
    whiten_advantages: bool = True
    """GAE: whiten advantages over the batch (verl always does)."""
    kl_coef: float = 0.0
    """In-reward KL penalty coefficient (needs --ref): token reward -= kl_coef * KL."""
    kl_ctrl: Literal["fixed", "adaptive"] = "fixed"
    """KL coefficient controller: fixed, or adaptive towards kl_target (Ziegler et al.)."""
    kl_target: float = 0.1
    """Adaptive controller: target KL per token."""
    kl_horizon: int = 10000
    """Adaptive controller: horizon in samples."""
    kl_estimator: Literal["k1", "k2", "k3", "abs"] = "k1"
    """KL estimator for the in-reward penalty and the actor/ref_kl metric."""
    filter_groups: bool = False
    """DAPO dynamic sampling: leave out prompts whose samples all got the same reward (no learning signal)."""
    overlong_buffer: int = 0
    """DAPO overlong shaping: responses longer than max_response_length - overlong_buffer lose reward
    linearly, up to overlong_penalty at max_response_length (0 = off)."""
    overlong_penalty: float = 1.0
    """DAPO overlong shaping: the largest penalty."""
    max_response_length: int = 0
    """The rollout's max_new_tokens (overlong shaping needs it; rlx ppo fills it in)."""
    on_reward_error: Literal["raise", "zero"] = "raise"
    """When a reward function raises or returns NaN: 'raise' stops naming the sample; 'zero' scores it 0
    and counts it in reward/num_errors."""
    max_reward_error_fraction: float = 0.1
    """With on_reward_error 'zero': stop (naming the first failing sample) when more than this fraction of a
    batch's samples fail; 1 never stops."""
    old_logprobs: Literal["actor", "rollout", "train", "auto"] = "actor"
    """PPO's old logprobs: recomputed by the actor ('actor', as verl), the sampler's ('rollout', no forward), or the
    train step's own forward ('train', as TRL with one update per batch: no score forward; the batch holds the
    rollout's logprobs in their place and says so, and `rlx train-step` takes them from its forward, detached: it needs
    train.epochs = 1, one mini-batch and no rejection in train.correction). 'auto' is 'train' where `rlx ppo` can take
    it (the fast path on GPUs sets it), else 'actor'; `rlx score` reads it as 'actor'."""
    vision: VisionConfig = field(default_factory=VisionConfig)
    """Vision-language models: image sizes (as the rollout's) and whether batch.safetensors stores pixels (options
    --min-pixels, --max-pixels, --store-pixels; `rlx ppo` takes them from the recipe's [vision] table)."""
    logprob_impl: Literal["auto", "naive", "chunked", "triton"] = "auto"
    """Logprob/entropy computation: fused Triton kernels ('auto' picks them on CUDA with Triton), chunked
    PyTorch (bounded memory anywhere), or naive full logits ('auto' on CPU)."""
    micro_batch_size: int = 16
    """Sequences per forward pass when computing logprobs and values."""
    use_packing: bool = False
    """Run each forward pass as one packed row without padding (attention kept per sample), micro-batches cut by
    max_tokens_per_micro_batch (as train.use_packing)."""
    max_tokens_per_micro_batch: int = 16384
    """With use_packing: prompt + response tokens per forward pass."""
    router_replay: Literal["off", "rollout"] = "off"
    """Mixture-of-experts actors: 'rollout' forces the experts the rollout recorded (routed_experts) in the
    old-logprob forward (as train.router_replay); moe/routing_mismatch is logged whenever the rollouts carry
    routing."""
    exact: bool = False
    """Batch-invariant old logprobs: the actor's forward in exact mode, equal bit for bit to an exact-mode rollout's
    logprobs (`rlx rollout --exact`; docs/exact.md). Padded or packed alike; fsdp/single-device actors only."""
    device: Literal["auto", "cpu", "cuda", "npu"] = "auto"
    """Where to run the actor, reference, critic and reward models."""
    precision: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute precision for the forward passes."""

    def __post_init__(self) -> None:
        if isinstance(self.reward, str):
            self.reward = [self.reward]
        check_choices(self)
        check(self.kl_coef >= 0, "kl_coef", f"must be >= 0, got {self.kl_coef}")
        check(
            self.old_logprobs != "train" or self.kl_coef == 0,
            "old_logprobs",
            "'train' leaves them to the train step, but kl_coef > 0 (the in-reward KL) reads them here: use 'actor'",
        )
        check(
            0 <= self.max_reward_error_fraction <= 1,
            "max_reward_error_fraction",
            f"must be in [0, 1], got {self.max_reward_error_fraction}",
        )
        check(self.kl_target > 0, "kl_target", f"must be > 0, got {self.kl_target}")
        check(self.kl_horizon > 0, "kl_horizon", f"must be > 0, got {self.kl_horizon}")
        check(0 <= self.gamma <= 1, "gamma", f"must be in [0, 1], got {self.gamma}")
        check(0 <= self.lam <= 1, "lam", f"must be in [0, 1], got {self.lam}")
        check(self.overlong_buffer >= 0, "overlong_buffer", f"must be >= 0, got {self.overlong_buffer}")
        check(
            self.max_response_length == 0 or self.max_response_length > self.overlong_buffer,
            "max_response_length",
            "must be larger than overlong_buffer",
        )
        check(self.micro_batch_size >= 1, "micro_batch_size", f"must be at least 1, got {self.micro_batch_size}")
        check(
            self.max_tokens_per_micro_batch >= 1,
            "max_tokens_per_micro_batch",
            f"must be at least 1, got {self.max_tokens_per_micro_batch}",
        )
