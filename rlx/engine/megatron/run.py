"""`rlx train-step` on a 'megatron'-layout checkpoint: each rank loads its (tp, pp) shard, trains, and
writes its shard of the next checkpoint (same tp x pp; data parallel over the remaining processes)."""

from __future__ import annotations

from rlx.engine.batch import TrainBatch
from rlx.engine.checkpoint import CheckpointMeta, aux_files, provenance
from rlx.engine.megatron.checkpoint import (
    check_complete,
    read_rank_optimizer,
    read_rank_state,
    save_megatron_rank_checkpoint,
)
from rlx.engine.megatron.parallel import MegatronContext, setup_megatron
from rlx.engine.megatron.trainer import build_megatron_trainer
from rlx.engine.training.config import TrainConfig
from rlx.errors import UserError
from rlx.models.loading import ModelSource, load_config
from rlx.models.megatron.model import is_critic_config


def load_megatron_trainer(cfg: TrainConfig, source: ModelSource, meta: CheckpointMeta):
    """(trainer, context) for this rank's shard of a megatron checkpoint."""
    from rlx.models.megatron import compat

    compat.require_megatron()
    hf_config = load_config(source)
    critic = is_critic_config(hf_config)
    if critic != (cfg.role == "critic"):
        what = "a value model" if critic else "a causal LM"
        raise UserError(f"{source.path}: --role {cfg.role} but the checkpoint holds {what}")
    check_complete(source.path)
    ctx: MegatronContext = setup_megatron(cfg.device, meta.tp_degree, meta.pp_degree)
    state = read_rank_state(source.path, ctx.tp_rank, ctx.pp_rank)
    optimizer_state = read_rank_optimizer(source.path, ctx.tp_rank, ctx.pp_rank)
    return build_megatron_trainer(hf_config, cfg, ctx, state, str(source.path), optimizer_state), ctx


def megatron_train_step(
    cfg: TrainConfig,
    source: ModelSource,
    meta: CheckpointMeta,
    batch: TrainBatch,
    batch_path: str,
    out: str,
    overwrite: bool,
) -> tuple[dict, CheckpointMeta, MegatronContext]:
    """One update of a megatron checkpoint -> (metrics, the new checkpoint's meta, context)."""
    trainer, ctx = load_megatron_trainer(cfg, source, meta)
    trainer.check_batch(batch, batch_path)
    metrics = trainer.train_step(batch, meta.step)
    next_meta = CheckpointMeta(
        step=meta.step + 1,
        layout="megatron",
        tp_degree=meta.tp_degree,
        pp_degree=meta.pp_degree,
        data_position=meta.data_position,
        optimizer=trainer.optimizer_meta(),
        provenance=provenance("rlx train-step", str(source.path), batch=str(batch_path)),
    )
    save_megatron_rank_checkpoint(
        out, trainer.model_state(), trainer.optimizer_state(), aux_files(source.path), next_meta, ctx,
        ctx.tp_rank, ctx.pp_rank, ctx.dp_rank, overwrite=overwrite,
    )  # fmt: skip
    return metrics, next_meta, ctx
