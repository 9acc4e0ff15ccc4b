"""The rollout stage as `rlx rollout` runs it: load, pick prompts, generate, write; multi-turn (`--env`, `--agent`):
episodes or agents instead of single responses."""

from __future__ import annotations

from pathlib import Path

from rlx.agent.generate import generate_multi_turn, refuse_images
from rlx.checkpoints.loading import load_model, load_processor
from rlx.checkpoints.registry import read_meta_or_default
from rlx.errors import UserError
from rlx.formats.data import check_window, take_prompts
from rlx.formats.records import PromptRecord, read_prompts, write_records
from rlx.models.loading import load_tokenizer, resolve_model
from rlx.observe.tracking import console, log_metrics
from rlx.parallel.dist import setup
from rlx.rollout.base import build_engine
from rlx.rollout.config import RolloutConfig
from rlx.rollout.lengths import limit_prompts, model_context
from rlx.rollout.registry import engine_class
from rlx.utils.files import check_writable
from rlx.utils.io import STDIO, exists, is_remote, local


def check_output_file(out: str, overwrite: bool, option: str = "--out") -> None:
    """Refuse, before any work, an output file that is a folder, exists (without --overwrite) or cannot be
    written."""
    if out == STDIO:
        return
    if not is_remote(out) and local(out).is_dir():
        raise UserError(f"{option} {out}: is a folder; give a file path (e.g. {out.rstrip('/')}/rollouts.jsonl)")
    if exists(out) and not overwrite:
        raise UserError(f"{out}: already exists (choose another {option} or pass --overwrite)")
    check_writable(out)


def run_rollout(
    cfg: RolloutConfig,
    model_path: str,
    prompts_path: str,
    out: str,
    num_prompts: int = 0,
    data_position: int = 0,
    shuffle_seed: int | None = None,
    metrics_path: Path | None = None,
    overwrite: bool = False,
) -> None:
    check_output_file(out, overwrite)
    records = read_prompts(prompts_path)
    if num_prompts < 0 or data_position < 0:
        raise UserError("--num-prompts and --data-position must be >= 0")
    if cfg.is_multi_turn:  # episodes of an environment or runs of an agent (they build each sample's context)
        if num_prompts or data_position or shuffle_seed is not None:
            check_window(num_prompts, len(records), prompts_path, "--num-prompts")
            records = take_prompts(records, data_position, num_prompts or len(records), shuffle_seed)

        run_multi_turn_rollout(cfg, model_path, records, out, metrics_path)
        return
    source, config = resolve_model(model_path)
    tokenizer = load_tokenizer(source)
    context = model_context(config)
    processor = load_processor(source, cfg.vision, config)  # a vision-language model's images (None for text models)
    # 'filter' changes which prompts a window takes: filter the whole file first, as `rlx ppo` does; 'error'
    # leaves the list alone, so only the prompts this rollout takes are checked (the same outcome for them)
    if cfg.on_long_prompt == "filter":
        records = limit_prompts(records, tokenizer, cfg, context, prompts_path, config=config, processor=processor)
    if num_prompts or data_position or shuffle_seed is not None:
        check_window(num_prompts, len(records), prompts_path, "--num-prompts")
        records = take_prompts(records, data_position, num_prompts or len(records), shuffle_seed)
    if cfg.on_long_prompt == "error":
        records = limit_prompts(records, tokenizer, cfg, context, prompts_path, config=config, processor=processor)
    ctx = setup(cfg.device)
    dtype = engine_class(cfg.engine).model_dtype(cfg, ctx.device)
    # a LoRA checkpoint: its base with the adapters, as `rlx ppo` generates
    model = load_model(source, dtype=dtype, adapters=True, config=config).requires_grad_(False)  # generation only
    engine = build_engine(cfg, model, tokenizer, ctx, processor)
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


def run_multi_turn_rollout(
    cfg: RolloutConfig, model_path: str, records: list[PromptRecord], out: str, metrics_path: Path | None = None
) -> dict[str, float]:
    """Episodes of `cfg.env`, or runs of the served `cfg.agent`, for the prompt records; writes rollouts.jsonl
    (rank 0 under a launcher) and returns the metrics."""
    refuse_images(records, cfg, engine_class(cfg.engine))  # before the model loads
    source, config = resolve_model(model_path)
    tokenizer = load_tokenizer(source)
    processor = load_processor(source, cfg.vision, config)  # a vision-language model's images (None for a text model)
    ctx = setup(cfg.device)
    dtype = engine_class(cfg.engine).model_dtype(cfg, ctx.device)
    model = load_model(source, dtype=dtype, config=config).requires_grad_(False)
    engine = build_engine(cfg, model, tokenizer, ctx, processor)
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
