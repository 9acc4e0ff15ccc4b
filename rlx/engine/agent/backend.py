"""Token requests from many threads handed to the engine in batches, by one worker thread.

HTTP handler threads (one per concurrent agent request) submit `TokenRequest`s and wait on a future;
the worker takes whatever is queued (after a short gathering window when the queue was empty) and
makes one `generate_tokens` call for it. Requests arriving while a batch decodes form the next batch.
This is batching at request granularity; an engine with continuous batching would take requests
between decode steps instead.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future

from rlx.engine.agent.protocol import Generated, TokenEngine, TokenRequest
from rlx.engine.rollout.config import RolloutConfig


class BatchingBackend:
    """One worker thread that calls `engine.generate_tokens` with batches of queued requests."""

    def __init__(self, engine: TokenEngine, sampling: RolloutConfig, max_batch: int = 0, gather_s: float = 0.005):
        self.engine, self.sampling = engine, sampling
        self.max_batch = max_batch or sampling.batch_size
        self.gather_s = gather_s
        self.num_batches = 0
        self.num_requests = 0
        self.largest_batch = 0
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="rlx-serve-backend", daemon=True)
        self._thread.start()

    def submit(self, request: TokenRequest) -> Future:
        future: Future = Future()
        self._queue.put((request, future))
        return future

    def generate(self, request: TokenRequest) -> Generated:
        """Block until `request` has been generated (in whatever batch it joined)."""
        return self.submit(request).result()

    def close(self) -> None:
        """Finish the batch in progress, then fail whatever is still queued (its callers get an error)."""
        self._queue.put(None)
        self._thread.join()
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[1].set_exception(RuntimeError("the server is shutting down"))

    def _take_batch(self, first) -> tuple[list, bool]:
        """`first` and what else is queued (waiting up to gather_s); whether close() was asked for."""
        batch, deadline = [first], time.monotonic() + self.gather_s
        while len(batch) < self.max_batch:
            try:
                item = self._queue.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                break
            if item is None:
                return batch, True
            batch.append(item)
        return batch, False

    def _loop(self) -> None:
        closing = False
        while not closing:
            first = self._queue.get()
            if first is None:
                return
            batch, closing = self._take_batch(first)
            self.num_batches += 1
            self.num_requests += len(batch)
            self.largest_batch = max(self.largest_batch, len(batch))
            try:
                results = self.engine.generate_tokens([request for request, _ in batch], self.sampling)
            except BaseException as e:  # handed to every waiting request; the worker keeps serving
                for _, future in batch:
                    future.set_exception(e)
                continue
            for (_, future), generated in zip(batch, results):
                future.set_result(generated)
