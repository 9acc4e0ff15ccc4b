"""The decode step's GEMMs alone: each projection of a layer at the batch sizes a rank decodes, by cuBLAS and by
cuBLASLt, against the time to read the weight once.

    python3 bench/decode_gemm.py --shapes 0.5b,7b --batches 64,128,256 --json decode_gemm.json

The native engine's fused decode layer (rlx/rollout/native/fused.py) runs four GEMMs a layer ([q; k; v], o,
[gate; up], down) and the LM head once a step. Each is timed as the engine runs it: inside a CUDA graph, one
GEMM per layer over the shape's layer count with a separate weight per layer (so the weights do not sit in L2),
replayed --repeat times. The floor is the weight's bytes at the device's memory bandwidth (--bandwidth-tbs).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def projections(config: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of each decode GEMM of a layer, and the LM head."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    dim = config.get("head_dim", hidden // heads)
    return {
        "qkv": ((heads + 2 * kv) * dim, hidden),
        "o": (hidden, heads * dim),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
        "head": (config["vocab_size"], hidden),
    }


def time_graph(fn, repeat: int) -> float:
    """Milliseconds per replay of a CUDA graph of `fn`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up: cuBLAS picks its kernel and workspace outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeat):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat


def measure(name: str, out_in: tuple[int, int], copies: int, batch: int, backend: str, repeat: int) -> float:
    """Microseconds per GEMM of `batch` rows through one of `copies` weights, inside a graph."""
    torch.backends.cuda.preferred_blas_library(backend)
    weights = [torch.randn(out_in, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(batch, out_in[1], device="cuda", dtype=torch.bfloat16)
    outs = [None] * copies

    def fn():
        for i, w in enumerate(weights):
            outs[i] = F.linear(x, w)

    ms = time_graph(fn, repeat)
    weights.clear(), outs.clear()
    torch.cuda.empty_cache()
    return ms * 1000 / copies


def main() -> None:
    from scale import SHAPES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="0.5b,7b")
    parser.add_argument("--batches", default="64,128,256")
    parser.add_argument("--backends", default="cublas,cublaslt")
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--bandwidth-tbs", type=float, default=4.8, help="the device's memory bandwidth, TB/s")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    for shape in args.shapes.split(","):
        config = SHAPES[shape]
        for name, out_in in projections(config).items():
            copies = 1 if name == "head" else config["num_hidden_layers"]
            floor_us = out_in[0] * out_in[1] * 2 / (args.bandwidth_tbs * 1e12) * 1e6
            for batch in map(int, args.batches.split(",")):
                times = {b: measure(name, out_in, copies, batch, b, args.repeat) for b in args.backends.split(",")}
                rows.append({"shape": shape, "gemm": name, "out_in": out_in, "batch": batch, "floor_us": floor_us,
                             "us": times})  # fmt: skip
                cells = ", ".join(f"{b} {t:.1f} us ({floor_us / t:.0%})" for b, t in times.items())
                print(f"{shape} {name:>7} {out_in} x {batch:>3}: floor {floor_us:.1f} us; {cells}", flush=True)
    torch.backends.cuda.preferred_blas_library("cublas")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
