"""Environments and agents that hang cannot hang a run: under --on-env-error zero a call past its timeout is
abandoned, its worker replaced, counted in env/timeouts, and the rollout ends even with more hung calls than
workers. Agents whose every request was refused are told apart from agents that never called. Multi-turn
records keep the tools offered."""

from __future__ import annotations

import contextlib
import sys
import threading

import openai
import pytest

from rlx.agent.agents import AgentRollout
from rlx.agent.driver import EnvRollout
from rlx.agent.environment import CallPool
from rlx.agent.generate import generate_multi_turn
from rlx.errors import UserError
from rlx.rollout.agent_config import AgentConfig
from rlx.rollout.base import RolloutResult
from rlx.rollout.config import RolloutConfig, SamplingParams
from tests.agent_helpers import QUESTIONS, random_chat_model, token_engine

ENVS = '''
import threading

RELEASE = threading.Event()
"""Set by the test at its end: the hung calls return (their threads were abandoned long before)."""
TOOLS = [{"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}]


class HangsInStep:
    tools = TOOLS

    def __init__(self, record):
        self.question = record["prompt"]

    def reset(self):
        return [{"role": "user", "content": self.question}]

    def step(self, message):
        RELEASE.wait()
        return [], 1.0, True


class HangsInResetForQ1(HangsInStep):
    def reset(self):
        if self.question == "say 1":
            RELEASE.wait()
        return super().reset()

    def step(self, message):
        return [], 1.0, True
'''

SAMPLING = RolloutConfig(
    sampling=SamplingParams(n=3, max_new_tokens=4, temperature=1.0, seed=1)
).sampling  # 2 prompts: 6 samples
BOUND_S = 120.0
"""Liveness bound for a rollout that must end (it takes about a second; without the fix it never ends)."""


@pytest.fixture
def envs(tmp_path):
    path = tmp_path / "hung_envs.py"
    path.write_text(ENVS)
    yield path
    module = sys.modules.get(f"rlx_user_env_{path.stem}")
    if module is not None:
        module.RELEASE.set()


def finish(runner) -> RolloutResult:
    """runner.generate(QUESTIONS) in a thread that must end within BOUND_S (re-raising its error)."""
    out: dict = {}

    def run():
        try:
            out["result"] = runner.generate(QUESTIONS)
        except BaseException as e:
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(BOUND_S)
    assert not thread.is_alive(), "the rollout did not end"
    if "error" in out:
        raise out["error"]
    return out["result"]


def env_rollout(model, env: str, **cfg) -> EnvRollout:
    engine = token_engine(*model)
    return EnvRollout(engine, model[1], SAMPLING, AgentConfig(env=env, env_workers=2, env_timeout_s=0.5, **cfg))


def test_more_hung_steps_than_workers_end_the_rollout(envs):
    model = random_chat_model()
    result = finish(env_rollout(model, f"{envs}:HangsInStep", on_env_error="zero"))
    records, stats = result.records, result.stats.episodes
    assert len(records) == 6
    stepped = [r for r in records if r.finish_reason != "length"]  # a turn cut by max_new_tokens is not stepped
    assert len(stepped) > 2  # more hung calls than the 2 workers
    assert all(r.env_reward == 0 and "step() timed out after 0.5 s" in r.extra["env_error"] for r in stepped)
    assert stats.env_timeouts == len(stepped) == stats.env_errors
    assert all(r.tools[0]["function"]["name"] == "noop" for r in records)  # the environment's tools are kept
    assert all(r.to_json()["tools"] == r.tools for r in records)


def test_hung_resets_leave_their_samples_out(envs):
    model = random_chat_model()
    with pytest.raises(UserError, match=r"sample 'q1/0': reset\(\) timed out after 0.5 s"):
        finish(env_rollout(model, f"{envs}:HangsInResetForQ1"))
    result = finish(env_rollout(model, f"{envs}:HangsInResetForQ1", on_env_error="zero"))
    records = result.records
    assert [r.id for r in records] == ["q0/0", "q0/1", "q0/2"]  # q1's samples have no opening prompt
    assert result.stats.episodes.env_timeouts == 3 == result.stats.episodes.env_dropped


def test_pool_replaces_the_workers_of_abandoned_calls():
    release = threading.Event()
    pool = CallPool(workers=1, timeout_s=0.2)
    try:
        outcomes = pool.run([(release.wait, "hang 1"), (release.wait, "hang 2"), (lambda: 7, "quick")])
    finally:
        release.set()
        pool.close()
    assert [o.error for o in outcomes[:2]] == ["hang 1 timed out after 0.2 s", "hang 2 timed out after 0.2 s"]
    assert outcomes[2].value == 7 and pool.num_timeouts == 2


def agent_rollout(model, agent, **cfg) -> AgentRollout:
    config = AgentConfig(**{"env_workers": 2, "agent_timeout_s": 0.5, **cfg})
    return AgentRollout(token_engine(*model), model[1], SAMPLING, config, agent)


TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}


def chat(record, base_url, **extra):
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": record["prompt"]}]
    return client.chat.completions.create(model="rlx", messages=messages, tools=[TOOL], **extra)


def test_more_hung_agents_than_workers_end_the_rollout():
    release = threading.Event()

    def hangs(record, base_url):
        if record["id"] == "q0":
            chat(record, base_url)  # q0's samples have a trajectory; q1's never call
        release.wait()
        return 1.0

    # 3 s: time for q0's request to generate on a busy machine before its agent hangs
    runner = agent_rollout(random_chat_model(), hangs, agent_timeout_s=3, on_env_error="zero")
    try:
        result = finish(runner)
    finally:
        release.set()
    records = result.records
    assert [r.id for r in records] == ["q0/0", "q0/1", "q0/2"]
    assert all(r.env_reward == 0 and "timed out after 3 s" in r.extra["env_error"] for r in records)
    assert all(r.tools == [TOOL] for r in records)  # the tools of the request
    stats = result.stats.episodes
    assert stats.env_timeouts == 6 and stats.env_dropped == 3 and stats.env_errors == 6


def test_refused_requests_are_not_mistaken_for_an_agent_that_never_called():
    def refused_for_q1(record, base_url):
        with contextlib.suppress(openai.BadRequestError):
            if record["id"] == "q1":  # a field the endpoint refuses (400 naming it): no session is made
                chat(record, base_url, logit_bias={"1": 5})
            else:
                chat(record, base_url)
        return 1.0

    model = random_chat_model()
    with pytest.raises(UserError, match=r"sample q1/0: every one of its 1 request\(s\) to its base_url was refused"):
        finish(agent_rollout(model, refused_for_q1, agent_timeout_s=60))
    result = finish(agent_rollout(model, refused_for_q1, agent_timeout_s=60, on_env_error="zero"))
    records = result.records
    assert [r.id for r in records] == ["q0/0", "q0/1", "q0/2"] and all(r.env_reward == 1.0 for r in records)
    assert result.stats.episodes.env_dropped == 3 and result.stats.episodes.env_timeouts == 0

    def silent(record, base_url):
        return 1.0

    with pytest.raises(UserError, match="agent silent for sample q0/0: it never called its base_url"):
        finish(agent_rollout(model, silent))
    result = finish(agent_rollout(model, silent, on_env_error="zero"))
    assert result.records == [] and result.stats.episodes.env_dropped == 6
    cfg = RolloutConfig(
        sampling=SamplingParams(n=3, max_new_tokens=4),
        agent=AgentConfig(agent="tests.unit.test_hung_calls:silent_agent", on_env_error="zero"),
    )
    with pytest.raises(UserError, match="every sample failed before the model generated anything"):
        generate_multi_turn(token_engine(*model), model[1], QUESTIONS, cfg, SAMPLING)


def silent_agent(record, base_url):
    """An agent that never calls its base URL."""
    return 1.0
