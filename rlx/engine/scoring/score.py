"""The score stage: rewards, old/ref logprobs, KL, advantages -> scores.jsonl records + a TrainBatch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlx.engine.algorithms.advantages import compute_grpo_advantages
from rlx.engine.algorithms.core import masked_mean
from rlx.engine.algorithms.losses import kl_estimate
from rlx.engine.batch import BatchMeta, TrainBatch, collate
from rlx.engine.logprobs import batched_response_logprobs
from rlx.engine.records import RolloutRecord, ScoreRecord
from rlx.engine.scoring.config import ScoreConfig
from rlx.engine.scoring.rewards import RewardFunctions
from rlx.errors import UserError


@dataclass
class ScoredModels:
    """The models scoring needs: the actor for old logprobs, optionally a frozen reference."""

    actor: object | None
    ref: object | None
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    pad_token_id: int


@dataclass
class ScoreResult:
    scores: list[ScoreRecord]
    batch: TrainBatch
    metrics: dict[str, float]


def compute_rewards(rollouts: list[RolloutRecord], cfg: ScoreConfig) -> tuple[torch.Tensor, list[dict], list]:
    """Reward of every sample: ([B] scores, details, errors). Failures raise unless on_reward_error='zero'."""
    functions = RewardFunctions(cfg.reward)
    scores, details, errors = [], [], []
    for rollout in rollouts:
        result = functions.compute(rollout)
        if result.error and cfg.on_reward_error == "raise":
            raise UserError(
                f"sample {rollout.id!r}: {result.error} "
                f"(pass --on-reward-error zero to score such samples 0 and count them)"
            )
        scores.append(result.score)
        details.append(result.details)
        errors.append(result.error)
    return torch.tensor(scores, dtype=torch.float32), details, errors


def check_token_ids(rollouts: list[RolloutRecord], vocab_size: int, where: str) -> None:
    """Every token id must be inside the model's vocabulary."""
    for rec in rollouts:
        top = max(max(rec.prompt_ids), max(rec.response_ids))
        if top >= vocab_size:
            raise UserError(
                f"{where}: sample {rec.id!r} has token id {top}, but the model's vocabulary "
                f"has {vocab_size} entries (rollouts made with another tokenizer?)"
            )


def score_rollouts(
    rollouts: list[RolloutRecord], cfg: ScoreConfig, models: ScoredModels, temperature: float
) -> ScoreResult:
    """Score rollouts and build the training batch."""
    rewards, details, errors = compute_rewards(rollouts, cfg)
    tensors = collate(rollouts, models.pad_token_id)
    mask = tensors["response_mask"]
    old = tensors["rollout_logprobs"].clone()
    if models.actor is not None:
        old = batched_response_logprobs(
            models.actor, tensors, temperature, models.device, models.dtype, cfg.micro_batch_size, "old logprobs"
        )
    ref = None
    if models.ref is not None:
        ref = batched_response_logprobs(
            models.ref, tensors, temperature, models.device, models.dtype, cfg.micro_batch_size, "ref logprobs"
        )
    token_rewards = torch.zeros_like(old)
    last = mask.sum(-1) - 1
    token_rewards[torch.arange(len(rollouts)), last] = rewards
    metrics: dict[str, float] = {}
    if ref is not None:
        kl = kl_estimate(old, ref, cfg.kl_estimator) * mask
        metrics["actor/ref_kl"] = masked_mean(kl, mask).item()
        if cfg.kl_coef > 0:
            token_rewards = token_rewards - cfg.kl_coef * kl
    elif cfg.kl_coef > 0:
        raise UserError("--kl-coef needs a reference model (--ref)")
    group_ids = [r.prompt_id for r in rollouts]
    advantages, returns = compute_grpo_advantages(token_rewards.sum(-1), group_ids, mask, cfg.norm_adv_by_std)
    meta = BatchMeta(
        sample_ids=[r.id for r in rollouts],
        group_ids=group_ids,
        vocab_size=models.vocab_size,
        pad_token_id=models.pad_token_id,
        temperature=temperature,
        settings={
            "estimator": cfg.estimator,
            "norm_adv_by_std": cfg.norm_adv_by_std,
            "kl_coef": cfg.kl_coef,
            "kl_estimator": cfg.kl_estimator,
            "reward": cfg.reward,
        },
    )
    batch = TrainBatch(
        meta=meta,
        old_logprobs=old,
        ref_logprobs=ref,
        token_rewards=token_rewards,
        advantages=advantages,
        returns=returns,
        rewards=rewards,
        **tensors,
    )
    seq_adv = advantages.sum(-1) / mask.sum(-1).clamp(min=1)
    scores = [
        ScoreRecord(
            id=r.id,
            prompt_id=r.prompt_id,
            reward=float(rewards[i]),
            rewards=details[i],
            advantage=float(seq_adv[i]),
            response_length=len(r.response_ids),
            reward_error=errors[i],
        )
        for i, r in enumerate(rollouts)
    ]
    metrics.update(score_metrics(rollouts, rewards, batch, errors))
    metrics.update(detail_metrics(details))
    return ScoreResult(scores, batch, metrics)


def score_metrics(rollouts: list[RolloutRecord], rewards: torch.Tensor, batch: TrainBatch, errors: list) -> dict:
    """Reward, length, advantage and train/rollout mismatch summaries for metrics.jsonl."""
    lengths = torch.tensor([len(r.response_ids) for r in rollouts], dtype=torch.float32)
    prompt_lengths = torch.tensor([len(r.prompt_ids) for r in rollouts], dtype=torch.float32)
    mask = batch.response_mask
    out = {
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
        "reward/max": rewards.max().item(),
        "reward/min": rewards.min().item(),
        "reward/num_errors": float(sum(e is not None for e in errors)),
        "response_length/mean": lengths.mean().item(),
        "response_length/max": lengths.max().item(),
        "response_length/min": lengths.min().item(),
        "response_length/clip_ratio": sum(r.finish_reason == "length" for r in rollouts) / len(rollouts),
        "prompt_length/mean": prompt_lengths.mean().item(),
        "advantages/mean": masked_mean(batch.advantages, mask).item(),
        "advantages/max": batch.advantages[mask].max().item(),
        "advantages/min": batch.advantages[mask].min().item(),
    }
    diff = (batch.old_logprobs - batch.rollout_logprobs).abs()
    out["rollout/logprob_abs_diff_mean"] = masked_mean(diff, mask).item()
    out["rollout/logprob_abs_diff_max"] = diff[mask].max().item()
    return out


def detail_metrics(details: list[dict]) -> dict[str, float]:
    """Mean of every named reward component over the samples that report it: reward/<fn>/<key>."""
    sums: dict[str, list[float]] = {}
    for per_sample in details:
        for fn_name, values in per_sample.items():
            for key, value in values.items():
                sums.setdefault(f"reward/{fn_name}/{key}", []).append(value)
    return {k: sum(v) / len(v) for k, v in sorted(sums.items())}
