"""Training settings shared by `rlx train-step` and the `[train]` / `[critic.train]` tables (no torch import);
`OptimConfig`, AdamW and its learning-rate schedule, is also `rlx sft`'s."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal

from rlx.algorithms.config import CorrectionConfig, LossConfig
from rlx.config import check, check_choices
from rlx.models.vision.config import VisionConfig


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW and its learning-rate schedule (`[train.optim]`, `[critic.train.optim]`, `[sft.optim]`)."""

    lr: float = 1e-6
    """AdamW learning rate (after warm-up)."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up over this many optimizer (train) steps (0 = none)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning rate after warm-up: constant, or decayed linearly / by a half cosine to lr * min_lr_ratio."""
    lr_decay_steps: int = 0
    """Steps (warm-up included) after which linear/cosine decay reaches its floor; 0 = the run's steps (`rlx ppo`,
    `rlx sft`; a hand-run train-step must give it)."""
    min_lr_ratio: float = 0.0
    """Floor of the linear/cosine decay as a fraction of lr."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay, applied to every parameter."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW epsilon, added to the denominator for numerical stability."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 = no clipping."""

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
        check(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        check(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            "betas",
            f"expected two numbers in [0, 1), got {self.betas}",
        )
        check(self.max_grad_norm >= 0, "max_grad_norm", f"must be >= 0, got {self.max_grad_norm}")

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

    def with_decay_length(self, steps: int) -> OptimConfig:
        """This schedule with lr_decay_steps = `steps` where it is 0 (the decay spans the run's `steps`)."""
        if self.lr_decay_steps or self.lr_schedule == "constant":
            return self
        return dataclasses.replace(self, lr_decay_steps=steps)


@dataclass(kw_only=True)
class TrainConfig:
    """One PPO update of the actor (or the critic): optimizer, batching and loss settings."""

    role: Literal["actor", "critic"] = "actor"
    """Which model is trained: 'actor' (the policy) or 'critic' (a value model, clipped value loss)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW and its learning-rate schedule (the recipe's [train.optim] table)."""
    loss: LossConfig = field(default_factory=LossConfig)
    """The policy (or value) loss, its aggregation, KL, entropy and MoE terms (the recipe's [train.loss] table)."""
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    """Rollout correction: importance weights and rejection (the recipe's [train.correction] table)."""
    epochs: int = 1
    """Passes over the batch per train step (PPO epochs)."""
    mini_batch_size: int = 0
    """Samples per optimizer step; 0 = the whole batch in one optimizer step. It must divide the batch (`rlx ppo`:
    data.prompts_per_step x rollout.sampling.n), else the last optimizer step of each epoch would take fewer
    samples; a size of the batch or more is one optimizer step."""
    micro_batch_size: int = 8
    """Samples per forward/backward pass; gradients accumulate over a mini-batch."""
    shuffle: bool = False
    """Shuffle samples into mini-batches each epoch (seeded by seed, step and epoch)."""
    ep_degree: int = 1
    """Mixture-of-experts models under FSDP: expert-parallel degree, ranks per group splitting each MoE layer's
    experts (tokens travel by all-to-all); must divide the number of processes and of experts (docs/moe.md)."""
    router_replay: Literal["off", "rollout"] = "off"
    """Mixture-of-experts actors: 'rollout' routes each response token to the experts the rollout recorded
    (rollouts' routed_experts; R3) in the training forward, keeping the router's weights for them; 'off' routes
    normally. moe/routing_mismatch is logged whenever the batch carries routing."""
    use_packing: bool = False
    """Concatenate each micro-batch's samples into one row (no padding, attention kept per sample)."""
    max_tokens_per_micro_batch: int = 0
    """Micro-batches by token budget (prompt + response tokens) instead of micro_batch_size (0 = off): a rank's
    samples in the fewest micro-batches of at most this many tokens (the same count on every data-parallel rank),
    split evenly."""
    gradient_checkpointing: bool = False
    """Recompute decoder-layer activations in the backward pass instead of storing them."""
    grad_accumulation: Literal["unsharded", "sharded"] = "unsharded"
    """FSDP with several micro-batches per optimizer step: 'unsharded' keeps a whole float32 gradient on every rank
    and reduce-scatters it once after the last micro-batch (fewest collectives; 4 bytes per parameter more memory),
    'sharded' reduce-scatters after every micro-batch into the gradient shards (no whole copy; one collective per
    micro-batch, overlapped with the backward). `rlx ppo` on GPUs lets the memory plan choose when unset."""
    keep_gathered: bool = False
    """FSDP: keep every layer's gathered bf16 parameters from the first micro-batch's forward to the last one's
    backward, and over the score phase's forwards of this model: one all-gather per layer and phase instead of one
    or two per micro-batch (fewer collectives and less host work; 2 bytes per parameter more memory while the
    phase runs). `rlx ppo` on GPUs lets the memory plan choose when unset."""
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
        check(self.epochs >= 1, "epochs", f"must be at least 1, got {self.epochs}")
        check(self.mini_batch_size >= 0, "mini_batch_size", f"must be >= 0, got {self.mini_batch_size}")
        check(self.micro_batch_size >= 1, "micro_batch_size", f"must be at least 1, got {self.micro_batch_size}")
        check(self.ep_degree >= 1, "ep_degree", f"must be at least 1, got {self.ep_degree}")
        check(self.ep_degree == 1 or not self.param_offload, "ep_degree", "expert parallelism with param_offload "
              "is not supported yet")  # fmt: skip
        check(
            self.max_tokens_per_micro_batch >= 0,
            "max_tokens_per_micro_batch",
            f"must be >= 0, got {self.max_tokens_per_micro_batch}",
        )
        check(self.sp_degree >= 1, "sp_degree", f"must be at least 1, got {self.sp_degree}")
        check(self.sp_degree == 1 or self.use_packing, "sp_degree", "sequence parallelism needs use_packing = true")
        check(not self.exact or self.sp_degree == 1, "exact", "runs with sp_degree = 1 only")
        check(not self.exact or not self.compile, "exact", "runs the layers eagerly: set compile = false")

    def updates_once(self, samples: int) -> bool:
        """Whether a batch of `samples` makes one optimizer step (one epoch, one mini-batch): the policy the forward
        sees is the one that sampled, so the old logprobs need no forward of their own."""
        return self.epochs == 1 and (self.mini_batch_size == 0 or self.mini_batch_size >= samples)

    def mini_batch_sizes(self, samples: int) -> list[int]:
        """The samples of each optimizer step in an epoch over a batch of `samples`, as Trainer.train_step cuts it:
        mini_batch_size at a time (0: all of it), the last taking what is left."""
        mini = self.mini_batch_size or samples or 1
        return [min(mini, samples - lo) for lo in range(0, samples, mini)]

    def uneven_mini_batches(self, samples: int, what: str = "") -> str | None:
        """Why a batch of `samples` (`what`: where they come from) cuts into unequal mini-batches, the last optimizer
        step of each epoch on fewer samples (a noisier step at the same learning rate), with the nearest sizes that
        divide it; None when the mini-batches are equal."""
        sizes = self.mini_batch_sizes(samples)
        if len(set(sizes)) <= 1:
            return None
        mini = self.mini_batch_size
        divisors = [d for d in range(1, samples + 1) if samples % d == 0]
        below, above = max(d for d in divisors if d < mini), min(d for d in divisors if d > mini)
        whole = f" ({above} or 0: the whole batch in one optimizer step)" if above == samples else ""
        return (
            f"{mini} does not divide the {samples} samples{what}: {describe_sizes(sizes)} each epoch; nearest sizes "
            f"that divide it: {below} or {above}{whole}"
        )

    def with_decay_length(self, steps: int) -> TrainConfig:
        """This config with optim.lr_decay_steps = `steps` where it is 0 (`rlx ppo`: the decay spans the run)."""
        optim = self.optim.with_decay_length(steps)
        return self if optim is self.optim else dataclasses.replace(self, optim=optim)


def describe_ranks(dp_size: int, world: int) -> str:
    """The data-parallel ranks a mini-batch is split over, in words: 'the 4 data-parallel ranks (8 training processes,
    2 to a model replica)' (`world`: the training processes)."""
    ranks = f"the {dp_size} data-parallel ranks ({world} training processes"
    return ranks + (f", {world // dp_size} to a model replica)" if world != dp_size else ")")


def sizes_for_ranks(samples: int, dp_size: int) -> str:
    """The mini-batch sizes that cut `samples` into equal mini-batches of a sample or more per data-parallel rank, in
    words: '2, 4, 8' ('...' past four)."""
    fits = [size for size in range(dp_size, samples + 1) if samples % size == 0]
    return ", ".join(map(str, fits[:4])) + (", ..." if len(fits) > 4 else "")


def describe_sizes(sizes: list[int]) -> str:
    """Unequal mini-batch sizes (TrainConfig.mini_batch_sizes) in words: '2 optimizer steps of 20 and one of 8'."""
    many = len(sizes) - 1
    return f"{many} optimizer step{'s' if many > 1 else ''} of {sizes[0]} and one of {sizes[-1]}"
