"""The run's file writes in the background: a step's artifacts and checkpoint files are written by one thread, in
order, while the next step computes. What must involve every process (gathering sharded weights) happens before a
write is handed over; a kill during a write leaves only a temporary folder, and `--resume` continues from the last
complete checkpoint."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from rlx.parallel.dist import shard_range
from rlx.utils.io import atomic_path, dumps_line
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


def write_jsonl_shared(path: Path, records: list, rank: int, world: int, parts: Path, wait_s: float = 600.0) -> None:
    """Write `records` (each with `to_json`, the same list on every rank) to `path` as JSONL, every rank of `world`
    encoding its contiguous share: ranks > 0 leave theirs in the folder `parts` (one file each, renamed into place
    when whole), rank 0 writes its own and appends the others' in rank order, then publishes `path` atomically.
    A rank's writes run on its own writer thread, so rank 0 no longer encodes the whole world's samples on its own
    (1,024 rollouts take it 0.2-0.4 s of the interpreter, which the rollout's host loop then waits for). Rank 0
    waits up to `wait_s` for a share; a share that does not come is an error naming it.

    The encoding hands the interpreter to the other threads after each record: JSON holds it while it encodes, and
    the step's own thread, back from waiting for the device, would otherwise wait for it up to the 5 ms switch
    interval each time. On two CPU cores a loop of 1.3 ms iterations (0.6 ms of Python, 0.6 ms of waiting) beside
    768 records being written took 50-75% longer than alone; with the hand-over 22-24%."""
    share = [records[i] for i in shard_range(len(records), rank, world)]
    target = path if rank == 0 else parts / f"{path.name}.{rank:05d}"
    if rank > 0:
        parts.mkdir(parents=True, exist_ok=True)
    with atomic_path(target) as tmp, open(tmp, "wb") as f:
        for record in share:
            f.write((dumps_line(record.to_json()) + "\n").encode())
            time.sleep(0)  # the hand-over
        for r in range(1, world) if rank == 0 else ():
            part = _wait_for(parts / f"{path.name}.{r:05d}", wait_s)
            with open(part, "rb") as source:
                shutil.copyfileobj(source, f)
            part.unlink()


def _wait_for(path: Path, wait_s: float) -> Path:
    deadline = time.monotonic() + wait_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{path}: another rank's share of the step's records did not appear in {wait_s:.0f} s (every rank "
                "writes its share into the run folder: on several nodes it must be on storage they all share)"
            )
        time.sleep(0.01)
    return path
