"""The SFT update: token-mean negative log-likelihood of the assistant's tokens, on the shared update loop (AdamW,
micro-batches, packing, FSDP data parallel under a launcher: rlx/training/trainer.py)."""

from __future__ import annotations

import torch

from rlx.algorithms.core import masked_sum
from rlx.algorithms.losses import LossNorm, aggregate
from rlx.formats.batch import TrainBatch
from rlx.training.actor import ActorTrainer
from rlx.training.trainer import Trainer


class SFTTrainer(ActorTrainer):
    """The policy trained on demonstrations: the actor's forward (logprobs of the response tokens), an NLL loss.

    A batch is laid out as a scored one (rlx/formats/batch.py) with `loss_mask` on the assistant's tokens; every other
    tensor is zero and unread. Its checkpoint holds the weights only: RL (or more SFT) starts a fresh optimizer."""

    role = "sft"
    loss_keys = ("loss",)

    def train_step(self, batch: TrainBatch, step: int) -> dict[str, float]:
        return Trainer.train_step(self, batch, step)

    def loss_norm(self, mini: TrainBatch) -> LossNorm:
        return Trainer.loss_norm(self, mini)

    def micro_loss(
        self, t: dict[str, torch.Tensor], logp: torch.Tensor, entropy: torch.Tensor, norm: LossNorm, sums: dict
    ) -> torch.Tensor:
        """Token-mean NLL over `loss_mask` [B, R], normalised by the whole batch's trained tokens."""
        mask = t["loss_mask"]
        loss = aggregate(-logp, mask, "token-mean", norm)
        sums["loss"] += loss.detach()
        with torch.no_grad():
            sums["entropy"] += masked_sum(entropy, mask).detach()
            sums["tokens"] += mask.sum().detach()
        return loss

    def full_optimizer_state(self) -> None:
        return None

    def snapshot_state(self) -> tuple[dict[str, torch.Tensor], None]:
        """The weights only (copies on the main process; a collective)."""
        return self.full_weights(), None
