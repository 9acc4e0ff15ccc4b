"""Multi-turn rollouts of a set of prompts on a resident engine, as `rlx rollout --env/--agent` and `rlx ppo` run them.

Under a launcher each process runs the episodes (or agents) of its contiguous share of the prompts, all N
samples of a prompt together, on its own engine stream (with a tensor-parallel engine, the first rank of each group
runs the group's share and the others' streams mirror it: rlx/rollout/mirror.py); the records are gathered back in
prompt order on every process. A sample's tokens depend only on its key (seed, sample id, turn), so any number of
processes gives the same records.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from rlx.agent.agents import AgentRollout, RunAgent, load_agent
from rlx.agent.driver import EnvRollout
from rlx.errors import UserError
from rlx.formats.records import PromptRecord, RolloutRecord
from rlx.models.vision.images import image_refs
from rlx.parallel.dist import all_gather_objects
from rlx.rollout.base import RolloutEngine, RolloutResult, RolloutStats
from rlx.rollout.config import RolloutConfig, SamplingParams
from rlx.rollout.stats import EpisodeStats


def build_rollout(cfg: RolloutConfig, engine: RolloutEngine) -> RolloutEngine | EpisodeRollout:
    """What generates a run's samples: the engine itself, or with `cfg.agent.env` / `cfg.agent.agent` an EpisodeRollout
    on it. Both answer `generate(prompts, sampling) -> RolloutResult`."""
    return EpisodeRollout(engine, cfg) if cfg.agent.is_multi_turn else engine


class EpisodeRollout:
    """Multi-turn rollouts on an engine: episodes of `cfg.agent.env`, or runs of the agent `cfg.agent.agent`, built per
    call. The agent is loaded once, on the first call; a RunAgent (one holding a worker process) is closed when this
    object goes, or at exit."""

    def __init__(self, engine: RolloutEngine, cfg: RolloutConfig):
        self.engine, self.cfg = engine, cfg
        self.agent: Callable | None = None

    def generate(self, prompts: list[PromptRecord], sampling: SamplingParams, progress: bool = True) -> RolloutResult:
        """`sampling.n` samples per prompt, in prompt order then sample order, on every process; the stats hold
        the episodes' metrics. (`progress`: no bar is shown for episodes.)"""
        if self.cfg.agent.agent and self.agent is None:
            self.agent = load_agent(self.cfg.agent.agent, self.cfg.agent)
            if isinstance(self.agent, RunAgent):
                weakref.finalize(self, self.agent.close)
        return generate_multi_turn(self.engine, self.engine.tokenizer, prompts, self.cfg, sampling, self.agent)


def generate_multi_turn(
    engine: RolloutEngine,
    tokenizer,
    prompts: list[PromptRecord],
    cfg: RolloutConfig,
    sampling: SamplingParams,
    agent: Callable | None = None,
) -> RolloutResult:
    """`sampling.n` episodes of `cfg.agent.env` (or runs of the agent `cfg.agent.agent`) per prompt, in prompt order
    then sample order, on every process; the stats hold the multi-turn metrics. `agent`: the agent loaded already
    (else it is loaded for this call)."""
    refuse_images(prompts, cfg, type(engine))
    ctx = engine.ctx
    mine = engine.stream_share(len(prompts))  # a tensor-parallel group's first rank runs the group's episodes
    local = multi_turn_runner(engine, tokenizer, cfg, sampling, agent).generate([prompts[i] for i in mine])
    parts = all_gather_objects((local.records, local.stats)) if ctx else [(local.records, local.stats)]
    records: list[RolloutRecord] = [r for part, _ in parts for r in part]
    if prompts and not records:  # --on-env-error zero left every sample out (every process's: the same on each)
        raise UserError("every sample failed before the model generated anything (see the line above): no records")
    return RolloutResult(records, merge_stats([(len(part), stats) for part, stats in parts]))


def multi_turn_runner(
    engine: RolloutEngine, tokenizer, cfg: RolloutConfig, sampling: SamplingParams, agent: Callable | None = None
):
    """The runner of `cfg.agent.agent` (an agent over the OpenAI-compatible endpoint; `agent`: it, loaded already) or
    `cfg.agent.env` (an environment)."""
    if cfg.agent.agent:
        return AgentRollout(engine, tokenizer, sampling, cfg.agent, agent or cfg.agent.agent)
    return EnvRollout(engine, tokenizer, sampling, cfg.agent)


def merge_stats(parts: list[tuple[int, RolloutStats]]) -> RolloutStats:
    """One RolloutStats for several processes' (number of samples, multi-turn stats): tokens add up, the time is
    the slowest process's, the episodes' metrics merge as EpisodeStats.merge says."""
    episodes = [(n, s.episodes) for n, s in parts if s.episodes is not None]
    return RolloutStats(
        sum(s.tokens for _, s in parts),
        max((s.seconds for _, s in parts), default=0.0),
        episodes=EpisodeStats.merge(episodes) if episodes else None,
    )


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
