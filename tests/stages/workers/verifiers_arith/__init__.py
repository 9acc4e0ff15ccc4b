"""A verifiers 0.4 taskset in memory, for tests/stages/test_verifiers_client.py: a few arithmetic questions and a
reward rubric (1 when the reply holds the answer). It runs in the client's venv (`make setup-test` makes
.venv-verifiers), imported by id: `vf-eval verifiers-arith` with this folder's parent on PYTHONPATH."""

import verifiers.v1 as vf

QUESTIONS = [("1+2", 3), ("2+2", 4), ("3+4", 7)]


class ArithData(vf.TaskData):
    """One question and its answer."""

    answer: int


class ArithTask(vf.Task[ArithData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        replies = [m.content for m in trace.messages if m.role == "assistant" and isinstance(m.content, str)]
        return float(bool(replies) and str(self.data.answer) in replies[-1])


class ArithConfig(vf.TasksetConfig):
    task: vf.TaskConfig = vf.TaskConfig()


class ArithTaskset(vf.Taskset[ArithTask, ArithConfig]):
    def load(self) -> list[ArithTask]:
        return [ArithTask(ArithData(prompt=f"What is {q}?", answer=a), self.config.task) for q, a in QUESTIONS]


__all__ = ["ArithTaskset"]
