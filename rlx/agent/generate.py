"""Multi-turn rollouts of a set of prompts on a resident engine, as `rlx rollout --env/--agent` and `rlx ppo` run them.

Under a launcher each process runs the episodes (or agents) of its contiguous share of the prompts, all N
samples of a prompt together, on its own engine stream; the records are gathered back in prompt order on every
process. A sample's tokens depend only on its key (seed, sample id, turn), so any number of processes gives
the same records.
"""

from __future__ import annotations

from rlx.agent.agents import AgentRollout
from rlx.agent.driver import EnvRollout
from rlx.errors import UserError
from rlx.formats.records import PromptRecord, RolloutRecord
from rlx.models.vision.images import image_refs
from rlx.parallel.dist import all_gather_objects, shard_range
from rlx.rollout.base import RolloutEngine, RolloutResult, RolloutStats
from rlx.rollout.config import RolloutConfig, SamplingParams

_SUMMED = (
    "rollout/tokens",
    "rollout/inserted_tokens",
    "env/errors",
    "env/timeouts",
    "env/dropped",
    "rollout/preemptions",
    "rollout/steps_ahead",
    "rollout/prefill_tokens",
    "rollout/cached_prefix_tokens",
)


def generate_multi_turn(
    engine: RolloutEngine, tokenizer, prompts: list[PromptRecord], cfg: RolloutConfig, sampling: SamplingParams
) -> RolloutResult:
    """`sampling.n` episodes of `cfg.agent.env` (or runs of the agent `cfg.agent.agent`) per prompt, in prompt order
    then sample order, on every process; the stats hold the multi-turn metrics."""
    refuse_images(prompts, cfg, type(engine))
    ctx = engine.ctx
    mine = shard_range(len(prompts), ctx.rank, ctx.world) if ctx else range(len(prompts))
    local = [prompts[i] for i in mine]
    runner = multi_turn_runner(engine, tokenizer, cfg, sampling)
    records = runner.generate(local)
    parts = all_gather_objects((records, runner.last_stats)) if ctx else [(records, runner.last_stats)]
    records: list[RolloutRecord] = [r for part, _ in parts for r in part]
    if prompts and not records:  # --on-env-error zero left every sample out (every process's: the same on each)
        raise UserError("every sample failed before the model generated anything (see the line above): no records")
    return RolloutResult(records, multi_turn_stats(records, merge_stats([(len(part), s) for part, s in parts])))


def multi_turn_runner(engine: RolloutEngine, tokenizer, cfg: RolloutConfig, sampling: SamplingParams):
    """The runner of `cfg.agent.agent` (an agent over the OpenAI-compatible endpoint) or `cfg.agent.env` (an
    environment)."""
    if cfg.agent.agent:
        return AgentRollout(engine, tokenizer, sampling, cfg.agent, cfg.agent.agent)
    return EnvRollout(engine, tokenizer, sampling, cfg.agent)


def multi_turn_stats(records: list[RolloutRecord], stats: dict[str, float]) -> RolloutStats:
    """A runner's `last_stats` as the call's RolloutStats (the multi-turn metrics in `extra`)."""
    stats = dict(stats)
    seconds = stats.pop("timing/generate_s", 0.0)
    tokens = int(stats.pop("rollout/tokens", sum(sum(r.loss_mask) for r in records)))
    return RolloutStats(tokens, seconds, extra=stats)


def refuse_images(prompts: list[PromptRecord], cfg: RolloutConfig, engine_class: type[RolloutEngine]) -> None:
    """Prompts with image parts run episodes (of an environment or an agent) on an engine that takes images (hf,
    native): a UserError naming the first such prompt otherwise."""
    with_images = next((r for r in prompts if image_refs(r.prompt, r.id)), None)
    if with_images is None:
        return
    if not engine_class.takes_images:
        raise UserError(
            f"prompt {with_images.id!r} has image parts, which engine {engine_class.name!r} does not take in "
            f"multi-turn rollouts (use engine 'hf' or 'native')"
        )


def merge_stats(parts: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """One stats dict for several processes' (count, stats): counts add up, timings take the slowest process,
    means are weighted by each process's number of samples."""
    total = max(sum(n for n, _ in parts), 1)
    out: dict[str, float] = {}
    for key in sorted({k for _, s in parts for k in s}):
        values = [(n, s[key]) for n, s in parts if key in s]
        if key in _SUMMED or key.startswith("rollout/finish_"):
            out[key] = sum(v for _, v in values)
        elif key.startswith("timing/"):
            out[key] = max(v for _, v in values)
        else:
            out[key] = sum(n * v for n, v in values) / total
    return out
