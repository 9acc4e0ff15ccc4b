"""The train-step stage as `rlx train-step` runs it: checkpoint + batch -> next checkpoint + metrics."""

from __future__ import annotations

from pathlib import Path

from rlx.engine.batch import TrainBatch
from rlx.engine.checkpoint import (
    CheckpointMeta,
    load_optimizer_state,
    provenance,
    read_meta_or_default,
    save_checkpoint,
)
from rlx.engine.device import resolve_precision
from rlx.engine.io import exists
from rlx.engine.parallel.dcp import save_dcp_checkpoint, sharded_model_state, sharded_optimizer_state
from rlx.engine.parallel.dist import barrier, setup
from rlx.engine.tracking import console, log_metrics
from rlx.engine.training.actor import ActorTrainer
from rlx.engine.training.config import TrainConfig
from rlx.engine.training.critic import CriticTrainer
from rlx.errors import UserError
from rlx.models.loading import resolve_source, tied_keys
from rlx.models.policy import load_trained_policy, model_weights


def run_train_step(
    cfg: TrainConfig,
    checkpoint: str,
    batch_path: str,
    out: str,
    overwrite: bool = False,
    metrics_path: Path | None = None,
) -> dict:
    if cfg.lr_schedule != "constant" and not cfg.lr_decay_steps:
        raise UserError(
            f"--lr-decay-steps: lr schedule {cfg.lr_schedule!r} needs the decay length in train steps "
            f"(`rlx ppo` uses the run's steps; a hand-run train-step must give it)"
        )
    source = resolve_source(checkpoint, "checkpoint")
    if source.is_gguf:
        raise UserError(
            f"{checkpoint}: train-step needs a checkpoint dir; convert the GGUF file with `rlx shard` first"
        )
    if exists(out) and not overwrite:
        raise UserError(f"{out}: already exists (choose another --out or pass --overwrite)")
    batch = TrainBatch.load(batch_path)
    meta = read_meta_or_default(source.path)
    if meta.layout == "megatron":
        from rlx.engine.megatron.run import megatron_train_step

        metrics, next_meta, ctx = megatron_train_step(cfg, source, meta, batch, batch_path, out, overwrite)
        _report(cfg, ctx, metrics, next_meta, metrics_path, out)
        return metrics
    ctx = setup(cfg.device, cfg.sp_degree)
    model, _, aux = load_trained_policy(source, role=cfg.role)
    trainer_cls = CriticTrainer if cfg.role == "critic" else ActorTrainer
    trainer = trainer_cls(model, cfg, ctx.device, resolve_precision(cfg.precision, ctx.device), ctx)
    trainer.check_batch(batch, batch_path)
    trainer.load_optimizer_state(load_optimizer_state(source.path), checkpoint)
    metrics = trainer.train_step(batch, meta.step)
    next_meta = CheckpointMeta(
        step=meta.step + 1,
        layout=meta.layout,
        data_position=meta.data_position,
        optimizer=trainer.optimizer_meta(),
        provenance=provenance("rlx train-step", checkpoint, batch=str(batch_path)),
    )
    if meta.layout == "fsdp":  # each rank writes its own shards
        save_dcp_checkpoint(
            out,
            sharded_model_state(trainer.model, tied_keys(trainer.model)),
            aux,
            next_meta,
            ctx,
            sharded_optimizer_state(trainer.model, trainer.optimizer),
            overwrite=overwrite,
        )
    else:
        weights, optimizer_state = model_weights(trainer.model), trainer.optimizer_state()  # gathered on rank 0
        if ctx.is_main:
            save_checkpoint(
                out, weights=weights, aux=aux, meta=next_meta, optimizer_state=optimizer_state, overwrite=overwrite
            )
    _report(cfg, ctx, metrics, next_meta, metrics_path, out)
    return metrics


def _report(cfg: TrainConfig, ctx, metrics: dict, next_meta: CheckpointMeta, metrics_path, out: str) -> None:
    """The metrics line and the console summary (rank 0), then wait for every rank."""
    if ctx.is_main:
        log_metrics(metrics_path, next_meta.step, metrics)
        role = cfg.role
        loss = metrics.get(f"{role}/loss", metrics.get(f"{role}/vf_loss", float("nan")))
        console(
            f"rlx train-step: {role} step {next_meta.step}, loss {loss:.4f}, "
            f"grad norm {metrics[f'{role}/grad_norm']:.3f} -> {out}"
            + (f" ({ctx.world} processes)" if ctx.distributed else "")
        )
    barrier()
