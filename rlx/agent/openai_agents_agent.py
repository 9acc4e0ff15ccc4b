"""OpenAIAgentsAgent: a user's openai-agents Agent (package `openai-agents`, import `agents`) as an rlx agent
(`agent = "rlx.agent.openai_agents_agent:OpenAIAgentsAgent"` with a [rollout.agent.openai_agents] table;
docs/agents_openai.md).

openai-agents needs openai 3, as rlx does, so it runs in this process: for each sample the user's Agent runs once
(Runner.run, or Runner.run_streamed) with every model call going to the sample's own base URL (RunConfig.model, an
OpenAIChatCompletionsModel or OpenAIResponsesModel over an AsyncOpenAI client), so every request of the run lands
in that sample's trajectory; the run's context is the prompt record. The user's reward function of the run's final
output and the record gives the sample's reward. Samples run concurrently, each in its own thread and event loop.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

from rlx.agent.agents import RunAgent
from rlx.agent.environment import EnvError
from rlx.errors import UserError
from rlx.rollout.agent_config import AgentConfig, OpenAIAgentsConfig
from rlx.utils.user_code import load_object

SERVED_NAME = "rlx"
"""The model name the in-process server answers to (AgentServer's default)."""
TABLE = "rollout.agent.openai_agents"
INSTALL = "pip install 'rlx[agents]' (openai-agents >= 0.24)"


class OpenAIAgentsAgent(RunAgent):
    """Runs the user's openai-agents Agent on the record's input against the sample's base URL; the user's reward
    function of its final output is the sample's reward."""

    def __init__(self, cfg: AgentConfig):
        super().__init__(cfg)
        if cfg.openai_agents is None:
            raise UserError(f"{TABLE}: OpenAIAgentsAgent needs the table (agent = the Agent, reward = ...)")
        self.oa: OpenAIAgentsConfig = cfg.openai_agents
        try:
            import agents
        except ImportError as e:
            raise UserError(f"{TABLE}: cannot import openai-agents ({e}): {INSTALL}") from None
        self._sdk = agents
        target = load_object(self.oa.agent, f"{TABLE}.agent", kind="agent", need_callable=False)
        if not isinstance(target, agents.Agent) and not callable(target):
            raise UserError(f"{TABLE}.agent {self.oa.agent!r}: expected an agents.Agent or a function record -> Agent, "
                            f"got {type(target).__name__}")  # fmt: skip
        self._target = target
        self._reward: Callable = load_object(self.oa.reward, f"{TABLE}.reward", kind="reward")

    def __call__(self, record: dict, base_url: str) -> float:
        sample = unquote(base_url.rpartition("/s/")[2].removesuffix("/v1"))  # AgentServer.base_url's form
        if self.oa.input_key not in record:
            raise UserError(f"prompt {record.get('id')!r}: no field {self.oa.input_key!r} ({TABLE}.input_key)")
        try:
            output = asyncio.run(self._run(self._agent_for(record), record, base_url))
        except self._sdk.MaxTurnsExceeded:
            output = None  # the episode ran out of turns: the reward function is told so
        except UserError:
            raise
        except Exception as e:  # the SDK's, the server's (a refused request) or the agent function's
            raise EnvError(f"sample {sample!r}: the openai-agents run of {self.oa.agent} failed: {_describe(e)}") from e
        try:
            reward = self._reward(output, record)
        except Exception as e:
            raise EnvError(f"sample {sample!r}: the reward function {self.oa.reward} raised {_describe(e)}") from e
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise EnvError(f"sample {sample!r}: the reward function {self.oa.reward} returned {reward!r}, "
                           "expected a finite number")  # fmt: skip
        return float(reward)

    def _agent_for(self, record: dict) -> Any:
        """The user's Agent, or the one its function builds for this record."""
        if isinstance(self._target, self._sdk.Agent):
            return self._target
        agent = self._target(record)
        if not isinstance(agent, self._sdk.Agent):
            raise UserError(f"{TABLE}.agent {self.oa.agent!r} returned {type(agent).__name__} for prompt "
                            f"{record.get('id')!r}, expected an agents.Agent")  # fmt: skip
        return agent

    async def _run(self, agent: Any, record: dict, base_url: str) -> Any:
        """The run's final output; every model call goes to `base_url` (RunConfig.model overrides every agent's,
        handoffs included); tracing is off (it would export to OpenAI's servers)."""
        from openai import AsyncOpenAI

        sdk = self._sdk
        client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
        kind = sdk.OpenAIChatCompletionsModel if self.oa.api == "chat" else sdk.OpenAIResponsesModel
        run_config = sdk.RunConfig(model=kind(model=SERVED_NAME, openai_client=client), tracing_disabled=True)
        options = {"context": record, "max_turns": self.cfg.max_turns, "run_config": run_config}
        try:
            if self.oa.stream:
                result = sdk.Runner.run_streamed(agent, record[self.oa.input_key], **options)
                async for _ in result.stream_events():
                    pass
            else:
                result = await sdk.Runner.run(agent, record[self.oa.input_key], **options)
            return result.final_output
        finally:
            await client.close()


def _describe(error: BaseException) -> str:
    """One line: an HTTP error's status and the server's message, else the exception's type and text."""
    status, body = getattr(error, "status_code", None), getattr(error, "body", None)
    if status is not None:
        message = body.get("message") if isinstance(body, dict) else None
        return f"HTTP {status}: {message or error}"
    return " ".join(f"{type(error).__name__}: {error}".split())[:500]
