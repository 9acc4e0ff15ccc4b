"""build_rollout: the engine itself for single-turn rollouts, an episode runner with the engine's `generate` interface
for multi-turn ones, whose statistics are typed (EpisodeStats) and merge over processes as the metrics say."""

from __future__ import annotations

import pytest

from rlx.agent.generate import EpisodeRollout, build_rollout
from rlx.formats.records import PromptRecord
from rlx.rollout.agent_config import AgentConfig
from rlx.rollout.base import RolloutResult, RolloutStats
from rlx.rollout.config import RolloutConfig, SamplingParams
from rlx.rollout.stats import EpisodeStats
from tests.agent_helpers import ENVS, random_chat_model, token_engine

QUESTIONS = [PromptRecord(id="q0", prompt="one"), PromptRecord(id="q1", prompt="two")]


@pytest.fixture(scope="module")
def model():
    return random_chat_model()


def test_single_turn_gets_the_engine_itself(model):
    engine = token_engine(*model)
    assert build_rollout(RolloutConfig(sampling=SamplingParams(n=2, max_new_tokens=4)), engine) is engine


def test_multi_turn_gets_episodes_with_typed_stats(model, tmp_path):
    (tmp_path / "envs.py").write_text(ENVS)
    engine = token_engine(*model)
    cfg = RolloutConfig(
        sampling=SamplingParams(n=2, max_new_tokens=6, temperature=1.0, seed=3),
        agent=AgentConfig(env=f"{tmp_path}/envs.py:Echo"),
    )
    rollout = build_rollout(cfg, engine)
    assert isinstance(rollout, EpisodeRollout) and rollout.engine is engine
    result = rollout.generate(QUESTIONS, cfg.sampling, progress=False)
    assert isinstance(result, RolloutResult) and [r.id for r in result.records] == ["q0/0", "q0/1", "q1/0", "q1/1"]
    stats = result.stats.episodes
    assert isinstance(stats, EpisodeStats)
    assert result.stats.tokens == sum(sum(r.loss_mask) for r in result.records) > 0
    assert stats.turns_mean == sum(r.num_turns for r in result.records) / 4 >= 1
    assert stats.env_reward_mean == sum(r.env_reward for r in result.records) / 4
    assert stats.finish_stop + stats.finish_length + stats.finish_max_turns + stats.finish_env_done == 4
    assert stats.env_errors == stats.env_dropped == stats.env_timeouts == 0
    assert stats.segments_mean is None and stats.serve_engine_steps is None  # an agent's metrics, not an env's
    metrics = result.stats.metrics()
    assert metrics["rollout/turns_mean"] == stats.turns_mean and metrics["env/errors"] == 0.0
    assert "rollout/segments_mean" not in metrics and metrics["rollout/tokens"] == result.stats.tokens


def test_episode_stats_merge_and_add_as_their_metrics_say():
    a = EpisodeStats(turns_mean=2.0, env_errors=1, env_s=3.0, render_s=1.0, preemptions=4)
    b = EpisodeStats(turns_mean=1.0, env_errors=2, env_s=5.0, segments_mean=1.0)
    merged = EpisodeStats.merge([(3, a), (1, b)])  # two processes: 3 samples and 1
    assert merged.turns_mean == 7 / 4 and merged.env_errors == 3 and merged.env_s == 5.0
    assert merged.render_s == 1.0 and merged.preemptions == 4 and merged.segments_mean == 1 / 4
    assert EpisodeStats.merge([(3, a)]) == a  # one process's stats as they are
    both = a + b  # two batches of one step: timings add up, the rest is the later batch's where it has them
    assert (both.env_s, both.render_s, both.turns_mean, both.env_errors, both.preemptions) == (8.0, 1.0, 1.0, 2, 4)
    total = RolloutStats(5, 1.0, episodes=a) + RolloutStats(7, 2.0, episodes=b)
    assert (total.tokens, total.seconds, total.episodes) == (12, 3.0, both)
    assert RolloutStats(1, 1.0).metrics().keys() == {"rollout/tokens", "timing/generate_s", "perf/rollout_tokens_per_s"}
    launched = RolloutStats(1, 1.0, local_seconds=0.7, gather_seconds=0.3)
    launched += RolloutStats(1, 2.0, local_seconds=1.5, gather_seconds=0.5)
    parts = launched.metrics()  # under a launcher: the rank's own share and the gather (the wait inside)
    assert (parts["timing/generate_local_s"], parts["timing/generate_gather_s"]) == (2.2, 0.8)
