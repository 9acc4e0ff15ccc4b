"""Exact mode's Triton matmul: which tiles give the same bits as the ones in use, and how fast each is against cuBLAS.

    python bench/exact_matmul.py --json out.json            # CUDA only: the 0.5B and 7B shapes' weights
    python bench/exact_matmul.py --shapes 0.5b --rows 64,256

For every weight shape of the model (the attention projections and their q/k/v stack, the MLP's and its gate/up
stack, the LM head) and every row count in
--rows (a decode step's few hundred rows, a train micro-batch's thousands), each candidate tile set
(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) runs the same bfloat16 inputs as the tiles `matmul_plan` picks for them.
"same bits" says whether its output equals theirs bit for bit: exact mode may choose tiles by the number of rows only
among tiles that do (on an H100 every candidate has, BLOCK_K 32 and 128 included: the kernel's accumulator goes
through the MMA 16 columns at a time in order, whatever the tile). Times are device times: --reps calls captured in
one CUDA graph, the median of 5 replays divided by --reps (a decode step replays its matmuls from a graph; timing
single calls measured the host's launch, about 30 us, not the kernel). With --cold the calls cycle through enough
copies of the weight to fill twice the L2, so each reads its weight from memory (a decode step's case: in the plain
timing 20 calls of one weight find it in the L2). A weight whose K `split_k` cuts into chunks is also timed unsplit
("unsplit": K in one piece, other bits). "float32 input" times the tiles in use on
the same values held in float32, rounded inside the kernel's loads (what a linear after a float32 activation pays).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlx.kernels.exact_triton import exact_matmul, matmul_plan, split_k  # noqa: E402


def _with_stacks(shapes: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """The weights' (outputs N, inputs K), plus the stacks exact mode runs as one matmul (q/k/v, gate/up)."""
    (q, k), kv, gate = shapes["q/o"], shapes["k/v"][0], shapes["gate/up"][0]
    return {**shapes, "qkv stack": (q + 2 * kv, k), "gate+up stack": (2 * gate, k)}


SHAPES = {  # (outputs N, inputs K) of each distinct weight
    "0.5b": _with_stacks({
        "q/o": (896, 896), "k/v": (128, 896), "gate/up": (4864, 896), "down": (896, 4864), "lm_head": (151936, 896),
    }),
    "7b": _with_stacks({"q/o": (3584, 3584), "k/v": (512, 3584), "gate/up": (18944, 3584), "down": (3584, 18944)}),
}  # fmt: skip
CANDIDATES = [
    (16, 64, 64, 4, 4), (32, 64, 64, 4, 4), (32, 128, 64, 4, 4), (64, 32, 64, 4, 4), (64, 64, 64, 4, 4),
    (64, 128, 64, 4, 4), (64, 128, 64, 4, 3), (64, 256, 64, 8, 3), (128, 64, 64, 4, 4), (128, 128, 64, 8, 3),
    (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3),
    (128, 128, 32, 8, 4), (128, 128, 128, 8, 3), (64, 64, 128, 4, 3),
    (16, 32, 64, 4, 4), (32, 32, 64, 4, 4), (16, 64, 64, 2, 4), (16, 32, 128, 2, 3), (32, 64, 128, 4, 3),
    (16, 128, 64, 4, 4), (64, 32, 128, 4, 3), (16, 64, 128, 4, 3),
    (64, 128, 128, 4, 3), (128, 64, 128, 4, 3), (32, 128, 128, 4, 3), (64, 64, 64, 4, 5), (128, 128, 64, 4, 3),
    (64, 256, 64, 4, 3), (128, 32, 128, 4, 3), (256, 64, 64, 8, 3),
]  # fmt: skip


def timed(fn, reps: int) -> float:
    """Device milliseconds a call: `reps` calls captured in one CUDA graph, the median of 5 replays divided by reps
    (a decode step replays its matmuls from a graph: timing single launches measures the host's launch instead)."""
    fn(), fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return statistics.median(times)


def weight_copies(weight: torch.Tensor, cold: bool) -> int:
    """How many copies of `weight` the timed calls cycle through: 1, or with `cold` enough to fill twice the device's
    L2 cache, so each call reads its weight from memory as a decode step does (one layer's weights after another's;
    20 calls of one weight otherwise find it in the L2: 50 MB on an H200, a 0.5B layer's matmuls 2-17 MB)."""
    if not cold:
        return 1
    return max(1, math.ceil(2 * l2_bytes(weight.device) / (weight.numel() * weight.element_size())))


def l2_bytes(device: torch.device) -> int:
    """The device's L2 cache (50 MB on an H200)."""
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)


def run_shape(name: str, n: int, k: int, m: int, reps: int, cold: bool = False) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    reference = exact_matmul(x, weight)
    copies = weight_copies(weight, cold)
    cycle = itertools.cycle([weight] + [weight.clone() for _ in range(copies - 1)])  # each call: the next copy
    cublas_ms = timed(lambda: F.linear(x, next(cycle)), reps)
    now, _, grid = matmul_plan(n, k, m)
    row = {"weight": name, "n": n, "k": k, "rows": m, "cublas_ms": cublas_ms, "tiles_now": list(now), "copies": copies}
    row["now_ms"] = timed(lambda: exact_matmul(x, next(cycle)), reps)
    row["split"] = split_k(k)
    if row["split"] > 1:  # what the chunks are worth: K walked in one piece (other bits)
        row["unsplit_ms"] = timed(lambda: exact_matmul(x, next(cycle), split=1), reps)
    wide = x.float()  # a float32 input rounded inside the kernel's loads (the bits of x: x is bfloat16 already)
    row["now_float32_input_ms"] = timed(lambda: exact_matmul(wide, next(cycle)), reps)
    results = []
    for tiles in CANDIDATES:
        try:
            got = exact_matmul(x, weight, tiles=tiles)
            ms = timed(lambda: exact_matmul(x, next(cycle), tiles=tiles), reps)  # noqa: B023
        except Exception as e:  # a tile set the compiler refuses (shared memory): say so, go on
            results.append({"tiles": list(tiles), "error": f"{type(e).__name__}: {str(e)[:120]}"})
            continue
        results.append({"tiles": list(tiles), "ms": ms, "same_bits": bool(torch.equal(got, reference))})
    row["candidates"] = results
    same = [r for r in results if r.get("same_bits")]
    best = min(same, key=lambda r: r["ms"]) if same else None
    row["best_same_bits"] = best
    ways = "separate programs" if grid else "walked"
    chunks = f"K in {row['split']} chunks, {ways} (unsplit {row['unsplit_ms']:.4f}) " if row["split"] > 1 else ""
    best_text = f"best same-bits {best['ms']:.4f} ms {tuple(best['tiles'])}" if best else "no same-bits candidate"
    print(
        f"{name:8s} N={n:6d} K={k:5d} M={m:6d}{f' ({copies} copies)' if copies > 1 else ''}: "
        f"cuBLAS {cublas_ms:.4f} ms, now {row['now_ms']:.4f} ms {now} {chunks}"
        f"(float32 input {row['now_float32_input_ms']:.4f}), {best_text}",
        flush=True,
    )
    differ = [tuple(r["tiles"]) for r in results if r.get("same_bits") is False]
    if differ:
        print(f"    different bits: {differ}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="0.5b,7b")
    parser.add_argument("--rows", default="1,64,256,4096,16384")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument(
        "--cold", action="store_true", help="cycle through copies of each weight filling twice the L2 (weights read "
        "from memory, as in a decode step; without it 20 calls of one weight find it in the L2)"
    )  # fmt: skip
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/exact_matmul.py needs CUDA (the Triton kernels)")
    rows = [int(r) for r in args.rows.split(",")]
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": []}
    for shape in args.shapes.split(","):
        for name, (n, k) in SHAPES[shape].items():
            for m in rows:
                report["results"].append(run_shape(f"{shape}:{name}", n, k, m, args.reps, args.cold))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
