"""`rlx eval` end to end: load the model, answer the held-out prompts with a fresh rollout engine, grade them, write
OUT/eval.jsonl and a val/* metrics line (the metric math and grading are rlx.evaluation's)."""

from __future__ import annotations

import time
from pathlib import Path

from rlx.errors import UserError
from rlx.evaluation.evaluate import EVAL_FILE, EvalConfig, grade, graded_metrics, sampling_note


def generate(cfg: EvalConfig, rollout_cfg, model, tokenizer, prompts: list, ctx=None, processor=None) -> list:
    """The one call into the rollout engine: responses (RolloutRecords) to `prompts` as `rollout_cfg` samples
    (`processor`: a vision-language model's, for prompts with images)."""
    from rlx.rollout.base import build_engine

    engine = build_engine(rollout_cfg, model, tokenizer, ctx, processor)
    try:
        return engine.generate(prompts, rollout_cfg.sampling).records
    finally:
        engine.close()


def run_eval(
    cfg: EvalConfig,
    model_path: str,
    out: str,
    engine_settings: dict | None = None,
    metrics_path: str | Path | None = None,
    overwrite: bool = False,
) -> dict[str, float]:
    """`rlx eval`: answer cfg.prompts with the model, grade, write OUT/eval.jsonl and a metrics line (logged at
    the checkpoint's step). Returns the metrics."""
    from rlx.checkpoints.loading import load_model, load_processor
    from rlx.checkpoints.registry import read_meta_or_default
    from rlx.formats.records import read_prompts
    from rlx.models.loading import load_tokenizer, resolve_model
    from rlx.observe.tracking import console, log_metrics
    from rlx.parallel.dist import setup
    from rlx.rollout.lengths import limit_prompts, model_context
    from rlx.utils.files import check_writable
    from rlx.utils.io import exists, is_remote, join, local, write_jsonl

    start = time.perf_counter()
    target = join(out, EVAL_FILE)
    if not is_remote(out) and local(out).exists() and not local(out).is_dir():
        raise UserError(f"--out {out}: is a file; expected a folder for {EVAL_FILE}")
    if exists(target) and not overwrite:
        raise UserError(f"{target}: already exists (choose another --out or pass --overwrite)")
    check_writable(target)
    prompts = read_prompts(cfg.prompts)
    rollout_cfg = cfg.rollout_config(**(engine_settings or {}))
    source, config = resolve_model(model_path)
    tokenizer = load_tokenizer(source)
    processor = load_processor(source, rollout_cfg.vision, config)
    limits = dict(config=config, processor=processor)
    prompts = limit_prompts(prompts, tokenizer, rollout_cfg, model_context(config), cfg.prompts, **limits)
    ctx = setup(rollout_cfg.device)
    model = load_model(source, config=config).requires_grad_(False)
    note = sampling_note(getattr(model, "generation_config", None), cfg.sampling)
    if note and ctx.is_main:
        console(f"rlx eval: note: {note}")
    rollouts = generate(cfg, rollout_cfg, model, tokenizer, prompts, ctx, processor)
    samples = grade(rollouts, cfg, ctx)  # every process holds every record: each grades a share
    if not ctx.is_main:
        return {}
    metrics = graded_metrics(samples)
    write_jsonl(target, (s.to_json() for s in samples))
    step = read_meta_or_default(source.path).step
    log_metrics(metrics_path, step, {**metrics, "timing/eval_s": time.perf_counter() - start})
    pass_keys = [k for k in metrics if k.startswith("val/pass@")]
    console(
        f"rlx eval: {len(prompts)} prompts x {cfg.sampling.n}: reward mean {metrics['val/reward_mean']:.3f}, "
        + ", ".join(f"{k[4:]} {metrics[k]:.3f}" for k in pass_keys)
        + f" -> {target}"
    )
    return metrics
