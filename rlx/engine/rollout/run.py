"""The rollout stage as `rlx rollout` runs it: load, pick prompts, generate, write."""

from __future__ import annotations

from pathlib import Path

from rlx.engine.checkpoints.loading import load_model
from rlx.engine.checkpoints.registry import read_meta_or_default
from rlx.engine.data import take_prompts
from rlx.engine.parallel.dist import setup
from rlx.engine.records import read_prompts, write_records
from rlx.engine.rollout.base import build_engine
from rlx.engine.rollout.config import RolloutConfig
from rlx.engine.rollout.registry import engine_class
from rlx.engine.tracking import console, log_metrics
from rlx.errors import UserError
from rlx.models.loading import load_tokenizer, resolve_source


def run_rollout(
    cfg: RolloutConfig,
    model_path: str,
    prompts_path: str,
    out: str,
    num_prompts: int = 0,
    data_position: int = 0,
    shuffle_seed: int | None = None,
    metrics_path: Path | None = None,
) -> None:
    records = read_prompts(prompts_path)
    if num_prompts < 0 or data_position < 0:
        raise UserError("--num-prompts and --data-position must be >= 0")
    if num_prompts or data_position or shuffle_seed is not None:
        records = take_prompts(records, data_position, num_prompts or len(records), shuffle_seed)
    source = resolve_source(model_path)
    tokenizer = load_tokenizer(source)
    ctx = setup(cfg.device)
    dtype = engine_class(cfg.engine).model_dtype(cfg, ctx.device)
    # a LoRA checkpoint: its base with the adapters, as `rlx ppo` generates
    engine = build_engine(cfg, load_model(source, dtype=dtype, adapters=True), tokenizer, ctx)
    try:
        result = engine.generate(records, cfg.sampling())
    finally:
        engine.close()
    if not ctx.is_main:
        return
    write_records(out, result.records)
    stats = result.stats
    step = read_meta_or_default(source.path).step + 1
    log_metrics(metrics_path, step, {**stats.metrics(), "timing/rollout_s": stats.seconds})
    where = "stdout" if out == "-" else out
    console(
        f"rlx rollout: {len(result.records)} responses to {len(records)} prompts -> {where} "
        f"({stats.tokens:.0f} tokens, {stats.tokens_per_s:.0f} tok/s)"
    )
