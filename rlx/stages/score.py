"""The score stage as `rlx score` runs it: load rollouts and models, score, write the two outputs."""

from __future__ import annotations

import time
from pathlib import Path

from rlx.backends.registry import scoring_backend
from rlx.checkpoints.loading import load_processor
from rlx.checkpoints.meta import CheckpointMeta
from rlx.checkpoints.registry import read_meta_or_default
from rlx.errors import UserError
from rlx.formats.records import read_rollouts
from rlx.models.fingerprint import check_fingerprint, model_signature, tokenizer_fingerprint
from rlx.models.loading import PACKAGE_SCHEME, ModelSource, load_tokenizer, resolve_model
from rlx.observe.tracking import console, log_metrics
from rlx.parallel.dist import context, setup
from rlx.rollout.prompts import pad_token_id
from rlx.scoring.config import ScoreConfig
from rlx.scoring.score import ScoringModels, check_token_ids, score_rollouts
from rlx.training.reference import shared_reference
from rlx.utils.device import resolve_precision
from rlx.utils.files import check_writable
from rlx.utils.io import atomic_path, exists, is_remote, join, local, write_jsonl


def check_output_folder(out: str, names: tuple[str, ...], overwrite: bool) -> None:
    """Refuse, before any work, an output folder that is a file, already holds one of `names` (without
    --overwrite), or cannot be written."""
    if not is_remote(out) and local(out).exists() and not local(out).is_dir():
        raise UserError(f"--out {out}: is a file; expected a folder for {' and '.join(names)}")
    taken = [str(join(out, n)) for n in names if exists(join(out, n))]
    if taken and not overwrite:
        raise UserError(f"{taken[0]}: already exists (choose another --out or pass --overwrite)")
    check_writable(join(out, names[0]))


def write_score_outputs(out: str, batch, scores: list, store_pixels: bool) -> None:
    """batch.safetensors and scores.jsonl as one: both are written to temporaries first and renamed only once
    both are whole, so a failure (a full disk, a kill) leaves neither new file (nor a stale pair half-replaced)."""
    with atomic_path(join(out, "batch.safetensors")) as batch_tmp, atomic_path(join(out, "scores.jsonl")) as tmp:
        batch.write(batch_tmp, store_pixels)
        write_jsonl(tmp, (r.to_json() for r in scores))


def check_rollout_tokenizer(rollouts, rollouts_path: str, expected: str, actor: str) -> None:
    """Every rollout's tokenizer fingerprint (where the line has one) is the actor's: a UserError naming both."""
    for record in rollouts:
        check_fingerprint(record.tokenizer, f"{rollouts_path}: sample {record.id!r}", expected, f"the actor {actor}")


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


def load_scoring_models(
    cfg: ScoreConfig, actor: tuple[ModelSource, object], ref: str | None, critic: str | None
) -> ScoringModels:
    """The models `rlx score` needs (`actor`: the actor's source and config, from `resolve_model`; every other path
    resolved and its config read once here); each runs on the backend that holds its checkpoint's layout (falling
    back to the merged Hugging Face model where that backend cannot run here). A LoRA actor's base as the reference
    is the actor's own module with its adapters off (scoring/reference.py)."""
    from rlx.models.reward_model import RewardModel

    ctx = setup(cfg.device)
    actor_source, config = actor
    tokenizer = load_tokenizer(actor_source)
    models = ScoringModels(
        dtype=resolve_precision(cfg.precision, ctx.device),
        vocab_size=config.get_text_config().vocab_size,
        pad_token_id=pad_token_id(tokenizer),
        tokenizer=tokenizer_fingerprint(tokenizer),
        processor=load_processor(actor_source, cfg.vision, config),
        model_config=config,
        actor_id=actor_identity(actor_source.path, config),
    )
    if cfg.old_logprobs in ("actor", "auto"):  # 'auto' picks 'train' only inside `rlx ppo`
        models.actor = _load(actor_source, config, "actor", cfg, ctx.world)
    if ref:
        ref_source, ref_config = actor if _same_path(ref, actor_source) else resolve_model(ref, "reference model")
        vocab = ref_config.get_text_config().vocab_size
        if vocab != models.vocab_size:
            raise UserError(f"--ref {ref}: vocabulary of {vocab} tokens, but the actor has {models.vocab_size}")
        shared = shared_reference(models.actor, ref_source.path, actor_source.path)
        models.ref = shared or _load(ref_source, ref_config, "actor", cfg, ctx.world)
    if critic:
        models.critic = _load(*resolve_model(critic, "critic"), "critic", cfg, ctx.world)
    if cfg.reward_model:
        models.reward_model = RewardModel(*resolve_model(cfg.reward_model, "reward model"), ctx.device, models.dtype)
    return models


def actor_identity(path: Path, config) -> dict:
    """BatchMeta.actor of a batch scored by the model at `path`: its folder, checkpoint step, and model signature."""
    step = read_meta_or_default(path).step if path.is_dir() else None
    return {"path": str(path.resolve()), "step": step, "model": model_signature(config)}


def _same_path(path: str, source: ModelSource) -> bool:
    """Whether `path` is the local file or folder `source` was resolved from (a remote or package path: no)."""
    if is_remote(path) or path.startswith(PACKAGE_SCHEME):
        return False
    return local(path).resolve() == source.path.resolve()


def _load(source: ModelSource, config, role: str, cfg: ScoreConfig, world: int):
    """A scoring model of `source` (`config`: its config where read already) on the backend that runs its layout
    here."""
    meta = CheckpointMeta() if source.is_gguf else read_meta_or_default(source.path)
    backend_cls, degrees = scoring_backend(meta, world, str(source.path))
    return backend_cls.setup(cfg.device, degrees).load_scoring_model(source, role, config)


def run_score(
    cfg: ScoreConfig,
    rollouts_path: str,
    out: str,
    actor: str,
    ref: str | None = None,
    critic: str | None = None,
    temperature: float | None = None,
    metrics_path: Path | None = None,
    overwrite: bool = False,
) -> None:
    start = time.perf_counter()
    check_output_folder(out, ("scores.jsonl", "batch.safetensors"), overwrite)
    rollouts = read_rollouts(rollouts_path)
    actor_source, actor_config = resolve_model(actor, "actor model")
    models = load_scoring_models(cfg, (actor_source, actor_config), ref, critic)
    check_rollout_tokenizer(rollouts, rollouts_path, models.tokenizer, actor)
    check_token_ids(rollouts, models.vocab_size, rollouts_path)
    temperature = rollout_temperature(rollouts, temperature, rollouts_path)
    result = score_rollouts(rollouts, cfg, models, temperature, replicas=context())  # each process read every sample
    if result.batch is None:
        raise UserError(
            f"{rollouts_path}: every prompt's samples got the same reward, so --filter-groups left "
            f"nothing to train on; sample more prompts or more responses per prompt"
        )
    if not context().is_main:
        return
    write_score_outputs(out, result.batch, result.scores, cfg.vision.store_pixels)
    step = read_meta_or_default(actor_source.path).step + 1
    log_metrics(metrics_path, step, {**result.metrics, "timing/score_s": time.perf_counter() - start})
    errors = int(result.metrics.get("reward/num_errors", 0))
    console(
        f"rlx score: {len(rollouts)} samples, reward mean {result.metrics['reward/mean']:.3f} "
        + (f"({errors} reward errors, scored 0) " if errors else "")
        + f"-> {join(out, 'scores.jsonl')}, {join(out, 'batch.safetensors')}"
    )
