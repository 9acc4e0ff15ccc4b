"""The run's file writes in the background: a step's artifacts and checkpoint files are written by one thread, in
order, while the next step computes. What must involve every process (gathering sharded weights) happens before a
write is handed over; a kill during a write leaves only a temporary folder, and `--resume` continues from the last
complete checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from rlx.utils.tensor_files import Pace, paced


class BackgroundWriter:
    """Runs submitted writes one after another on a worker thread; `flush` waits for them and raises the first
    error one of them met.

    The thread writes safetensors files at `mib_per_s` (0: as fast as the disk takes them) while nobody waits: on an
    H100 a 6 GB checkpoint written flat out made the next step 1 s slower, paced at 1 GiB/s it cost nothing
    (bench/results/archive.md). `flush` lifts the pace, so waiting for a write never takes longer than writing it."""

    def __init__(self, enabled: bool = True, mib_per_s: float = 0.0):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlx-writer") if enabled else None
        self._pending: list[Future] = []
        self._pace = Pace(mib_per_s * 2**20)

    def submit(self, write: Callable[[], None]) -> None:
        """Run `write()` after every write submitted before it (at once when background writing is off)."""
        if self._pool is None:
            write()
            return
        self._pending.append(self._pool.submit(self._paced, write))

    def _paced(self, write: Callable[[], None]) -> None:
        with paced(self._pace):
            write()

    def flush(self) -> None:
        """Wait until every submitted write is done (the rest written at full speed); re-raise the first failure."""
        pending, self._pending = self._pending, []
        error = None
        self._pace.hurry.set()
        try:
            for future in pending:
                try:
                    future.result()
                except BaseException as e:  # noqa: BLE001 - kept and raised below, after every write has ended
                    error = error or e
        finally:
            self._pace.hurry.clear()
        if error is not None:
            raise error

    def close(self) -> None:
        """Flush, then stop the thread."""
        try:
            self.flush()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
