"""Small views of a trainer for the two callers that read it from outside the update loop: the rollout engine's
weight sync (`Trainer.weights()`, a rollout WeightSource) and the checkpoint layouts (`Trainer.state()`, a
checkpoints TrainedState that they save, and restore the optimizer into). Each view offers only what its caller
reads, so a trainer's other methods never leak into a layout or an engine."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from rlx.checkpoints.base import LocalState


class TrainerWeights:
    """A trainer's policy weights as a rollout engine takes them (every process drains `named_weights` together)."""

    def __init__(self, trainer):
        self._trainer = trainer

    @property
    def module(self) -> torch.nn.Module | None:
        """The live module an engine may generate with directly (None: the weights must be copied)."""
        return self._trainer.module

    def named_weights(self, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors with Hugging Face names, gathered about `bucket_bytes` at a time (LoRA: merged)."""
        return self._trainer.named_weights(bucket_bytes)

    def adapter_state(self) -> dict[str, torch.Tensor] | None:
        """A LoRA policy's adapters by stable name (a collective); None for full weights."""
        return self._trainer.adapter_state()


class TrainerState:
    """A trainer's weights and optimizer state as checkpoint layouts write them (the calls are collectives)."""

    def __init__(self, trainer):
        self._trainer = trainer

    @property
    def is_main(self) -> bool:
        return self._trainer.is_main

    @property
    def world(self) -> int:
        return self._trainer.world

    @property
    def lora(self):
        """With LoRA, the adapters' settings and base (a LoraSpec): the LoRA layout writes them; else None."""
        return self._trainer.lora

    def full_weights(self) -> dict[str, torch.Tensor]:
        return self._trainer.full_weights()

    def full_optimizer_state(self) -> dict[str, torch.Tensor] | None:
        return self._trainer.full_optimizer_state()

    def adapter_state(self) -> dict[str, torch.Tensor] | None:
        return self._trainer.adapter_state()

    def local_state(self) -> LocalState:
        return self._trainer.local_state()

    def snapshot_state(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
        """(full weights, full optimizer state) as host copies later updates leave alone (rlx.utils.host_copy)."""
        return self._trainer.snapshot_state()

    def model_shards(self) -> dict[str, torch.Tensor]:
        """This rank's live weights (tied ones once), to read a checkpoint's shards into (in place)."""
        return self._trainer.model_shards()

    def optimizer_shards(self) -> dict[str, torch.Tensor]:
        """This rank's optimizer state tensors, initialized, to read a checkpoint's shards into (in place)."""
        return self._trainer.optimizer_shards()

    def load_optimizer_state(self, tensors: dict[str, torch.Tensor] | None, where: str) -> None:
        """Restore the optimizer from a checkpoint's tensors (`where` names the checkpoint in errors)."""
        self._trainer.load_optimizer_state(tensors, where)
