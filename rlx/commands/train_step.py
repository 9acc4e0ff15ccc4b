"""`rlx train-step`: one PPO update of a checkpoint on a scored batch, written as the next checkpoint. Options other
than the files are TrainConfig's fields (rlx/training/config.py)."""

from __future__ import annotations

from typing import Annotated

import typer

from rlx.commands._common import LORA_OPTIONS, reporting
from rlx.commands._options import config_command, nested_config
from rlx.models.lora_config import LoraConfig
from rlx.training.config import TrainConfig


@config_command(
    TrainConfig,
    "train-step",
    metavars={"policy_loss": "NAME", "loss_agg_mode": "MODE"},
    exclude=("store_pixels", "max_prompt_tokens"),  # score's and rollout's
)
@nested_config("lora", LoraConfig, **LORA_OPTIONS)
def train_step(
    cfg: TrainConfig,
    lora: LoraConfig | None,
    checkpoint: Annotated[
        str, typer.Option(metavar="DIR", help="Checkpoint to update (from `rlx shard` or an earlier train-step).")
    ],
    batch: Annotated[str, typer.Option(metavar="FILE", help="batch.safetensors written by `rlx score`.")],
    out: Annotated[str, typer.Option(metavar="DIR", help="Folder for the next checkpoint (written atomically).")],
    overwrite: Annotated[bool, typer.Option(help="Replace --out if it exists.")] = False,
    metrics: Annotated[
        str | None, typer.Option(metavar="FILE", help="Append the step's metrics line to this JSONL file.")
    ] = None,
) -> None:
    """One PPO-family update of the actor (any policy loss, rollout correction, KL loss, entropy bonus)
    or of the critic (clipped value loss): epochs x mini-batches x micro-batches, AdamW, gradient clipping.

    Losses are normalised by each mini-batch's token (or sequence) count, so micro-batching does
    not change the gradient. The optimizer state travels in the checkpoint; the learning rate
    follows the checkpoint's step count. Under torchrun (or srun) the model is FSDP-sharded and
    each mini-batch is split across ranks by work; the result equals a single-process step.

    A LoRA checkpoint (`rlx shard --lora-rank N`) trains its adapters only and writes the next LoRA checkpoint;
    --lora-* options on a checkpoint of full weights add fresh adapters to it (its weights become the base).
    """
    with reporting("train-step", beats=True):
        from rlx.stages.train_step import run_train_step

        run_train_step(cfg, checkpoint, batch, out, overwrite=overwrite, metrics_path=metrics, lora=lora)
