"""A recipe's `[sft]` table: supervised fine-tuning of the initial policy before step 1 of a fresh run.

The fine-tuned weights become the run's step-0 checkpoint (RUN_DIR/checkpoints/step_000000, the 'single' layout
without optimizer state, as `rlx sft` writes it) and the run continues from it as from `model.path`: the actor
starts there with a fresh optimizer and the reference is that model, as is standard. Checkpoint rotation keeps it,
and a resumed run reads its reference from it. Per-step SFT metrics go to RUN_DIR/sft_metrics.jsonl.

Under torchrun a synchronous FSDP run fine-tunes on every process (FSDP, each batch's demonstrations split by work,
as `rlx sft` under torchrun: the weights of one process); otherwise (async ranks, sequence parallelism, megatron)
the main process fine-tunes alone while the others wait. Every process then loads the checkpoint. A shell pipeline
does the same with `rlx shard`, then `rlx sft`, then the stage loop.

The checkpoint's rlx.json records what its weights depend on beyond the recipe's keys (`warm_start_record`: the
demonstrations' sha256, the device type, the size and modification time of each of the model's files), so a run
stopped before its first RL checkpoint and started again with `--resume` reuses a finished warm start when neither
those nor its recipe keys changed (rlx/ppo/rundir.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

import torch

from rlx.checkpoints import catalog
from rlx.checkpoints.loading import load_initial_policy
from rlx.checkpoints.meta import CheckpointMeta, is_checkpoint, provenance
from rlx.checkpoints.registry import save
from rlx.errors import UserError
from rlx.models.loading import ModelSource
from rlx.observe.tracking import console
from rlx.parallel.dist import DistContext, barrier
from rlx.ppo.config import ModelConfig, PPOConfig
from rlx.ppo.rundir import SFT_METRICS, checkpoint_dir
from rlx.rollout.prompts import stop_token_ids
from rlx.sft.config import SFTConfig
from rlx.stages.sft import fine_tune, load_samples
from rlx.utils import storage


def warm_start(cfg: PPOConfig, run_dir: Path, start_step: int, ctx: DistContext, record: dict | None,
               kept: bool = False) -> PPOConfig:  # fmt: skip
    """`cfg` with the run's step-0 checkpoint as its model when the recipe has `[sft]` (fine-tuned now on a fresh
    start, its rlx.json recording `record`, warm_start_record's, unless `kept`: an earlier start's finished warm start
    is reused); `cfg` itself without it."""
    if cfg.sft is None:
        return cfg
    out = checkpoint_dir(run_dir, 0)
    if start_step == 0 and not kept:
        if _data_parallel(cfg, ctx):
            _fine_tune(cfg, run_dir, out, ctx, record)
        elif ctx.is_main:
            _fine_tune(cfg, run_dir, out, DistContext(device=ctx.device), record)
        barrier()
    elif not is_checkpoint(out):
        raise UserError(
            f"{out}: the run's [sft] checkpoint (its initial policy and reference) is missing; the run cannot "
            f"continue (start it again with --overwrite)"
        )
    return dataclasses.replace(cfg, model=ModelConfig(path=str(out), init="pretrained"))


def warm_start_record(cfg: PPOConfig, device: torch.device, source: ModelSource) -> dict | None:
    """What the warm start's weights depend on beyond the recipe's keys, written into its checkpoint's provenance:
    the sha256 of the demonstrations file, the device type it trains on and the files of the model it starts from
    (`source`: cfg.model.path resolved, model_files); None without [sft]."""
    if cfg.sft is None:
        return None
    data = hashlib.sha256(storage.read_bytes(cfg.sft.data)).hexdigest()
    return {"data_sha256": data, "device": device.type, "model_files": model_files(source)}


def model_files(source: ModelSource) -> dict[str, list[int]]:
    """The model's files as [size in bytes, modification time in ns] by their path in its folder: the GGUF file, or
    every file of the folder and its sub-folders but hidden ones (weights, an 'fsdp' or 'megatron' checkpoint's shards,
    config, tokenizer: a random init reads the config, and every start the tokenizer). Sizes and times, not sha256
    sums: this runs at every start of a run with [sft], and hashing a 7B model's 15 GB takes a minute or more, where
    stat takes microseconds. Whatever rewrites a file (a save, a copy, a download) gives it a new time; a change goes
    unnoticed only where other bytes of the same size come back with the old time (`cp -p`, `rsync -t`), and a file
    written anew with the same bytes counts as changed (the safe side: the warm start runs again)."""
    if source.is_gguf:
        stat = source.path.stat()
        return {source.path.name: [stat.st_size, stat.st_mtime_ns]}
    found = {}
    for folder, names, files in os.walk(source.path):
        names[:] = sorted(name for name in names if not name.startswith("."))
        for name in sorted(files):
            if not name.startswith("."):
                stat = (Path(folder) / name).stat()
                found[(Path(folder) / name).relative_to(source.path).as_posix()] = [stat.st_size, stat.st_mtime_ns]
    return found


def _data_parallel(cfg: PPOConfig, ctx: DistContext) -> bool:
    """Whether every process fine-tunes (FSDP over all of them, each batch split by work, as `rlx sft` under torchrun):
    a synchronous FSDP run without sequence parallelism. Otherwise the main process fine-tunes alone."""
    return ctx.distributed and ctx.sp_degree == 1 and cfg.backend_name == "fsdp" and cfg.async_ is None


def sft_settings(cfg: PPOConfig) -> SFTConfig:
    """The run's [sft] table as it fine-tunes: the run's seed, and [rollout]'s chat_template_kwargs when it gives
    none (the demonstrations are rendered as the rollouts will be)."""
    sft = cfg.sft.with_seed(cfg.seed)
    if not sft.chat_template_kwargs:
        sft = dataclasses.replace(sft, chat_template_kwargs=dict(cfg.rollout.agent.chat_template_kwargs))
    return sft


def _fine_tune(cfg: PPOConfig, run_dir: Path, out: Path, ctx: DistContext, record: dict) -> None:
    sft = sft_settings(cfg)
    model, tokenizer, aux = load_initial_policy(cfg.model.path, cfg.model.init, cfg.seed)
    samples = load_samples(sft, tokenizer, model.config, stop_token_ids(model, tokenizer), quiet=not ctx.is_main)
    if ctx.is_main:
        where = f"{ctx.world} processes" if ctx.distributed else "1 process"
        console(f"[sft] fine-tuning the initial policy on {len(samples)} demonstrations ({sft.data}), {where}")
    trainer, metrics = fine_tune(model, tokenizer, samples, sft, ctx, run_dir / SFT_METRICS)
    origin = provenance("rlx ppo [sft]", cfg.model.path, data=sft.data, init=cfg.model.init, seed=cfg.seed, **record)
    save(out, trainer.state(), aux, CheckpointMeta(step=0, layout=catalog.DEFAULT, provenance=origin), overwrite=True)
