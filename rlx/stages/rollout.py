"""The rollout stage as `rlx rollout` runs it: load, pick prompts, generate, write; multi-turn (`--env`, `--agent`):
episodes or agents instead of single responses."""

from __future__ import annotations

import os
from pathlib import Path

from rlx.agent.generate import build_rollout, refuse_images
from rlx.checkpoints.loading import load_model, load_processor
from rlx.checkpoints.registry import read_meta_or_default
from rlx.errors import UserError
from rlx.formats.data import check_window, take_prompts
from rlx.formats.records import PromptRecord, read_prompts, write_records
from rlx.models.loading import load_tokenizer, resolve_model
from rlx.observe.tracking import console, log_metrics
from rlx.parallel.dist import setup
from rlx.rollout.base import RolloutResult, RolloutStats, build_engine
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
    sampling = cfg.sampling
    if sampling.n > 1 and sampling.temperature == 0 and os.environ.get("RANK", "0") == "0":
        console(f"rlx rollout: warning: --n {sampling.n} at --temperature 0 gives {sampling.n} identical greedy "
                f"responses per prompt (a GRPO group of them has no advantage to learn from)")  # fmt: skip
    records = read_prompts(prompts_path)
    if num_prompts < 0 or data_position < 0:
        raise UserError("--num-prompts and --data-position must be >= 0")
    source, config = resolve_model(model_path)
    tokenizer = load_tokenizer(source)
    processor = load_processor(source, cfg.vision, config)  # a vision-language model's images (None for text models)
    is_window = num_prompts or data_position or shuffle_seed is not None
    window = (data_position, num_prompts, shuffle_seed) if is_window else None
    records = _choose_prompts(cfg, records, prompts_path, window, tokenizer, config, processor)
    ctx = setup(cfg.device)
    dtype = engine_class(cfg.engine).model_dtype(cfg, ctx.device)
    # a LoRA checkpoint: its base with the adapters, as `rlx ppo` generates
    model = load_model(source, dtype=dtype, adapters=True, config=config).requires_grad_(False)  # generation only
    engine = build_engine(cfg, model, tokenizer, ctx, processor)
    try:
        result = build_rollout(cfg, engine).generate(records, cfg.sampling)
    finally:
        engine.close()
    if not ctx.is_main:
        return
    write_records(out, result.records)
    stats = result.stats
    step = read_meta_or_default(source.path).step + 1
    log_metrics(metrics_path, step, {**stats.metrics(), "timing/rollout_s": stats.seconds})
    console(f"rlx rollout: {_summary(result, len(records))} -> {'stdout' if out == '-' else out} ({_detail(stats)})")


def _choose_prompts(
    cfg: RolloutConfig, records: list[PromptRecord], where: str, window: tuple | None, tokenizer, config, processor
) -> list[PromptRecord]:
    """The prompts the rollout takes: the window (data position, count, shuffle seed) when one is given, with the
    long-prompt limits applied to prompts the engine encodes itself. 'filter' changes which prompts a window takes:
    the whole file is filtered first, as `rlx ppo` does; 'error' leaves the list alone, so only the prompts this
    rollout takes are checked (the same outcome for them). Episodes (--env, --agent) start from what their
    environment or agent sends: the limits are theirs (max_total_tokens), and images are refused up front by an
    engine that cannot take them (before the model loads)."""
    context = model_context(config)
    limits = not cfg.agent.is_multi_turn
    if limits and cfg.on_long_prompt == "filter":
        records = limit_prompts(records, tokenizer, cfg, context, where, config=config, processor=processor)
    if window is not None:
        position, count, seed = window
        check_window(count, len(records), where, "--num-prompts")
        records = take_prompts(records, position, count or len(records), seed)
    if limits and cfg.on_long_prompt == "error":
        records = limit_prompts(records, tokenizer, cfg, context, where, config=config, processor=processor)
    if not limits:
        refuse_images(records, cfg, engine_class(cfg.engine))
    return records


def _summary(result: RolloutResult, num_prompts: int) -> str:
    if result.stats.episodes is not None:
        return f"{len(result.records)} multi-turn samples for {num_prompts} prompts"
    return f"{len(result.records)} responses to {num_prompts} prompts"


def _detail(stats: RolloutStats) -> str:
    episodes = stats.episodes
    if episodes is not None:
        return f"{episodes.turns_mean:.2f} turns each, env reward {episodes.env_reward_mean:.3f}"
    return f"{stats.tokens:.0f} tokens, {stats.tokens_per_s:.0f} tok/s"
