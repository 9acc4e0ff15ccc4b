"""The rollout stage as `rlx rollout` runs it: load, pick prompts, generate, write."""

from __future__ import annotations

from pathlib import Path

from rlx.engine.checkpoint import read_meta_or_default
from rlx.engine.device import resolve_device, resolve_precision
from rlx.engine.parallel.dist import setup
from rlx.engine.ppo.data import take_prompts
from rlx.engine.records import read_prompts, write_records
from rlx.engine.rollout.config import RolloutConfig
from rlx.engine.tracking import console, log_metrics
from rlx.errors import UserError
from rlx.models.loading import load_causal_lm, load_tokenizer, resolve_source


def build_engine(cfg: RolloutConfig, model, tokenizer, ctx=None):
    """The engine named by `cfg.engine`, around a model held in this process (split across ranks under a
    launcher: each rank samples its share of the requests)."""
    device = ctx.device if ctx is not None else resolve_device(cfg.device)
    if cfg.engine == "hf":
        from rlx.engine.rollout.hf import HFRolloutEngine

        return HFRolloutEngine(model.to(device), tokenizer, device, resolve_precision(cfg.precision, device), ctx)
    if cfg.engine == "vllm":
        from rlx.engine.rollout.vllm import VLLMRolloutEngine

        return VLLMRolloutEngine(model, tokenizer, device, resolve_precision(cfg.precision, device), cfg, ctx)
    if cfg.engine == "native":
        from rlx.engine.rollout.native.engine import NativeRolloutEngine

        model = model.to(device)
        return NativeRolloutEngine(model, tokenizer, device, resolve_precision(cfg.precision, device), cfg, ctx)
    raise UserError(f"unknown rollout engine {cfg.engine!r}")


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
    engine = build_engine(cfg, load_causal_lm(source), tokenizer, ctx)
    try:
        rollouts = engine.generate(records, cfg)
    finally:
        engine.close()
    if not ctx.is_main:
        return
    write_records(out, rollouts)
    stats = engine.last_stats
    step = read_meta_or_default(source.path).step + 1
    log_metrics(metrics_path, step, {**stats, "timing/rollout_s": stats["timing/generate_s"]})
    where = "stdout" if out == "-" else out
    console(
        f"rlx rollout: {len(rollouts)} responses to {len(records)} prompts -> {where} "
        f"({stats['rollout/tokens']:.0f} tokens, {stats['perf/rollout_tokens_per_s']:.0f} tok/s)"
    )
