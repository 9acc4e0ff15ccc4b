"""Training settings shared by `rlx train-step` and the `[train]` / `[critic.train]` tables (no torch import)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal

from rlx.config import check, check_choices
from rlx.models.vision.config import VisionConfig

PolicyLoss = Literal["ppo", "gspo", "cispo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean"]
AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@dataclass(kw_only=True)
class TrainConfig:
    """One PPO update of the actor (or the critic): optimizer, batching and loss settings."""

    role: Literal["actor", "critic"] = "actor"
    """Which model is trained: 'actor' (the policy) or 'critic' (a value model, clipped value loss)."""
    lr: float = 1e-6
    """AdamW learning rate (after warm-up)."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up over this many train steps (0 = none)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning rate after warm-up: constant, or decayed linearly / by a half cosine to lr * min_lr_ratio."""
    lr_decay_steps: int = 0
    """Train steps (warm-up included) after which linear/cosine decay reaches its floor; 0 = in `rlx ppo` the
    run's steps (a hand-run train-step must give it)."""
    min_lr_ratio: float = 0.0
    """Floor of the linear/cosine decay as a fraction of lr."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay, applied to every parameter."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW epsilon, added to the denominator for numerical stability."""
    epochs: int = 1
    """Passes over the batch per train step (PPO epochs)."""
    mini_batch_size: int = 0
    """Samples per optimizer step; 0 = the whole batch in one optimizer step."""
    micro_batch_size: int = 8
    """Samples per forward/backward pass; gradients accumulate over a mini-batch."""
    shuffle: bool = False
    """Shuffle samples into mini-batches each epoch (seeded by seed, step and epoch)."""
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
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 = no clipping."""
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
    ep_degree: int = 1
    """Mixture-of-experts models under FSDP: expert-parallel degree, ranks per group splitting each MoE layer's
    experts (tokens travel by all-to-all); must divide the number of processes and of experts (docs/moe.md)."""
    router_replay: Literal["off", "rollout"] = "off"
    """Mixture-of-experts actors: 'rollout' routes each response token to the experts the rollout recorded
    (rollouts' routed_experts; R3) in the training forward, keeping the router's weights for them; 'off' routes
    normally. moe/routing_mismatch is logged whenever the batch carries routing."""
    cliprange_value: float = 0.5
    """Critic: value predictions are clipped to old value +/- cliprange_value."""
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
    use_packing: bool = False
    """Concatenate each micro-batch's samples into one row (no padding, attention kept per sample)."""
    max_tokens_per_micro_batch: int = 0
    """Micro-batches by token budget (prompt + response tokens) instead of micro_batch_size (0 = off)."""
    gradient_checkpointing: bool = False
    """Recompute decoder-layer activations in the backward pass instead of storing them."""
    param_offload: bool = False
    """FSDP: keep parameter shards, gradients and AdamW state on the CPU (needs a launcher, e.g. torchrun)."""
    activation_offload: bool = False
    """Keep the activations saved for backward on the CPU."""
    compile: bool = False
    """torch.compile each decoder layer's forward (fuses norms, rotary and activations; the first steps compile)."""
    sp_degree: int = 1
    """Ulysses sequence-parallel degree: ranks per group sharing each sequence (heads must divide by it)."""
    logprob_impl: Literal["auto", "naive", "chunked", "triton"] = "auto"
    """Logprob/entropy computation: fused Triton kernels ('auto' picks them on CUDA with Triton), chunked
    PyTorch (bounded memory anywhere), or naive full logits ('auto' on CPU)."""
    exact: bool = False
    """Batch-invariant forward for the actor's logprobs (padded or packed): a batch scored and sampled in exact mode
    starts each update with new logprobs equal to the old ones bit for bit (docs/exact.md); sp_degree 1, no compile."""
    seed: int = 0
    """Seed for mini-batch shuffling, dropout and clip-cov's random pick; combined with the step number."""
    device: Literal["auto", "cpu", "cuda", "npu"] = "auto"
    """Where to train."""
    precision: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute precision (parameters and optimizer state stay float32)."""
    vision: VisionConfig = field(default_factory=VisionConfig)
    """Vision-language models: whether the vision tower trains, image sizes for reloading the batch's images
    (options --freeze-vision-tower/--no-freeze-vision-tower, --min-pixels, --max-pixels; `rlx ppo` takes them from
    the recipe's [vision] table)."""

    def __post_init__(self) -> None:
        check_choices(self)
        check(self.lr >= 0, "lr", f"must be >= 0, got {self.lr}")
        check(self.warmup_steps >= 0, "warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        check(self.lr_decay_steps >= 0, "lr_decay_steps", f"must be >= 0, got {self.lr_decay_steps}")
        check(
            self.lr_decay_steps == 0 or self.lr_decay_steps > self.warmup_steps,
            "lr_decay_steps",
            f"must be larger than warmup_steps ({self.warmup_steps}), got {self.lr_decay_steps}",
        )
        check(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        check(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            "betas",
            f"expected two numbers in [0, 1), got {self.betas}",
        )
        check(self.epochs >= 1, "epochs", f"must be at least 1, got {self.epochs}")
        check(self.mini_batch_size >= 0, "mini_batch_size", f"must be >= 0, got {self.mini_batch_size}")
        check(self.micro_batch_size >= 1, "micro_batch_size", f"must be at least 1, got {self.micro_batch_size}")
        check(0 <= self.clip_ratio_low < 1, "clip_ratio_low", f"must be in [0, 1), got {self.clip_ratio_low}")
        check(self.clip_ratio_high >= 0, "clip_ratio_high", f"must be >= 0, got {self.clip_ratio_high}")
        check(
            self.clip_ratio_c == 0 or self.clip_ratio_c > 1,
            "clip_ratio_c",
            f"must be > 1 (or 0 for off), got {self.clip_ratio_c}",
        )
        check(self.tau_pos > 0 and self.tau_neg > 0, "tau_pos", "SAPO temperatures must be > 0")
        check(self.max_grad_norm >= 0, "max_grad_norm", f"must be >= 0, got {self.max_grad_norm}")
        check(self.kl_loss_coef >= 0, "kl_loss_coef", f"must be >= 0, got {self.kl_loss_coef}")
        check(self.moe_aux_loss_coef >= 0, "moe_aux_loss_coef", f"must be >= 0, got {self.moe_aux_loss_coef}")
        check(self.router_z_loss_coef >= 0, "router_z_loss_coef", f"must be >= 0, got {self.router_z_loss_coef}")
        check(self.ep_degree >= 1, "ep_degree", f"must be at least 1, got {self.ep_degree}")
        check(self.ep_degree == 1 or not self.param_offload, "ep_degree", "expert parallelism with param_offload "
              "is not supported yet")  # fmt: skip
        check(self.cliprange_value > 0, "cliprange_value", f"must be > 0, got {self.cliprange_value}")
        check(self.rollout_is_threshold > 0, "rollout_is_threshold", f"must be > 0, got {self.rollout_is_threshold}")
        check(self.loss_scale_factor >= 0, "loss_scale_factor", f"must be >= 0, got {self.loss_scale_factor}")
        check(
            self.max_tokens_per_micro_batch >= 0,
            "max_tokens_per_micro_batch",
            f"must be >= 0, got {self.max_tokens_per_micro_batch}",
        )
        check(self.sp_degree >= 1, "sp_degree", f"must be at least 1, got {self.sp_degree}")
        check(self.sp_degree == 1 or self.use_packing, "sp_degree", "sequence parallelism needs use_packing = true")
        check(not self.exact or self.sp_degree == 1, "exact", "runs with sp_degree = 1 only")
        check(not self.exact or not self.compile, "exact", "runs the layers eagerly: set compile = false")

    def lr_at(self, step: int) -> float:
        """Learning rate for the update that follows `step` completed updates.

        Warm-up: lr * (step + 1) / warmup_steps for the first warmup_steps updates. Then 'constant' keeps lr;
        'linear' and 'cosine' go from lr at step warmup_steps to lr * min_lr_ratio at step lr_decay_steps
        (progress p = (step - warmup) / (decay - warmup): factor 1 - p, or (1 + cos(pi p)) / 2, scaled into
        [min_lr_ratio, 1]) and stay at the floor after it.
        """
        if self.lr_schedule == "constant" or step < self.warmup_steps:
            if self.warmup_steps > 0:
                return self.lr * min(1.0, (step + 1) / self.warmup_steps)
            return self.lr
        if self.lr_decay_steps <= self.warmup_steps:
            raise ValueError(f"lr_schedule {self.lr_schedule!r} needs lr_decay_steps > warmup_steps")
        progress = min(1.0, (step - self.warmup_steps) / (self.lr_decay_steps - self.warmup_steps))
        shape = 1.0 - progress if self.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape)

    def with_decay_length(self, steps: int) -> TrainConfig:
        """This config with lr_decay_steps = `steps` where it is 0 (`rlx ppo`: the decay spans the run)."""
        if self.lr_decay_steps or self.lr_schedule == "constant":
            return self
        return dataclasses.replace(self, lr_decay_steps=steps)
