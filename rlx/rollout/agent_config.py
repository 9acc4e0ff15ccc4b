"""AgentConfig: the limits and options of multi-turn rollouts (environments and served agents); no torch import.

RolloutConfig holds it as its `agent` table: these are `rlx rollout` options (--env, --agent, --max-turns, ...) and
keys of a recipe's [rollout.agent] table; the agent package (and `rlx serve`'s endpoint) is given this table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rlx.config import check, check_choices

VERIFIERS_AGENT = "rlx.agent.verifiers_agent:VerifiersAgent"
"""The agent that plays a verifiers environment per sample (its settings: AgentConfig.verifiers)."""
OPENAI_AGENTS_AGENT = "rlx.agent.openai_agents_agent:OpenAIAgentsAgent"
"""The agent that runs a user's openai-agents Agent per sample (its settings: AgentConfig.openai_agents)."""


@dataclass(kw_only=True)
class VerifiersConfig:
    """A verifiers 0.4 environment trained as an agent (`agent = "rlx.agent.verifiers_agent:VerifiersAgent"`): one
    worker process in verifiers' own venv plays one rollout of the record's task per sample (docs/verifiers.md)."""

    env: str
    """The verifiers taskset id, as `vf-eval ID` takes it (`verifiers-arith` imports the package `verifiers_arith`)."""
    args: list[str] = field(default_factory=list)
    """More vf-eval options for the environment, e.g. ["--env.agent.harness.id", "null", "--env.agent.runtime.type",
    "subprocess"] ('--model' and '--client.base-url' are rlx's: the served model, each sample's base URL)."""
    python: str = ".venv-verifiers/bin/python"
    """The Python of the venv verifiers is installed in (a relative path: from the current directory); its folder goes
    first on the worker's PATH (the harnesses run `uv`)."""
    python_path: list[str] = field(default_factory=list)
    """Folders put on the worker's PYTHONPATH: where a taskset package not installed in that venv lives."""
    task_key: str = "verifiers_task"
    """The prompt record field that holds its task: the index into the taskset's tasks (after the `--select.*`
    options in `args`)."""
    start_timeout_s: float = 300.0
    """Longest the worker may take to load the environment and start its servers, in seconds."""

    def __post_init__(self) -> None:
        check(bool(self.env), "env", "give the verifiers taskset id, e.g. 'verifiers-arith'")
        check(bool(self.task_key), "task_key", "must name a prompt record field")
        check(self.start_timeout_s > 0, "start_timeout_s", f"must be > 0, got {self.start_timeout_s}")
        for arg in self.args:
            name = arg.split("=", 1)[0]
            check(name not in ("--model", "-m", "--client.base-url"), "args", f"{name} is set by rlx, leave it out")


@dataclass(kw_only=True)
class OpenAIAgentsConfig:
    """A user's openai-agents Agent trained as an agent (`agent = "rlx.agent.openai_agents_agent:OpenAIAgentsAgent"`):
    one run of it per sample, its model pointed at the sample's base URL (docs/agents_openai.md)."""

    agent: str
    """The user's agent, `path/file.py:NAME` or `package.module:NAME`: an `agents.Agent`, or a function
    record -> Agent (called once per sample, e.g. for tools holding per-sample state)."""
    reward: str
    """The reward, `path/file.py:NAME` or `package.module:NAME`: NAME(output, record) -> float, `output` the run's
    final output (None when the run stopped at max_turns), `record` the prompt record (the run's context)."""
    api: Literal["chat", "responses"] = "chat"
    """The agent's model: 'chat' (OpenAIChatCompletionsModel) or 'responses' (OpenAIResponsesModel), over an
    AsyncOpenAI client at the sample's base URL."""
    stream: bool = False
    """Run each sample with Runner.run_streamed (every turn streamed) instead of Runner.run."""
    input_key: str = "prompt"
    """The prompt record field given to the run as its input: a text, or chat messages with text content."""

    def __post_init__(self) -> None:
        check_choices(self)
        for key in ("agent", "reward"):
            value = getattr(self, key)
            check(":" in value, key, f"expected path/file.py:NAME or package.module:NAME, got {value!r}")
        check(bool(self.input_key), "input_key", "must name a prompt record field")


@dataclass(kw_only=True)
class AgentConfig:
    """How multi-turn episodes run (the per-turn token limit is the rollout's max_new_tokens)."""

    env: str = ""
    """Multi-turn: the environment, `path/file.py:NAME` or `package.module:NAME`; NAME(record) is called once per
    sample and gives an object with reset() -> messages and step(message) -> (messages, reward, done)."""
    agent: str = ""
    """Multi-turn: an agent, `path/file.py:NAME` or `package.module:NAME`; NAME(record, base_url) -> reward runs
    once per sample against an OpenAI-compatible endpoint rlx serves in-process."""
    max_turns: int = 8
    """Multi-turn: most assistant turns in one episode; the episode then ends with finish_reason 'max_turns'."""
    max_total_tokens: int = 4096
    """Multi-turn: most tokens in an episode's whole context (opening prompt + every turn; a turn gets at most
    max_new_tokens); past it, finish_reason 'length'."""
    on_env_error: Literal["raise", "zero"] = "raise"
    """An environment (or agent) that raises, times out or returns the wrong types: 'raise' stops with the
    sample id; 'zero' ends that episode with reward 0, records the error and counts it in env/errors."""
    env_timeout_s: float = 60.0
    """Longest one environment call (constructor, reset, step) may take, in seconds."""
    env_workers: int = 32
    """Threads running environment calls (and agents) concurrently."""
    agent_timeout_s: float = 600.0
    """Served agents: longest one agent call NAME(record, base_url) may take, in seconds."""
    tool_parser: Literal["auto", "qwen", "hermes", "smollm2", "none"] = "auto"
    """How tool calls are read from assistant text: 'qwen' (= 'hermes') for <tool_call>{json}</tool_call>
    blocks as Qwen2.5/Qwen3 templates write them, 'smollm2' for a JSON list of calls in <tool_call> blocks, 'none'
    for plain text; 'auto' chooses from the model's chat template where rlx serve renders it (else 'qwen')."""
    verifiers: VerifiersConfig | None = None
    """The verifiers environment that agent = "rlx.agent.verifiers_agent:VerifiersAgent" plays (a recipe's
    [rollout.agent.verifiers] table); absent: none."""
    openai_agents: OpenAIAgentsConfig | None = None
    """The openai-agents Agent that agent = "rlx.agent.openai_agents_agent:OpenAIAgentsAgent" runs (a recipe's
    [rollout.agent.openai_agents] table); absent: none."""
    chat_template_kwargs: dict = field(default_factory=dict)
    """Extra variables for the chat template, single-turn prompts and multi-turn episodes alike, e.g.
    '{"enable_thinking": false}' on the command line or {enable_thinking = false} in a recipe for Qwen3 templates."""

    def __post_init__(self) -> None:
        check_choices(self)
        check(self.max_turns >= 1, "max_turns", f"must be at least 1, got {self.max_turns}")
        check(self.max_total_tokens >= 2, "max_total_tokens", f"must be at least 2, got {self.max_total_tokens}")
        check(self.env_timeout_s > 0, "env_timeout_s", f"must be > 0, got {self.env_timeout_s}")
        check(self.env_workers >= 1, "env_workers", f"must be at least 1, got {self.env_workers}")
        check(self.agent_timeout_s > 0, "agent_timeout_s", f"must be > 0, got {self.agent_timeout_s}")
        for key in ("env", "agent"):
            value = getattr(self, key)
            check(value == "" or ":" in value, key, f"expected path/file.py:NAME or package.module:NAME, got {value!r}")
        check(not (self.env and self.agent), "agent", "give an environment (env) or an agent, not both")
        if self.verifiers is not None:
            why = f"the verifiers table is played by agent = {VERIFIERS_AGENT!r}"
            check(self.agent == VERIFIERS_AGENT, "agent", why)
        if self.agent == VERIFIERS_AGENT:
            check(self.verifiers is not None, "verifiers", "this agent needs its table (env = the taskset id, ...)")
        if self.openai_agents is not None:
            why = f"the openai_agents table is run by agent = {OPENAI_AGENTS_AGENT!r}"
            check(self.agent == OPENAI_AGENTS_AGENT, "agent", why)
        if self.agent == OPENAI_AGENTS_AGENT:
            check(self.openai_agents is not None, "openai_agents", "this agent needs its table (agent, reward, ...)")

    @property
    def is_multi_turn(self) -> bool:
        """Whether rollouts are episodes of an environment or runs of an agent."""
        return bool(self.env or self.agent)
