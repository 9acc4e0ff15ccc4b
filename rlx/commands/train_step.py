"""`rlx train-step`: one PPO update of a checkpoint on a scored batch, written as the next checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rlx.commands._common import build_config, reporting
from rlx.config import help_for
from rlx.engine.training.config import TrainConfig as C


def train_step(
    checkpoint: Annotated[
        str, typer.Option(metavar="DIR", help="Checkpoint to update (from `rlx shard` or an earlier train-step).")
    ],
    batch: Annotated[str, typer.Option(metavar="FILE", help="batch.safetensors written by `rlx score`.")],
    out: Annotated[str, typer.Option(metavar="PATH", help="Folder for the next checkpoint (written atomically).")],
    role: Annotated[str, typer.Option(metavar="actor", help=help_for(C, "role"))] = C.role,
    lr: Annotated[float, typer.Option(help=help_for(C, "lr"))] = C.lr,
    warmup_steps: Annotated[int, typer.Option(help=help_for(C, "warmup_steps"))] = C.warmup_steps,
    weight_decay: Annotated[float, typer.Option(help=help_for(C, "weight_decay"))] = C.weight_decay,
    epochs: Annotated[int, typer.Option(help=help_for(C, "epochs"))] = C.epochs,
    mini_batch_size: Annotated[int, typer.Option(help=help_for(C, "mini_batch_size"))] = C.mini_batch_size,
    micro_batch_size: Annotated[int, typer.Option(help=help_for(C, "micro_batch_size"))] = C.micro_batch_size,
    shuffle: Annotated[bool, typer.Option(help=help_for(C, "shuffle"))] = C.shuffle,
    clip_ratio_low: Annotated[float, typer.Option(help=help_for(C, "clip_ratio_low"))] = C.clip_ratio_low,
    clip_ratio_high: Annotated[float, typer.Option(help=help_for(C, "clip_ratio_high"))] = C.clip_ratio_high,
    clip_ratio_c: Annotated[float, typer.Option(help=help_for(C, "clip_ratio_c"))] = C.clip_ratio_c,
    max_grad_norm: Annotated[float, typer.Option(help=help_for(C, "max_grad_norm"))] = C.max_grad_norm,
    kl_loss_coef: Annotated[float, typer.Option(help=help_for(C, "kl_loss_coef"))] = C.kl_loss_coef,
    kl_loss_type: Annotated[
        str, typer.Option(metavar="k1|k2|k3|abs", help=help_for(C, "kl_loss_type"))
    ] = C.kl_loss_type,
    entropy_coef: Annotated[float, typer.Option(help=help_for(C, "entropy_coef"))] = C.entropy_coef,
    seed: Annotated[int, typer.Option(help=help_for(C, "seed"))] = C.seed,
    device: Annotated[str, typer.Option(metavar="auto|cpu|cuda|npu", help=help_for(C, "device"))] = C.device,
    precision: Annotated[
        str, typer.Option(metavar="auto|float32|bfloat16", help=help_for(C, "precision"))
    ] = C.precision,
    overwrite: Annotated[bool, typer.Option(help="Replace --out if it exists.")] = False,
    metrics: Annotated[
        Path | None, typer.Option(metavar="FILE", help="Append the step's metrics line to this JSONL file.")
    ] = None,
) -> None:
    """One PPO clipped-objective update: epochs x mini-batches x micro-batches, AdamW, gradient clipping.

    Gradients are normalised by each mini-batch's token count, so micro-batching does not change
    them. The optimizer state travels in the checkpoint; the learning rate follows the checkpoint's
    step count.
    """
    with reporting("train-step"):
        cfg = build_config(
            C,
            role=role,
            lr=lr,
            warmup_steps=warmup_steps,
            weight_decay=weight_decay,
            epochs=epochs,
            mini_batch_size=mini_batch_size,
            micro_batch_size=micro_batch_size,
            shuffle=shuffle,
            clip_ratio_low=clip_ratio_low,
            clip_ratio_high=clip_ratio_high,
            clip_ratio_c=clip_ratio_c,
            max_grad_norm=max_grad_norm,
            kl_loss_coef=kl_loss_coef,
            kl_loss_type=kl_loss_type,
            entropy_coef=entropy_coef,
            seed=seed,
            device=device,
            precision=precision,
        )
        from rlx.engine.training.run import run_train_step

        run_train_step(cfg, checkpoint, batch, out, overwrite=overwrite, metrics_path=metrics)
