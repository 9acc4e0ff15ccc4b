"""A verifiers 0.4 taskset in memory, for tests/stages/test_verifiers_client.py: a few arithmetic questions and a
reward rubric (1 when the last reply holds the answer, or with `--env.taskset.task.tools true`, when an `add` tool
call, served by verifiers over MCP, returned it). It runs in the client's venv (`make setup-test` makes
.venv-verifiers), imported by id: `vf-eval verifiers-arith` with this folder's parent on PYTHONPATH."""

import verifiers.v1 as vf

from verifiers_arith.tools import AddToolset

QUESTIONS = [("1+2", 3), ("2+2", 4), ("3+4", 7)]


class ArithData(vf.TaskData):
    """One question and its answer."""

    answer: int


class ArithTaskConfig(vf.TaskConfig):
    tools: bool = False
    """Offer the `add` tool."""
    toolset: vf.ToolsetConfig = vf.ToolsetConfig()


class ArithTask(vf.Task[ArithData, vf.State, ArithTaskConfig]):
    @classmethod
    def toolsets(cls, config: ArithTaskConfig) -> list[vf.Toolset]:
        return [AddToolset(config.toolset)] if config.tools else []

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        answer = str(self.data.answer)
        if self.config.tools:
            return float(any(m.role == "tool" and m.content == answer for m in trace.messages))
        replies = [m.content for m in trace.messages if m.role == "assistant" and isinstance(m.content, str)]
        return float(bool(replies) and answer in replies[-1])


class ArithConfig(vf.TasksetConfig):
    task: ArithTaskConfig = ArithTaskConfig()


class ArithTaskset(vf.Taskset[ArithTask, ArithConfig]):
    def load(self) -> list[ArithTask]:
        return [ArithTask(ArithData(prompt=f"What is {q}?", answer=a), self.config.task) for q, a in QUESTIONS]


__all__ = ["ArithTaskset"]
