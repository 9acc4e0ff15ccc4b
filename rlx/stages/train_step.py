"""The train-step stage as `rlx train-step` runs it: checkpoint + batch -> next checkpoint + metrics.

The checkpoint's layout names the backend that trains it in place (checkpoints/registry.py, backends/registry.py);
the next checkpoint is written in the same layout, or in the LoRA layout when the trainer trains adapters (a LoRA
checkpoint, or `lora` settings on a checkpoint of full weights).
"""

from __future__ import annotations

from pathlib import Path

from rlx.backends.registry import backend_for_checkpoint, checkpoint_degrees
from rlx.checkpoints.files import aux_files
from rlx.checkpoints.loading import load_processor
from rlx.checkpoints.meta import CheckpointMeta, is_checkpoint, provenance
from rlx.checkpoints.registry import check_complete, save, trained_layout
from rlx.errors import UserError
from rlx.formats.batch import TrainBatch
from rlx.models.fingerprint import check_fingerprint, model_signature, tokenizer_fingerprint
from rlx.models.loading import load_config, load_tokenizer, resolve_source
from rlx.models.lora_config import LoraConfig
from rlx.models.value import check_value_config, is_value_config
from rlx.observe.tracking import console, log_metrics
from rlx.parallel.dist import barrier
from rlx.training.config import TrainConfig, describe_ranks, sizes_for_ranks
from rlx.utils.files import check_writable
from rlx.utils.io import exists


def check_batch_tokenizer(batch: TrainBatch, batch_path: str, source, checkpoint: str) -> None:
    """The batch's tokenizer fingerprint (where it has one) is the checkpoint's: a UserError naming both. A
    checkpoint without a tokenizer of its own is not checked."""
    if batch.meta.tokenizer is None:
        return
    try:
        expected = tokenizer_fingerprint(load_tokenizer(source))
    except UserError:
        return
    check_fingerprint(batch.meta.tokenizer, str(batch_path), expected, f"the checkpoint {checkpoint}")


def check_batch_actor(
    batch: TrainBatch, batch_path: str, source, meta: CheckpointMeta, config, say: bool = True
) -> None:
    """Say where the policy that scored the batch's old logprobs (where the batch records it) is not the trained
    checkpoint: PPO's ratio is then against that policy. A warning for a model of another shape (its logprobs are
    another model's: a pipeline's slip, unless an off-policy experiment means it), a note for another checkpoint of
    the same model (an asynchronous run's staleness, or a stale --batch)."""
    actor = batch.meta.actor
    if not actor or not say:
        return
    here = model_signature(config)
    if actor.get("model") != here:
        console(
            f"rlx train-step: warning: {batch_path}'s old logprobs come from {actor.get('path')} "
            f"({actor.get('model')}), a model of another shape than {source.path} ({here}): the PPO ratio compares "
            f"two different models (score the rollouts with the checkpoint you train)"
        )
    elif actor.get("path") != str(Path(source.path).resolve()) or actor.get("step") not in (None, meta.step):
        console(
            f"rlx train-step: note: {batch_path} was scored by {actor.get('path')} (step {actor.get('step')}); "
            f"training {source.path} (step {meta.step}): the PPO ratio is against that policy's logprobs"
        )


def uneven_mini_batches(cfg: TrainConfig, batch: TrainBatch, batch_path: str) -> str | None:
    """--mini-batch-size must cut the batch into equal mini-batches, as `rlx ppo` checks a recipe (else the last
    optimizer step takes fewer samples): a UserError naming the nearest sizes that do. A batch left by dynamic sampling
    (`rlx score --filter-groups`) varies in size from step to step: the same words are returned, for a warning."""
    problem = cfg.uneven_mini_batches(batch.size, f" of {batch_path}")
    if problem is None or batch.meta.settings.get("filter_groups"):
        return problem
    raise UserError(f"--mini-batch-size: {problem}")


def check_data_parallel_batch(cfg: TrainConfig, samples: int, batch_path: str, dp_size: int, world: int) -> None:
    """Under a launcher each optimizer step splits its mini-batch over the `dp_size` data-parallel ranks (`world`: the
    processes), a sample or more each, as `rlx ppo` checks a recipe at its start (rlx/ppo/start.py): a batch or a
    mini-batch (the last one of an uneven cut too) of fewer `samples` is refused before the model is loaded, naming
    the flag, the ranks and the sizes that work."""
    if dp_size <= 1:
        return
    ranks = describe_ranks(dp_size, world)
    if samples < dp_size:
        raise UserError(
            f"--batch: the {samples} samples of {batch_path} are fewer than {ranks}: each optimizer step needs a "
            f"sample or more per rank; score {dp_size} or more samples, or launch fewer processes"
        )
    smallest, mini = min(cfg.mini_batch_sizes(samples)), cfg.mini_batch_size
    if smallest >= dp_size:
        return
    given = f"{mini} is fewer samples" if smallest == mini else f"{mini} leaves a last mini-batch of {smallest}, fewer"
    raise UserError(
        f"--mini-batch-size: {given} than {ranks}: each optimizer step splits its mini-batch over them, "
        f"a sample or more each; sizes that work (dividing the {samples} samples of {batch_path}, {dp_size} or more): "
        f"{sizes_for_ranks(samples, dp_size)}, or 0 (the whole batch in one optimizer step)"
    )


def run_train_step(
    cfg: TrainConfig,
    checkpoint: str,
    batch_path: str,
    out: str,
    overwrite: bool = False,
    metrics_path: Path | None = None,
    lora: LoraConfig | None = None,
) -> dict:
    if cfg.optim.lr_schedule != "constant" and not cfg.optim.lr_decay_steps:
        raise UserError(
            f"--lr-decay-steps: lr schedule {cfg.optim.lr_schedule!r} needs the decay length in train steps "
            f"(`rlx ppo` uses the run's steps; a hand-run train-step must give it)"
        )
    source = resolve_source(checkpoint, "checkpoint")
    if source.is_gguf:
        raise UserError(
            f"{checkpoint}: train-step needs a checkpoint dir; convert the GGUF file with `rlx shard` first"
        )
    if exists(out) and not overwrite:
        raise UserError(f"{out}: already exists (choose another --out or pass --overwrite)")
    check_writable(out)
    meta = check_complete(source.path) if is_checkpoint(source.path) else CheckpointMeta()
    config = load_config(source)  # the role is checked before any process group is set up
    if cfg.role == "critic":
        check_value_config(config, source.path)
    elif is_value_config(config):
        raise UserError(f"{source.path}: --role actor but the checkpoint holds a value model")
    # a vision-language model's processor reloads the batch's images (unless it stores their pixels)
    batch = TrainBatch.load(batch_path, load_processor(source, cfg.vision, config))
    uneven = uneven_mini_batches(cfg, batch, batch_path)
    backend = backend_for_checkpoint(meta).setup(cfg.device, checkpoint_degrees(meta, cfg.sp_degree, cfg.ep_degree))
    check_data_parallel_batch(cfg, batch.size, batch_path, backend.ctx.dp_size, backend.ctx.world)  # ranks known now
    trainer = backend.load_trainer(cfg, source, config, **backend.lora_options(lora, "--lora-rank"))
    trainer.check_batch(batch, batch_path)  # the vocabulary size first: the plainer message where it differs
    check_batch_tokenizer(batch, batch_path, source, checkpoint)
    check_batch_actor(batch, batch_path, source, meta, config, say=trainer.is_main)
    if uneven and trainer.is_main:
        console(f"rlx train-step: warning: --mini-batch-size {uneven} (a batch of dynamic sampling: its size varies)")
    metrics = trainer.train_step(batch, meta.step)
    next_meta = CheckpointMeta(
        step=meta.step + 1,
        layout=trained_layout(trainer.state(), meta.layout),
        tp_degree=meta.tp_degree,
        pp_degree=meta.pp_degree,
        data_position=meta.data_position,
        optimizer=trainer.optimizer_meta(),
        provenance=provenance("rlx train-step", checkpoint, batch=str(batch_path)),
    )
    save(out, trainer.state(), aux_files(source.path), next_meta, overwrite=overwrite)
    if trainer.is_main:
        log_metrics(metrics_path, next_meta.step, metrics)
        loss = metrics.get(f"{cfg.role}/loss", metrics.get(f"{cfg.role}/vf_loss", float("nan")))
        console(
            f"rlx train-step: {cfg.role} step {next_meta.step}, loss {loss:.4f}, "
            f"grad norm {metrics[f'{cfg.role}/grad_norm']:.3f} -> {out}"
            + (f" ({trainer.world} processes)" if backend.ctx.distributed else "")
        )
    barrier()
    return metrics
