"""The critic's update: the clipped value loss on the batch's returns (verl `compute_value_loss`)."""

from __future__ import annotations

from rlx.engine.algorithms.core import masked_sum
from rlx.engine.algorithms.losses import LossNorm, value_loss
from rlx.engine.batch import TrainBatch
from rlx.engine.training.trainer import MODEL_INPUTS, Trainer
from rlx.errors import UserError
from rlx.models.value import response_values


class CriticTrainer(Trainer):
    """The trainable value model and its AdamW optimizer."""

    role = "critic"
    loss_keys = ("vf_loss",)

    def check_batch(self, batch: TrainBatch, where: str) -> None:
        super().check_batch(batch, where)
        if batch.values is None:
            raise UserError(f"{where}: the batch has no critic values; score it with --critic to train the critic")

    def accumulate_gradients(self, mini: TrainBatch, sums: dict[str, float]) -> None:
        cfg = self.cfg
        mask = mini.response_mask
        norm = LossNorm(
            num_tokens=float(mask.sum().clamp(min=1)),
            num_seqs=float((mask.sum(-1) > 0).sum().clamp(min=1)),
            scale_factor=float(cfg.loss_scale_factor or mini.response_ids.shape[1]),
        )
        for part in self.micro_batches(mini):
            values = response_values(self.model, **{k: part[k] for k in MODEL_INPUTS}, dtype=self.dtype)
            loss, loss_sums = value_loss(
                values,
                part["values"],
                part["returns"],
                part["response_mask"],
                norm,
                cfg.cliprange_value,
                cfg.loss_agg_mode,
            )
            loss.backward()
            sums["vf_loss"] += loss.item()
            sums["vpred_mean"] += masked_sum(values.detach(), part["response_mask"]).item()
            sums["tokens"] += part["response_mask"].sum().item()
            for key, value in loss_sums.items():
                sums[key] += value.item()
