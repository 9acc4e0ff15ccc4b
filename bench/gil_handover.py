"""What a writer thread's JSON encoding costs a host-paced loop beside it (CPU only; rlx/ppo/writer.py).

The loop stands for the native engine's decode loop: each iteration does `--busy-us` of Python, then waits
`--wait-us` with the interpreter released (as a device wait does). Beside it a thread writes a step's rollouts.jsonl
(`--records` records of 128 + 256 tokens) twice: encoded record after record as before, and through
`write_jsonl_shared`, which hands the interpreter over after each record. Prints the loop's time alone and beside
each writer (median of `--repeat` rounds).

    python bench/gil_handover.py --records 768 --repeat 5
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlx.formats.records import RolloutRecord  # noqa: E402
from rlx.ppo.writer import write_jsonl_shared  # noqa: E402
from rlx.utils.io import dumps_line  # noqa: E402


def records(count: int) -> list[RolloutRecord]:
    rng = random.Random(0)
    return [
        RolloutRecord(id=f"p{i}/0", prompt_id=f"p{i}", sample_index=0, prompt="x" * 300, response="y" * 600,
                      prompt_ids=[rng.randrange(150000) for _ in range(128)],
                      response_ids=[rng.randrange(150000) for _ in range(256)],
                      rollout_logprobs=[-5 * rng.random() for _ in range(256)], finish_reason="length",
                      temperature=1.0)
        for i in range(count)
    ]  # fmt: skip


def without_handover(path: Path, rows: list) -> None:
    """The writer before the hand-over: every record encoded back to back."""
    with open(path, "w", encoding="utf-8") as f:
        for record in rows:
            f.write(dumps_line(record.to_json()) + "\n")


def loop(iterations: int, busy_us: float, wait_us: float) -> float:
    start = time.perf_counter()
    for _ in range(iterations):
        end = time.perf_counter() + busy_us / 1e6
        while time.perf_counter() < end:
            pass
        time.sleep(wait_us / 1e6)
    return time.perf_counter() - start


def beside(write, args) -> float:
    thread = threading.Thread(target=write)
    thread.start()
    seconds = loop(args.iterations, args.busy_us, args.wait_us)
    thread.join()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=768)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--busy-us", type=float, default=600.0)
    parser.add_argument("--wait-us", type=float, default=600.0)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    rows, folder = records(args.records), Path(tempfile.mkdtemp())
    times = {"alone": [], "beside the old writer": [], "beside write_jsonl_shared": []}
    for _ in range(args.repeat):
        times["alone"].append(loop(args.iterations, args.busy_us, args.wait_us))
        times["beside the old writer"].append(beside(lambda: without_handover(folder / "a.jsonl", rows), args))
        shared = lambda: write_jsonl_shared(folder / "b.jsonl", rows, 0, 1, folder / "parts")  # noqa: E731
        times["beside write_jsonl_shared"].append(beside(shared, args))
    alone = statistics.median(times["alone"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"loop {name:<28} {median * 1e3:7.1f} ms  (+{median / alone - 1:.0%})")


if __name__ == "__main__":
    main()
