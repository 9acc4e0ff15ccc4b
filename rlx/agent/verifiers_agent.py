"""VerifiersAgent: a verifiers 0.4 environment as an rlx agent (`agent = "rlx.agent.verifiers_agent:VerifiersAgent"`
with a [rollout.agent.verifiers] table; docs/verifiers.md).

verifiers cannot be imported in rlx's venv (it needs openai<3), so one worker process per run
(verifiers_worker.py, in the venv `verifiers.python` names) loads the environment once and plays one episode per
sample: the record's task (its `verifiers.task_key` field, an index into the taskset) against the sample's own base
URL, so every request of the episode lands in that sample's trajectory. The episode's reward, as verifiers' rubric
computes it, is the sample's reward. Samples call from many threads at once; the worker runs their episodes
concurrently and answers each by its request id.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import subprocess
import threading
from concurrent.futures import Future
from pathlib import Path
from urllib.parse import unquote

from rlx.agent.agents import RunAgent
from rlx.agent.environment import EnvError
from rlx.errors import UserError
from rlx.rollout.agent_config import AgentConfig, VerifiersConfig

WORKER = Path(__file__).with_name("verifiers_worker.py")
SERVED_NAME = "rlx"
"""The model name the in-process server answers to (AgentServer's default)."""
SETUP = "make setup-test builds .venv-verifiers; docs/verifiers.md"


class VerifiersAgent(RunAgent):
    """Plays the record's verifiers task against the sample's base URL; the episode's reward is the sample's."""

    def __init__(self, cfg: AgentConfig):
        super().__init__(cfg)
        if cfg.verifiers is None:
            raise UserError("rollout.agent.verifiers: VerifiersAgent needs the table (env = the taskset id, ...)")
        self.vf: VerifiersConfig = cfg.verifiers
        self._proc = _start_worker(self.vf)
        self._stderr: collections.deque[str] = collections.deque(maxlen=40)
        self._drainer = threading.Thread(target=self._drain_stderr, name="rlx-verifiers-stderr", daemon=True)
        self._drainer.start()
        self._pending: dict[int, Future] = {}
        """Requests sent, by id, waiting for their reply."""
        self._exited = False
        """Set (under `_lock`) once the worker's stdout has closed: no reply will come."""
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.num_tasks = self._handshake()
        threading.Thread(target=self._read_replies, name="rlx-verifiers-replies", daemon=True).start()

    def __call__(self, record: dict, base_url: str) -> float:
        task = record.get(self.vf.task_key)
        if isinstance(task, bool) or not isinstance(task, int) or not 0 <= task < self.num_tasks:
            raise UserError(
                f"prompt {record.get('id')!r}: field {self.vf.task_key!r} must be the index of a task of "
                f"{self.vf.env!r} (0 to {self.num_tasks - 1}), got {task!r}"
            )
        future: Future = Future()
        with self._lock:
            if self._exited:
                raise EnvError(f"the verifiers worker has exited ({self._proc.poll()}): {self._last_error()}")
            request_id = next(self._ids)
            self._pending[request_id] = future
            try:
                self._proc.stdin.write(json.dumps({"id": request_id, "task": task, "base_url": base_url}) + "\n")
                self._proc.stdin.flush()
            except OSError as e:  # it exited since the check above
                self._pending.pop(request_id)
                raise EnvError(f"the verifiers worker has exited: {e}; {self._last_error()}") from None
        reply = future.result()
        if "error" in reply:
            sample = unquote(base_url.rpartition("/s/")[2].removesuffix("/v1"))  # AgentServer.base_url's form
            raise EnvError(f"sample {sample!r}: the verifiers episode of task {task} of {self.vf.env!r} failed: "
                           f"{reply['error']}")  # fmt: skip
        return reply["reward"]

    def close(self) -> None:
        """Close the worker's stdin (it stops its servers and exits); kill it if it does not within 30 s."""
        proc = self._proc
        if proc.poll() is None:
            try:
                proc.stdin.close()
                proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()

    def _handshake(self) -> int:
        """Send the setup line; the number of tasks once the worker is ready (a UserError with its reason if not)."""
        self._proc.stdin.write(json.dumps({"model": SERVED_NAME, "args": [self.vf.env, *self.vf.args]}) + "\n")
        self._proc.stdin.flush()
        answer: list[str] = []
        reader = threading.Thread(target=lambda: answer.append(self._proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(self.vf.start_timeout_s)
        if not answer:
            self._proc.kill()
            raise UserError(f"rollout.agent.verifiers: the worker did not start {self.vf.env!r} within "
                            f"{self.vf.start_timeout_s:g} s (start_timeout_s)")  # fmt: skip
        line = json.loads(answer[0]) if answer[0].strip() else {}
        if not line.get("ready"):
            self.close()
            why = " ".join(str(line.get("fatal") or self._last_error(wait=True)).split())  # one line
            if "No module named 'verifiers'" in why or "No module named 'pydantic_config'" in why:
                why += f" (verifiers 0.4 is not installed for {self.vf.python}: {SETUP})"
            raise UserError(f"rollout.agent.verifiers: cannot load {self.vf.env!r}: {why}")
        return int(line["num_tasks"])

    def _read_replies(self) -> None:
        """Hand each reply to its request; when the worker exits, fail the requests still waiting."""
        for line in self._proc.stdout:
            reply = json.loads(line)
            with self._lock:
                future = self._pending.pop(reply["id"], None)
            if future is not None:
                future.set_result(reply)
        with self._lock:
            waiting, self._pending, self._exited = list(self._pending.values()), {}, True
        for future in waiting:
            future.set_result({"error": f"the worker exited ({self._proc.wait()}): {self._last_error()}"})

    def _drain_stderr(self) -> None:
        for line in self._proc.stderr:
            self._stderr.append(line.rstrip())

    def _last_error(self, wait: bool = False) -> str:
        """The worker's last line on stderr (`wait`: once it has exited and every line is read)."""
        if wait:
            self._proc.wait()
            self._drainer.join(5)
        lines = [line for line in self._stderr if line.strip()]
        return lines[-1][:500] if lines else "no message"


def _start_worker(vf: VerifiersConfig) -> subprocess.Popen:
    """The worker process in verifiers' venv: its bin first on PATH (the harnesses run `uv`), PYTHONPATH only the
    configured folders (rlx's own path would shadow nothing there, but keeps rlx out of the client's imports)."""
    python = Path(vf.python)
    if not python.is_file():
        raise UserError(f"rollout.agent.verifiers.python: no such file {python} (verifiers' own venv: {SETUP})")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = f"{python.absolute().parent}{os.pathsep}{env.get('PATH', '')}"
    if vf.python_path:
        env["PYTHONPATH"] = os.pathsep.join(str(Path(p).absolute()) for p in vf.python_path)
    return subprocess.Popen(
        [str(python), str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env, bufsize=1,
    )  # fmt: skip
