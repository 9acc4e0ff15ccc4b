"""The critic's update: the clipped value loss on the batch's returns (verl `compute_value_loss`), over the
batch's `loss_mask` (no value target on a multi-turn sample's environment tokens). A vision-language critic's
forwards take the batch's images as the actor's do."""

from __future__ import annotations

import torch

from rlx.algorithms.core import masked_sum
from rlx.algorithms.losses import LossNorm, value_loss
from rlx.errors import UserError
from rlx.formats.batch import TrainBatch
from rlx.logprobs import MODEL_INPUTS, packed_response_values, response_values
from rlx.training.trainer import Trainer


class CriticTrainer(Trainer):
    """The trainable value model and its AdamW optimizer."""

    role = "critic"
    loss_keys = ("vf_loss",)

    def check_batch(self, batch: TrainBatch, where: str) -> None:
        super().check_batch(batch, where)
        if batch.values is None:
            raise UserError(f"{where}: the batch has no critic values; score it with --critic to train the critic")

    def micro_step(
        self, t: dict[str, torch.Tensor], part: TrainBatch, norm: LossNorm, sums: dict[str, float], weight: float
    ) -> None:
        inputs = {k: t[k] for k in MODEL_INPUTS}
        if self.cfg.use_packing:
            rows = self.packed_rows(part)
            with self.packed_images(part):  # a vision-language critic's images and 3-D positions
                values = packed_response_values(
                    self.model, **inputs, dtype=self.dtype, sp_group=self.sp_group, rows=rows
                )
        else:
            vision = part.images.vision if part.images is not None else None
            values = response_values(self.model, **inputs, dtype=self.dtype, vision=vision)
        (self.micro_loss(t, values, norm, sums) * weight).backward()

    def micro_loss(self, t: dict[str, torch.Tensor], values: torch.Tensor, norm: LossNorm, sums: dict) -> torch.Tensor:
        """The micro-batch's clipped value loss from its predicted values [B, R] (metric sums added to `sums`)."""
        loss, loss_sums = value_loss(
            values,
            t["values"],
            t["returns"],
            t["loss_mask"],
            norm,
            self.cfg.loss.cliprange_value,
            self.cfg.loss.loss_agg_mode,
        )
        sums["vf_loss"] += loss.detach()
        sums["vpred_mean"] += masked_sum(values.detach(), t["loss_mask"]).detach()
        sums["tokens"] += t["loss_mask"].sum().detach()
        for key, value in loss_sums.items():
            sums[key] += value.detach()
        return loss
