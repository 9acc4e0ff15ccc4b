"""SFT settings shared by `rlx sft` and the `[sft]` table of a recipe (no torch import)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal

from rlx.config import check, check_choices
from rlx.training.config import OptimConfig, TrainConfig


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
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """AdamW and its learning-rate schedule (the recipe's [sft.optim] table; steps are optimizer steps, and
    lr_decay_steps 0 decays over the run's last step)."""
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
        check(self.batch_size >= 1, "batch_size", f"must be at least 1, got {self.batch_size}")
        check(self.micro_batch_size >= 1, "micro_batch_size", f"must be at least 1, got {self.micro_batch_size}")
        check(self.max_length >= 0, "max_length", f"must be >= 0, got {self.max_length}")

    def num_steps(self, num_samples: int) -> int:
        """Optimizer steps over `num_samples` demonstrations: epochs x batches, capped by max_steps."""
        steps = self.epochs * math.ceil(num_samples / self.batch_size)
        return min(steps, self.max_steps) if self.max_steps else steps

    def train_config(self, num_steps: int) -> TrainConfig:
        """The trainer's settings: one optimizer step per call, the learning-rate schedule over `num_steps`."""
        optim = self.optim.with_decay_length(num_steps)
        check(
            optim.lr_schedule == "constant" or optim.lr_decay_steps > optim.warmup_steps,
            "optim.warmup_steps",
            f"a decaying lr needs more steps ({optim.lr_decay_steps}) than warm-up steps ({optim.warmup_steps})",
        )
        return TrainConfig(
            optim=optim,
            micro_batch_size=self.micro_batch_size,
            use_packing=self.use_packing,
            gradient_checkpointing=self.gradient_checkpointing,
            seed=self.seed,
            device=self.device,
            precision=self.precision,
        )

    def with_seed(self, seed: int) -> SFTConfig:
        return dataclasses.replace(self, seed=seed)
