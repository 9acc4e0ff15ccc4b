"""Python environments: loaded by name, made once per sample, their calls run in threads with a timeout.

An environment is `NAME(record) -> env` where `record` is the prompt record as a dict and `env` has
`reset() -> list[dict]` (the opening chat messages), `step(message) -> (list[dict], float, bool)` (the
reply messages to an assistant message, this step's reward, whether the episode is over) and
optionally `tools` (OpenAI function schemas handed to the chat template). Every call's result is
checked here, and a failure names the sample and the method.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any

from rlx.observe.tracking import console
from rlx.utils.user_code import load_object


def report_dropped(reasons: list[str], num_samples: int) -> None:
    """Say (on stderr) how many samples were left out for having no model turn, and why the first was. (Not an
    error here even when that is every sample: under a launcher the other processes' samples may remain;
    generate_multi_turn decides once the records are gathered.)"""
    if reasons:
        console(f"rlx: left out {len(reasons)} of {num_samples} samples with no model turn; the first: {reasons[0]}")


class EnvError(Exception):
    """An environment call that failed: raised, timed out, or returned the wrong types (message names the sample)."""


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_part(part: Any) -> bool:
    """A content part: {"type": "text", "text": str} or {"type": "image", "image": a non-empty reference}."""
    if not isinstance(part, dict):
        return False
    if part.get("type") == "text":
        return isinstance(part.get("text"), str)
    return part.get("type") == "image" and isinstance(part.get("image"), str) and bool(part["image"])


def check_messages(value: Any, where: str, allow_empty: bool) -> list[dict]:
    """A list of chat messages, each a dict with a string `role` and a `content` that is a string or a list of text
    and image parts (a vision-language model's images: a path, URL or data: URI)."""
    if not isinstance(value, list) or (not value and not allow_empty):
        need = "a list of chat messages" if allow_empty else "a non-empty list of chat messages"
        raise EnvError(f"{where} returned {_describe(value)}, expected {need}")
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise EnvError(f"{where} returned message {i} = {_describe(message)}, expected a dict with a 'role' string")
        content = message.get("content")
        if not isinstance(content, str) and not (isinstance(content, list) and all(_is_part(p) for p in content)):
            raise EnvError(
                f"{where} returned message {i} with content {_describe(content)}, expected a string or a list of "
                f'parts {{"type": "text", "text": ...}} / {{"type": "image", "image": PATH_OR_URL}}'
            )
    return [dict(m) for m in value]


def check_step(value: Any, where: str) -> tuple[list[dict], float, bool]:
    """step()'s (messages, reward, done)."""
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        raise EnvError(f"{where} returned {_describe(value)}, expected (messages, reward, done)")
    messages, reward, done = value
    messages = check_messages(messages, where, allow_empty=True)
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise EnvError(f"{where} returned reward {_describe(reward)}, expected a finite number")
    if not isinstance(done, bool):
        raise EnvError(f"{where} returned done = {_describe(done)}, expected True or False")
    return messages, float(reward), done


def check_tools(env: Any, where: str) -> list[dict] | None:
    """The env's optional `tools`: None or a list of OpenAI function schemas (dicts)."""
    tools = getattr(env, "tools", None)
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools):
        raise EnvError(f"{where}.tools is {_describe(tools)}, expected a list of function schemas (dicts)")
    return list(tools) or None


@dataclass
class Environment:
    """One sample's environment object, checked to have the interface."""

    sample_id: str
    obj: Any
    name: str

    def where(self, method: str) -> str:
        return f"environment {self.name} for sample {self.sample_id!r}: {method}"

    def reset(self) -> tuple[list[dict], list[dict] | None]:
        """The opening messages and the tools (read after reset: an environment may set them there)."""
        messages = check_messages(self.obj.reset(), self.where("reset()"), allow_empty=False)
        return messages, check_tools(self.obj, self.where("tools"))

    def step(self, message: dict) -> tuple[list[dict], float, bool]:
        return check_step(self.obj.step(message), self.where("step()"))


class EnvironmentFactory:
    """`NAME(record)` from an environment spec, checked to give objects with reset() and step()."""

    def __init__(self, spec: str, option: str = "--env"):
        self.spec = spec
        self.factory: Callable = load_object(spec, option)

    def make(self, sample_id: str, record: dict) -> Environment:
        env = Environment(sample_id, None, self.spec)
        obj = self.factory(record)
        for method in ("reset", "step"):
            if not callable(getattr(obj, method, None)):
                raise EnvError(
                    f"{env.where(f'{self.spec}(record)')} returned {_describe(obj)}, which has no {method}() method"
                )
        env.obj = obj
        return env


@dataclass
class Outcome:
    """What one call gave: its value, or the error (one line naming the sample and method)."""

    value: Any = None
    error: str | None = None
    seconds: float = 0.0
    """How long the call ran (to its timeout, for one abandoned)."""


class _Call:
    """A call that notes when a worker thread starts it (its timeout counts from then) and which thread runs it."""

    def __init__(self, fn: Callable[[], Any], where: str):
        self.fn, self.where, self.started, self.seconds = fn, where, None, 0.0
        self.worker: threading.Thread | None = None
        self.returned = False
        """Set (under the pool's lock) once the call has returned or raised."""
        self.abandoned = False
        """Set (under the pool's lock) when the pool gave up on it and started a worker in its place."""

    def __call__(self) -> Any:
        self.worker = threading.current_thread()
        self.started = time.monotonic()
        try:
            return self.fn()
        finally:
            self.seconds = time.monotonic() - self.started


_JOIN_S = 2.0  # how long `CallPool.close` waits for its workers to end


class CallPool:
    """Runs calls concurrently in `workers` daemon threads; each must finish within `timeout_s` of starting.

    Python cannot stop a thread: a call past its timeout is abandoned (reported as an error, counted in
    `num_timeouts`) and keeps its thread until it returns, if ever; a new worker takes that thread's place, so
    hung calls never starve the others and every call is answered within about its timeout of starting. An
    abandoned call's thread ends when the call returns. The workers are daemon threads, so a hung call never
    keeps the process from exiting."""

    def __init__(self, workers: int, timeout_s: float):
        self.timeout_s = timeout_s
        self.num_timeouts = 0
        self._calls: dict[Future, _Call] = {}
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._workers: list[threading.Thread] = []
        for _ in range(workers):
            self._add_worker()

    def _add_worker(self) -> None:
        worker = threading.Thread(target=self._work, name="rlx-env", daemon=True)
        self._workers.append(worker)
        worker.start()

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            call, future = item
            if future.set_running_or_notify_cancel():
                try:
                    result, error = call(), None
                except BaseException as e:  # handed to the waiting side, which reports it
                    result, error = None, e
                retire = False
                if isinstance(call, _Call):  # (`submit` also takes plain callables, never abandoned)
                    with self._lock:
                        call.returned = True
                        retire = call.abandoned
                if error is None:
                    future.set_result(result)
                else:
                    future.set_exception(error)
                if retire:  # a worker took this thread's place when the call was abandoned
                    return
            # an idle worker holds nothing: a daemon thread that frees tensors while the interpreter finalizes
            # aborts the process ("terminate called without an active exception")
            del item, call, future

    def _abandon(self, call: _Call) -> bool:
        """Give up on a call past its timeout and start a worker in its thread's place (False: it just returned)."""
        with self._lock:
            if call.returned:
                return False
            call.abandoned = True
            if call.worker in self._workers:
                self._workers.remove(call.worker)
        self.num_timeouts += 1
        self._add_worker()
        return True

    def submit(self, call: Callable[[], Any]) -> Future:
        future: Future = Future()
        self._queue.put((call, future))
        return future

    def start(self, fn: Callable[[], Any], where: str) -> Future:
        """Queue one call (`where` names the sample and method in its error); collect it with `finished`."""
        call = _Call(fn, where)
        future = self.submit(call)
        self._calls[future] = call
        return future

    def finished(self, futures: set[Future], timeout: float | None) -> list[tuple[Future, Outcome]]:
        """Wait up to `timeout` seconds (None: until one is due) for calls of `futures`; the ones that returned,
        raised or ran past their own timeout (abandoned), with their outcomes (none when `timeout` passed first)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait_s = self._next_deadline(futures)
            if deadline is not None:
                wait_s = min(wait_s, max(deadline - time.monotonic(), 0.0))
            done, _ = wait(futures, timeout=wait_s, return_when=FIRST_COMPLETED)
            out = [(f, self._outcome(f, self._calls.pop(f))) for f in done]
            now = time.monotonic()
            for future in futures - done:
                call = self._calls[future]
                if call.started is not None and now - call.started > self.timeout_s and self._abandon(call):
                    del self._calls[future]
                    error = f"{call.where} timed out after {self.timeout_s:g} s"
                    out.append((future, Outcome(error=error, seconds=self.timeout_s)))
            if out or (deadline is not None and now >= deadline):
                return out

    def run(self, calls: list[tuple[Callable[[], Any], str]]) -> list[Outcome]:
        """Outcomes of `(fn, where)` calls in order; `where` names the sample and method in errors."""
        futures = {self.start(fn, where): i for i, (fn, where) in enumerate(calls)}
        outcomes = [Outcome() for _ in calls]
        pending = set(futures)
        while pending:
            for future, outcome in self.finished(pending, None):
                outcomes[futures[future]] = outcome
                pending.discard(future)
        return outcomes

    def _next_deadline(self, futures: set[Future]) -> float:
        """Seconds until the earliest running call times out (a short poll while some have not started)."""
        now, wait_s = time.monotonic(), self.timeout_s
        for future in futures:
            started = self._calls[future].started
            wait_s = min(wait_s, 0.05 if started is None else max(started + self.timeout_s - now, 0.0) + 1e-3)
        return wait_s

    @staticmethod
    def _outcome(future: Future, call: _Call) -> Outcome:
        try:
            return Outcome(value=future.result(), seconds=call.seconds)
        except EnvError as e:
            return Outcome(error=str(e), seconds=call.seconds)
        except Exception as e:  # the user's code: any failure is reported with the sample and method
            return Outcome(error=f"{call.where} raised {type(e).__name__}: {e}", seconds=call.seconds)

    def close(self) -> None:
        """Cancel calls not started yet and let the workers end; abandoned (timed-out) calls are not waited for."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[1].cancel()
        workers = list(self._workers)  # without the threads of abandoned calls
        for _ in workers:
            self._queue.put(None)
        # wait for the free workers to end (see `_work`); one still inside an abandoned call is left behind
        deadline = time.monotonic() + _JOIN_S
        for worker in workers:
            worker.join(max(deadline - time.monotonic(), 0.0))
