"""SFT settings shared by `rlx sft` and the `[sft]` table of a recipe (no torch import)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal

from rlx.config import check, check_choices
from rlx.training.config import TrainConfig


@dataclass(kw_only=True)
class SFTConfig:
    """Supervised fine-tuning on demonstrations: token-mean NLL over the assistant's tokens, AdamW."""

    data: str = ""
    """Demonstrations JSONL: {"messages": [...], "tools": [...]} per line (OpenAI chat format) or {"prompt": ...,
    "response": ...}; in a recipe, relative to the recipe's folder (required)."""
    epochs: int = 1
    """Passes over the demonstrations."""
    max_steps: int = 0
    """Stop after this many optimizer steps (0 = when the epochs are done)."""
    lr: float = 1e-5
    """AdamW learning rate (after warm-up)."""
    batch_size: int = 32
    """Demonstrations per optimizer step (the last step of an epoch takes what is left)."""
    micro_batch_size: int = 8
    """Demonstrations per forward/backward pass; gradients accumulate over a batch."""
    max_length: int = 0
    """Longest demonstration in tokens (prompt and response); 0 = the model's context (max_position_embeddings)."""
    on_long_sample: Literal["error", "skip"] = "error"
    """A demonstration longer than max_length: 'error' (verl's default) or 'skip' it and print the count. Never
    truncated: a cut turn would teach the model to stop without its end-of-turn token."""
    chat_template_kwargs: dict = field(default_factory=dict)
    """Extra variables for the chat template, e.g. {"enable_thinking": false} for Qwen3 templates (under `rlx ppo`,
    [rollout]'s are used when [sft] gives none, so demonstrations are rendered as the rollouts will be)."""
    shuffle: bool = True
    """Visit the demonstrations in a new seeded order every epoch (else file order)."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up over this many optimizer steps."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning rate after warm-up: constant, or decayed linearly / by a half cosine to lr * min_lr_ratio at
    lr_decay_steps (default: the last step)."""
    lr_decay_steps: int = 0
    """Optimizer steps (warm-up included) after which linear/cosine decay reaches its floor; 0 = the run's steps."""
    min_lr_ratio: float = 0.0
    """Floor of the linear/cosine decay as a fraction of lr."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 = no clipping."""
    use_packing: bool = False
    """Concatenate each micro-batch's demonstrations into one row (no padding, attention kept per sample)."""
    gradient_checkpointing: bool = False
    """Recompute decoder-layer activations in the backward pass instead of storing them."""
    seed: int = 0
    """Seed of the demonstration order and dropout (and of --init random); in a recipe the run's seed is used."""
    device: Literal["auto", "cpu", "cuda", "npu"] = "auto"
    """Where to train."""
    precision: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute precision (parameters and optimizer state stay float32)."""

    def __post_init__(self) -> None:
        check_choices(self)
        check(self.epochs >= 1, "epochs", f"must be at least 1, got {self.epochs}")
        check(self.max_steps >= 0, "max_steps", f"must be >= 0, got {self.max_steps}")
        check(self.lr >= 0, "lr", f"must be >= 0, got {self.lr}")
        check(self.batch_size >= 1, "batch_size", f"must be at least 1, got {self.batch_size}")
        check(self.micro_batch_size >= 1, "micro_batch_size", f"must be at least 1, got {self.micro_batch_size}")
        check(self.max_length >= 0, "max_length", f"must be >= 0, got {self.max_length}")
        check(self.warmup_steps >= 0, "warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        check(self.lr_decay_steps >= 0, "lr_decay_steps", f"must be >= 0, got {self.lr_decay_steps}")
        check(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        check(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        check(self.max_grad_norm >= 0, "max_grad_norm", f"must be >= 0, got {self.max_grad_norm}")

    def num_steps(self, num_samples: int) -> int:
        """Optimizer steps over `num_samples` demonstrations: epochs x batches, capped by max_steps."""
        steps = self.epochs * math.ceil(num_samples / self.batch_size)
        return min(steps, self.max_steps) if self.max_steps else steps

    def train_config(self, num_steps: int) -> TrainConfig:
        """The trainer's settings: one optimizer step per call, the learning-rate schedule over `num_steps`."""
        decays = self.lr_schedule != "constant"
        decay_steps = self.lr_decay_steps or num_steps
        check(
            not decays or decay_steps > self.warmup_steps,
            "warmup_steps",
            f"a decaying lr needs more steps ({decay_steps}) than warm-up steps ({self.warmup_steps})",
        )
        return TrainConfig(
            lr=self.lr,
            warmup_steps=self.warmup_steps,
            lr_schedule=self.lr_schedule,
            lr_decay_steps=decay_steps if decays else 0,
            min_lr_ratio=self.min_lr_ratio,
            weight_decay=self.weight_decay,
            max_grad_norm=self.max_grad_norm,
            micro_batch_size=self.micro_batch_size,
            use_packing=self.use_packing,
            gradient_checkpointing=self.gradient_checkpointing,
            seed=self.seed,
            device=self.device,
            precision=self.precision,
        )

    def with_seed(self, seed: int) -> SFTConfig:
        return dataclasses.replace(self, seed=seed)
