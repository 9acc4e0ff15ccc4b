"""The multi-turn rollout stage, as `rlx rollout --env/--agent` runs it: load, run episodes or agents, write."""

from __future__ import annotations

from pathlib import Path

from rlx.agent.generate import generate_multi_turn, refuse_images
from rlx.checkpoints.loading import load_model, load_processor
from rlx.checkpoints.registry import read_meta_or_default
from rlx.formats.records import PromptRecord, write_records
from rlx.models.loading import load_tokenizer, resolve_source
from rlx.observe.tracking import console, log_metrics
from rlx.parallel.dist import setup
from rlx.rollout.base import build_engine
from rlx.rollout.config import RolloutConfig
from rlx.rollout.registry import engine_class


def run_multi_turn_rollout(
    cfg: RolloutConfig, model_path: str, records: list[PromptRecord], out: str, metrics_path: Path | None = None
) -> dict[str, float]:
    """Episodes of `cfg.env`, or runs of the served `cfg.agent`, for the prompt records; writes rollouts.jsonl
    (rank 0 under a launcher) and returns the metrics."""
    refuse_images(records, cfg, engine_class(cfg.engine))  # before the model loads
    source = resolve_source(model_path)
    tokenizer = load_tokenizer(source)
    processor = load_processor(source, cfg.vision)  # a vision-language model's images (None for a text model)
    ctx = setup(cfg.device)
    dtype = engine_class(cfg.engine).model_dtype(cfg, ctx.device)
    engine = build_engine(cfg, load_model(source, dtype=dtype).requires_grad_(False), tokenizer, ctx, processor)
    try:
        result = generate_multi_turn(engine, tokenizer, records, cfg, cfg.sampling())
    finally:
        engine.close()
    metrics = result.stats.metrics()
    if not ctx.is_main:
        return metrics
    write_records(out, result.records)
    log_metrics(metrics_path, read_meta_or_default(source.path).step + 1, metrics)
    where = "stdout" if out == "-" else out
    console(
        f"rlx rollout: {len(result.records)} multi-turn samples for {len(records)} prompts -> {where} "
        f"({metrics['rollout/turns_mean']:.2f} turns each, env reward {metrics['env/reward_mean']:.3f})"
    )
    return metrics
