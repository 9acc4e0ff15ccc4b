"""How much a background thread that prepares checkpoint host buffers slows the GPU work of the main thread.

At 7B on four H100s, steps 2-4 of `rlx ppo` ran 2.5x slower while each rank pinned its 22.8 GB of checkpoint buffers
on the writer thread (bench/RESULTS.md, Scale, twelfth session). This tells apart the candidate causes, each mode in a
process of its own (the pinned allocator's settings are process-wide):

  none       the main loop alone (the baseline)
  register   torch.empty(pin_memory=True) pieces with rlx's allocator settings (pages registered by 8 threads: what
             rlx does today, rlx.utils.allocator.PINNED_REGISTER)
  hostalloc  the same with torch's default pinned allocator (one cudaHostAlloc per piece)
  pageable   plain host tensors, every page touched (no CUDA call: page faults and zeroing only)

The main thread replays a CUDA graph of small matmuls (a decode step's shape) and runs eager matmuls (a train
step's launches), timing each iteration, while the background thread prepares --gib of buffers in --piece-mib pieces.
Prints, per mode: the main loop's median and p90 iteration during the background work against `none`, and the
background's GB/s.

    python3 bench/device/pin_contention.py --gib 20 --json $OUT/pin.json     # on a GPU machine (about a minute)
    python3 bench/device/pin_contention.py --cpu --gib 0.05                  # a check of the script
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

MODES = ("none", "register", "hostalloc", "pageable")
PINNED_REGISTER = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"


def prepare(mode: str, gib: float, piece_mib: int, kept: list) -> float:
    """Allocate `gib` of host buffers the way `mode` says, keeping them in `kept`; the seconds it took."""
    import torch

    start = time.perf_counter()
    pieces = max(1, int(gib * 1024 / piece_mib))
    for _ in range(pieces if mode != "none" else 0):
        numel = piece_mib << 18  # float32
        if mode == "pageable":
            kept.append(torch.empty(numel).fill_(0))
        else:
            kept.append(torch.empty(numel, pin_memory=True))
    return time.perf_counter() - start


def main_loop(device, seconds: float, stop: threading.Event) -> list[float]:
    """Iteration times (s) of a decode-like graph replay plus eager matmuls, until `stop` (or `seconds`)."""
    import torch

    hidden = 896 if device.type == "cuda" else 64  # a 0.5B decoder's width on a GPU; small on the CPU check
    x = torch.randn(64, hidden, device=device)
    weights = [torch.randn(hidden, hidden, device=device) / hidden**0.5 for _ in range(48)]

    def decode_like():
        y = x
        for w in weights:
            y = torch.tanh(y @ w)
        return y

    graph = None
    if device.type == "cuda":
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            decode_like()  # warm-up before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            decode_like()
    side = 2048 if device.type == "cuda" else 128
    big = torch.randn(side, side, device=device)
    times, end = [], time.perf_counter() + seconds
    while not stop.is_set() and time.perf_counter() < end:
        start = time.perf_counter()
        for _ in range(8):
            graph.replay() if graph is not None else decode_like()
        for _ in range(8):
            big = torch.tanh(big @ big) * 0.01
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def run_mode(mode: str, args) -> dict:
    """One mode in this process: the main loop during the background preparation."""
    import torch

    device = torch.device("cpu" if args.cpu else "cuda")
    main_loop(device, 2.0 if device.type == "cuda" else 0.2, threading.Event())  # warm-up: kernels, graph, clocks
    kept: list = []
    result: dict = {}
    stop = threading.Event()

    def background():
        time.sleep(0.5)  # the main loop's own pace first
        result["prepare_s"] = prepare(mode, args.gib, args.piece_mib, kept)
        time.sleep(0.5 if mode != "none" else args.none_s)
        stop.set()

    thread = threading.Thread(target=background)
    thread.start()
    times = main_loop(device, args.limit_s, stop)
    thread.join()
    during = sorted(times[5:-5] or times)
    prepared = sum(t.numel() * t.element_size() for t in kept) / 1e9
    return {
        "mode": mode,
        "iterations": len(times),
        "median_ms": 1e3 * statistics.median(during),
        "p90_ms": 1e3 * during[int(0.9 * (len(during) - 1))],
        "prepare_s": result.get("prepare_s", 0.0),
        "prepared_gb": prepared,
        "gb_per_s": prepared / result["prepare_s"] if result.get("prepare_s") else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated of {', '.join(MODES)}")
    parser.add_argument("--gib", type=float, default=20.0, help="host buffers each mode prepares")
    parser.add_argument("--piece-mib", type=int, default=512, help="size of each buffer")
    parser.add_argument("--none-s", type=float, default=5.0, help="how long the baseline's main loop runs")
    parser.add_argument("--limit-s", type=float, default=90.0, help="longest a mode's main loop runs")
    parser.add_argument("--cpu", action="store_true", help="CPU matmuls, no pinning (a check of the script)")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a mode's own process
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_mode(args.one, args)))
        return
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    if args.cpu:
        modes = [m for m in modes if m in ("none", "pageable")]
    rows = []
    for mode in modes:
        env = dict(os.environ)
        env.pop("PYTORCH_ALLOC_CONF", None)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if mode == "register":
            env["PYTORCH_CUDA_ALLOC_CONF"] = PINNED_REGISTER
        forwarded = [a for a in sys.argv[1:] if not a.startswith("--json") and a != str(args.json)]
        done = subprocess.run([sys.executable, __file__, *forwarded, "--one", mode], capture_output=True, text=True,
                              env=env)  # fmt: skip
        if done.returncode:
            rows.append({"mode": mode, "error": done.stderr.strip()[-2000:]})
        else:
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    base = next((r["median_ms"] for r in rows if r["mode"] == "none" and "median_ms" in r), None)
    print(f"\n{'mode':10} {'median ms':>10} {'p90 ms':>8} {'x none':>7} {'prepare s':>10} {'GB/s':>6}")
    for r in rows:
        if "error" in r:
            print(f"{r['mode']:10} failed: {r['error'].splitlines()[-1] if r['error'] else ''}")
            continue
        ratio = f"{r['median_ms'] / base:.2f}" if base else "-"
        rate = f"{r['gb_per_s']:.1f}" if r["gb_per_s"] else "-"
        print(f"{r['mode']:10} {r['median_ms']:10.2f} {r['p90_ms']:8.2f} {ratio:>7} {r['prepare_s']:10.2f} {rate:>6}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
