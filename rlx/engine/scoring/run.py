"""The score stage as `rlx score` runs it: load rollouts and models, score, write the two outputs."""

from __future__ import annotations

import time
from pathlib import Path

from rlx.engine.checkpoint import read_meta_or_default
from rlx.engine.device import resolve_device, resolve_precision
from rlx.engine.records import read_rollouts, write_records
from rlx.engine.rollout.prompts import pad_token_id
from rlx.engine.scoring.config import ScoreConfig
from rlx.engine.scoring.score import ScoredModels, check_token_ids, score_rollouts
from rlx.engine.tracking import console, log_metrics
from rlx.errors import UserError
from rlx.models.loading import load_causal_lm, load_config, load_tokenizer, resolve_source


def rollout_temperature(rollouts, override: float | None, where: str) -> float:
    """The temperature logprobs are computed at: the rollouts' own (they must agree) or an override."""
    if override is not None:
        if override <= 0:
            raise UserError(f"--temperature must be > 0, got {override}")
        return override
    temps = {r.temperature for r in rollouts}
    if len(temps) > 1:
        raise UserError(
            f"{where}: rollouts were sampled at different temperatures {sorted(temps)}; "
            f"score them separately or pass --temperature"
        )
    temp = temps.pop()
    return temp if temp > 0 else 1.0


def run_score(
    cfg: ScoreConfig,
    rollouts_path: str,
    out: str,
    actor: str,
    ref: str | None,
    temperature: float | None = None,
    metrics_path: Path | None = None,
) -> None:
    start = time.perf_counter()
    rollouts = read_rollouts(rollouts_path)
    device = resolve_device(cfg.device)
    dtype = resolve_precision(cfg.precision, device)
    actor_source = resolve_source(actor, "actor model")
    config = load_config(actor_source)
    tokenizer = load_tokenizer(actor_source)
    check_token_ids(rollouts, config.vocab_size, rollouts_path)
    actor_model = load_causal_lm(actor_source).to(device) if cfg.old_logprobs == "actor" else None
    ref_model = load_causal_lm(resolve_source(ref, "reference model")).to(device) if ref else None
    if ref_model is not None and ref_model.config.vocab_size != config.vocab_size:
        raise UserError(
            f"--ref {ref}: vocabulary of {ref_model.config.vocab_size} tokens, but the actor has {config.vocab_size}"
        )
    models = ScoredModels(
        actor=actor_model,
        ref=ref_model,
        device=device,
        dtype=dtype,
        vocab_size=config.vocab_size,
        pad_token_id=pad_token_id(tokenizer),
    )
    result = score_rollouts(rollouts, cfg, models, rollout_temperature(rollouts, temperature, rollouts_path))
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result.batch.save(out_dir / "batch.safetensors")
    write_records(out_dir / "scores.jsonl", result.scores)
    step = read_meta_or_default(actor_source.path).step + 1
    log_metrics(metrics_path, step, {**result.metrics, "timing/score_s": time.perf_counter() - start})
    console(
        f"rlx score: {len(rollouts)} samples, reward mean {result.metrics['reward/mean']:.3f} "
        f"-> {out_dir / 'scores.jsonl'}, {out_dir / 'batch.safetensors'}"
    )
