"""The score stage as `rlx score` runs it: load rollouts and models, score, write the two outputs."""

from __future__ import annotations

import time
from pathlib import Path

from rlx.engine.checkpoint import read_meta_or_default
from rlx.engine.device import resolve_precision
from rlx.engine.io import join
from rlx.engine.parallel.dist import setup
from rlx.engine.records import read_rollouts, write_records
from rlx.engine.rollout.prompts import pad_token_id
from rlx.engine.scoring.config import ScoreConfig
from rlx.engine.scoring.score import ScoringModels, check_token_ids, score_rollouts
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


def load_scoring_models(cfg: ScoreConfig, actor: str, ref: str | None, critic: str | None) -> ScoringModels:
    """The models `rlx score` needs, on the configured device."""
    from rlx.models.reward_model import RewardModel
    from rlx.models.value import load_value_model

    ctx = setup(cfg.device)
    device = ctx.device
    dtype = resolve_precision(cfg.precision, device)
    actor_source = resolve_source(actor, "actor model")
    config = load_config(actor_source)
    models = ScoringModels(
        device=device,
        dtype=dtype,
        vocab_size=config.vocab_size,
        pad_token_id=pad_token_id(load_tokenizer(actor_source)),
        ctx=ctx,
    )
    if cfg.old_logprobs == "actor":
        models.actor = _load(load_causal_lm, actor_source, cfg).to(device)
    if ref:
        models.ref = _load(load_causal_lm, resolve_source(ref, "reference model"), cfg).to(device)
        if models.ref.config.vocab_size != config.vocab_size:
            raise UserError(
                f"--ref {ref}: vocabulary of {models.ref.config.vocab_size} tokens, "
                f"but the actor has {config.vocab_size}"
            )
    if critic:
        models.critic = _load(load_value_model, resolve_source(critic, "critic"), cfg, critic=True).to(device)
    if cfg.reward_model:
        models.reward_model = RewardModel(resolve_source(cfg.reward_model, "reward model"), device, dtype)
    return models


def _load(loader, source, cfg: ScoreConfig, critic: bool = False):
    """A megatron-layout checkpoint runs on megatron-core (its tp x pp; data parallel over the other
    processes) where installed; everything else loads as a Hugging Face model."""
    from rlx.engine.megatron.stage import load_scoring_model

    return load_scoring_model(source, cfg.device, critic) or loader(source)


def run_score(
    cfg: ScoreConfig,
    rollouts_path: str,
    out: str,
    actor: str,
    ref: str | None = None,
    critic: str | None = None,
    temperature: float | None = None,
    metrics_path: Path | None = None,
) -> None:
    start = time.perf_counter()
    rollouts = read_rollouts(rollouts_path)
    models = load_scoring_models(cfg, actor, ref, critic)
    check_token_ids(rollouts, models.vocab_size, rollouts_path)
    result = score_rollouts(rollouts, cfg, models, rollout_temperature(rollouts, temperature, rollouts_path))
    if result.batch is None:
        raise UserError(
            f"{rollouts_path}: every prompt's samples got the same reward, so --filter-groups left "
            f"nothing to train on; sample more prompts or more responses per prompt"
        )
    if not models.ctx.is_main:
        return
    result.batch.save(join(out, "batch.safetensors"))
    write_records(join(out, "scores.jsonl"), result.scores)
    step = read_meta_or_default(resolve_source(actor).path).step + 1
    log_metrics(metrics_path, step, {**result.metrics, "timing/score_s": time.perf_counter() - start})
    console(
        f"rlx score: {len(rollouts)} samples, reward mean {result.metrics['reward/mean']:.3f} "
        f"-> {join(out, 'scores.jsonl')}, {join(out, 'batch.safetensors')}"
    )
