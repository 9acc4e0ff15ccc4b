"""Token requests from many threads fed into one engine stream, by one worker thread (continuous batching).

HTTP handler threads (one per concurrent agent request) submit `TokenRequest`s and wait on a future. The
worker owns the engine's stream (`RolloutEngine.open_stream`): between engine steps it moves whatever was
queued into the stream, so a request that arrives while others decode joins them at the engine's next step
(the native engine's next prefill, vLLM's next step; the hf engine decodes a batch to its end, so a request
arriving meanwhile joins the next batch). When the stream is idle the worker waits for a request, then
`gather_s` more for others to join it.

A request submitted with `on_tokens` hears its tokens as they are sampled: after each engine step the worker hands
it what it sampled so far (every token, with its logprob and, where asked, the alternatives: a Generated whose
finish_reason is '') whenever there are more (engines whose stream reads tokens back step by step: native, vllm;
the hf engine decodes a batch to its end, so its requests hear nothing before they finish).

`score_prompt` queues the scoring of a request's prompt tokens (the logprobs a reply lists for vLLM's prompt_logprobs
and for echo with logprobs): the worker runs it on the stream's model as it takes requests, between engine steps.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from rlx.rollout.base import RolloutEngine, TokenStream
from rlx.rollout.config import SamplingParams
from rlx.rollout.requests import Generated, TokenRequest
from rlx.serve.api import out_of_vocabulary

_POLL_S = 0.01
"""How often an idle worker looks again where it may not block (lockstep engines, closing)."""
_IDLE_S = 0.1
"""How long an idle worker waits for a request before checking whether the server is closing."""


class StreamWorker:
    """One worker thread that drives an engine stream with the requests handed to `submit`."""

    def __init__(
        self, engine: RolloutEngine, sampling: SamplingParams, max_context: int, num_seqs: int = 64,
        gather_s: float = 0.005,
    ):  # fmt: skip
        self.engine, self.sampling = engine, sampling
        self.max_context, self.num_seqs, self.gather_s = max_context, num_seqs, gather_s
        self.num_steps = 0
        self.num_requests = 0
        self.largest_batch = 0
        """Most requests in the stream at once."""
        self._queue: queue.Queue = queue.Queue()
        self._closing = threading.Event()
        self._opened = threading.Event()
        self._failure: BaseException | None = None
        self.failed: EngineFailed | None = None
        """Why the engine's stream stopped (its cause: the engine's error); every later request gets it, else None."""
        self.vocab_size = _vocab_size(engine)
        """Token ids at or past it are refused per request before they reach the engine (0: unknown)."""
        self._listeners: dict[Future, tuple[Callable[[Generated], None], list[int]]] = {}
        """Requests that hear their tokens as they come: the callback and how many it has heard (worker only)."""
        self._thread = threading.Thread(target=self._run, name="rlx-serve-worker", daemon=True)
        self._thread.start()
        self._opened.wait()
        if self._failure is not None:
            raise self._failure

    def submit(self, request: TokenRequest, on_tokens: Callable[[Generated], None] | None = None) -> Future:
        """Queue `request`; its future gives the Generated. `on_tokens(sampled)`, called on the worker thread (it must
        be quick), gets what was sampled so far (tokens, logprobs, alternatives) each time there are more tokens,
        before the future is set."""
        return self._put(request, on_tokens)

    def score_prompt(self, request: TokenRequest, num_top: int) -> Future:
        """Queue the scoring of `request`'s prompt tokens (TokenStream.prompt_logprobs, with the `num_top` most likely
        tokens at each position); its future gives the PromptLogprobs. It runs on the worker thread between engine
        steps, as requests are taken into the stream (the model is never run from two threads), and is not counted
        as a generated request."""
        return self._put(_Scoring(request, num_top), None)

    def _put(self, item: TokenRequest | _Scoring, on_tokens) -> Future:
        future: Future = Future()
        if self.failed is not None:  # a fresh exception a request: one raised in many threads grows its traceback
            future.set_exception(EngineFailed(str(self.failed)))
        elif self._closing.is_set():
            future.set_exception(EngineFailed("the server is shutting down"))
        else:
            self._queue.put((item, future, on_tokens))
        return future

    @property
    def is_alive(self) -> bool:
        """Whether the worker still takes requests (not failed, not closing)."""
        return self.failed is None and not self._closing.is_set() and self._thread.is_alive()

    def generate(self, request: TokenRequest) -> Generated:
        """Block until `request` has been generated."""
        return self.submit(request).result()

    def close(self) -> None:
        """Finish the requests in the stream, then fail whatever is still queued (its callers get an error)."""
        self._closing.set()
        self._thread.join()
        self._fail_queued(EngineFailed("the server is shutting down"))

    def _fail_queued(self, error: BaseException) -> None:
        while True:
            try:
                _, future, _ = self._queue.get_nowait()
            except queue.Empty:
                return
            future.set_exception(error)

    def _run(self) -> None:
        try:
            stream = self.engine.open_stream(self.sampling, self.max_context, self.num_seqs)
        except BaseException as e:  # reported to the constructor's caller
            self._failure = e
            self._opened.set()
            return
        self._opened.set()
        in_flight: set[Future] = set()
        try:
            while stream.keep_going(bool(in_flight) or not self._closing.is_set()):
                self._take(stream, in_flight)
                if not stream.has_work and not stream.lockstep:
                    continue
                finished = stream.step()
                self.num_steps += 1
                self._tell(stream)
                for future, generated in finished:
                    in_flight.discard(future)
                    self._listeners.pop(future, None)
                    future.set_result(generated)
        except BaseException as e:  # the engine failed: every waiting request hears it; nothing more is served
            print(f"rlx serve: the engine failed; every later request is refused (HTTP 503):\n"
                  f"{''.join(traceback.format_exception(e))}", file=sys.stderr, flush=True)  # fmt: skip
            self.failed = EngineFailed(f"the engine failed ({type(e).__name__}: {e}"[:300] + "); restart the server")
            self.failed.__cause__ = e
            self._closing.set()
            for future in in_flight:
                future.set_exception(self.failed)
            self._fail_queued(self.failed)
        finally:
            stream.close()

    def _check_ids(self, request: TokenRequest) -> None:
        """A token id outside the vocabulary fails this request here: inside the engine it would fail the stream."""
        i = out_of_vocabulary(request.prompt_ids, self.vocab_size)
        if i is not None:
            raise ValueError(f"token request {request.key!r}: token id {request.prompt_ids[i]} is outside the "
                             f"vocabulary [0, {self.vocab_size})")  # fmt: skip

    def _tell(self, stream: TokenStream) -> None:
        """Hand each listening request its tokens so far, where it has more than it heard."""
        if not self._listeners:
            return
        for future, sampled in stream.partial(self._listeners.keys()).items():
            listener = self._listeners.get(future)
            if listener is not None and len(sampled.response_ids) > listener[1][0]:
                listener[1][0] = len(sampled.response_ids)
                listener[0](sampled)

    def _take(self, stream: TokenStream, in_flight: set[Future]) -> None:
        """Move queued requests into the stream: without waiting while it works, else wait for one (a short poll
        where the engine steps in lockstep or the server is closing) and `gather_s` more for others."""
        idle = not stream.has_work
        timeout = _POLL_S if (stream.lockstep or self._closing.is_set()) else _IDLE_S
        first = True
        while True:
            try:
                if first and idle:
                    item = self._queue.get(timeout=timeout)
                    deadline = time.monotonic() + self.gather_s
                elif idle:
                    item = self._queue.get(timeout=max(deadline - time.monotonic(), 0.0))
                else:
                    item = self._queue.get_nowait()
            except queue.Empty:
                return
            first = False
            request, future, on_tokens = item
            if isinstance(request, _Scoring):
                _score(stream, request, future, self._check_ids)
                continue
            try:
                self._check_ids(request)
                stream.submit(future, request)
            except Exception as e:  # this request cannot run (e.g. too long for the cache): its caller hears why
                future.set_exception(e)
                continue
            in_flight.add(future)
            if on_tokens is not None:
                self._listeners[future] = (on_tokens, [0])
            self.num_requests += 1
            self.largest_batch = max(self.largest_batch, len(in_flight))


@dataclass(frozen=True)
class _Scoring:
    """A queued StreamWorker.score_prompt: the request whose prompt to score, and how many alternatives per token."""

    request: TokenRequest
    num_top: int


def _score(stream: TokenStream, job: _Scoring, future: Future, check_ids: Callable[[TokenRequest], None]) -> None:
    """Run `job` on the stream's model and settle `future` with the PromptLogprobs (or why it could not: the failure
    is this request's, the stream goes on)."""
    try:
        check_ids(job.request)
        future.set_result(stream.prompt_logprobs(job.request, job.num_top))
    except Exception as e:  # noqa: BLE001 - handed to the request that asked
        future.set_exception(e)


class EngineFailed(RuntimeError):
    """The stream no longer generates: the engine failed, or the server is closing (HTTP 503)."""


def _vocab_size(engine: RolloutEngine) -> int:
    """The engine model's vocabulary size (0 where the engine does not say)."""
    config = getattr(getattr(engine, "model", None), "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(getattr(text, "vocab_size", 0) or 0)
