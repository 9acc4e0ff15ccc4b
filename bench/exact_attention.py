"""Exact mode's Triton attention: how fast each (key block, warps, stages) is, and whether each stays invariant.

    python bench/exact_attention.py                  # CUDA only: the 0.5B and 7B shapes, decode and train sizes
    python bench/exact_attention.py --shapes 0.5b --json out.json

Two workloads a shape: a decode step (--batch sequences of the engine's paged cache, one query token each, their
contexts spread over --context; the kernel exact mode runs 24-28 times a decode step) and a train micro-batch
(--tokens packed query tokens in samples of --sample tokens, contiguous keys: the trainer's forward). Each candidate
runs both; "invariant" says whether its decode outputs equal its own packed outputs for the same tokens bit for bit
(what exact mode needs of any configuration: a token's bits must not depend on the layout). "as now" says whether it
also gives the bits of the configuration in use: a key block other than rlx.kernels.exact.KEY_BLOCK sums each
query's keys in another order, so it could be used only by changing KEY_BLOCK on both sides (engine and trainer),
which the CPU's reference scheme follows. Times are device times (bench/exact_matmul.py's `timed`: calls captured
in one CUDA graph).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from exact_matmul import l2_bytes, timed  # noqa: E402

from rlx.kernels.exact import KEY_BLOCK  # noqa: E402
from rlx.kernels.exact_triton import _ATTENTION_STAGES, _ATTENTION_WARPS, exact_attention  # noqa: E402

DEVICE = "cuda"
SHAPES = {"0.5b": (14, 2, 64), "7b": (28, 4, 128)}  # query heads, kv heads, head dim
CANDIDATES = [
    (KEY_BLOCK, _ATTENTION_WARPS, _ATTENTION_STAGES),
    (32, 2, 3), (32, 1, 3), (32, 4, 2), (32, 4, 4), (32, 8, 3),
    (16, 4, 3), (16, 2, 3), (64, 4, 3), (64, 2, 3), (64, 8, 3), (64, 4, 2), (128, 4, 3), (128, 8, 3),
]  # fmt: skip


def workload(heads: int, kv_heads: int, dim: int, batch: int, context: tuple[int, int], block: int) -> dict:
    """A decode step's queries over a paged cache and the same tokens' queries over contiguous keys."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    lengths = torch.linspace(context[0], context[1], batch, device=DEVICE).round().long()
    longest = int(lengths.max())
    per_seq = -(-longest // block)
    keys = torch.randn(batch, longest, kv_heads, dim, device=DEVICE, generator=gen).to(torch.bfloat16)
    values = torch.randn(batch, longest, kv_heads, dim, device=DEVICE, generator=gen).to(torch.bfloat16)
    q = torch.randn(batch, heads, dim, device=DEVICE, generator=gen).to(torch.bfloat16)
    # the paged cache: each sequence's blocks scattered over the store (block ids a random permutation)
    order = torch.randperm(batch * per_seq, device=DEVICE, generator=gen)
    tables = order.view(batch, per_seq).int()
    k_cache = torch.zeros(batch * per_seq, block, kv_heads, dim, device=DEVICE, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    padded = torch.zeros(batch, per_seq * block, kv_heads, dim, device=DEVICE, dtype=torch.bfloat16)
    padded[:, :longest] = keys
    k_cache[tables.long().flatten()] = padded.view(-1, block, kv_heads, dim)
    padded[:, :longest] = values
    v_cache[tables.long().flatten()] = padded.view(-1, block, kv_heads, dim)
    # contiguous: each sequence's keys as packed rows, the query at its last position
    k_rows, v_rows = keys.reshape(-1, kv_heads, dim), values.reshape(-1, kv_heads, dim)
    starts = torch.arange(batch, device=DEVICE) * longest
    return {
        "q": q, "lengths": lengths, "k_cache": k_cache, "v_cache": v_cache, "tables": tables,
        "rows": torch.arange(batch, device=DEVICE), "k_rows": k_rows, "v_rows": v_rows, "starts": starts,
    }  # fmt: skip


def packed(heads: int, kv_heads: int, dim: int, tokens: int, sample: int) -> dict:
    """A train micro-batch: `tokens` packed query tokens in samples of `sample`, each attending to its prefix."""
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    count = tokens // sample * sample
    position = torch.arange(count, device=DEVICE) % sample
    return {
        "q": torch.randn(count, heads, dim, device=DEVICE, generator=gen).to(torch.bfloat16),
        "k": torch.randn(count, kv_heads, dim, device=DEVICE, generator=gen).to(torch.bfloat16),
        "v": torch.randn(count, kv_heads, dim, device=DEVICE, generator=gen).to(torch.bfloat16),
        "lengths": position + 1, "starts": torch.arange(count, device=DEVICE) - position,
    }  # fmt: skip


def run_shape(name: str, args) -> list[dict]:
    heads, kv_heads, dim = SHAPES[name]
    scale = dim**-0.5
    w = workload(heads, kv_heads, dim, args.batch, args.context, args.block_size)
    p = packed(heads, kv_heads, dim, args.tokens, args.sample)

    def decode(config):
        return exact_attention(
            w["q"], w["k_cache"], w["v_cache"], w["lengths"], scale, rows=w["rows"], block_tables=w["tables"],
            config=config,
        )  # fmt: skip

    def contiguous(config):
        return exact_attention(w["q"], w["k_rows"], w["v_rows"], w["lengths"], scale, starts=w["starts"], config=config)

    def train(config):
        return exact_attention(p["q"], p["k"], p["v"], p["lengths"], scale, starts=p["starts"], config=config)

    reference = decode(None)
    if args.cold:  # the timed decode calls cycle through copies of the cache (each layer's own, as in a step)
        cache_bytes = 2 * w["k_cache"].numel() * w["k_cache"].element_size()
        copies = max(1, math.ceil(2 * l2_bytes(w["q"].device) / cache_bytes))
        caches = itertools.cycle([(w["k_cache"], w["v_cache"])] + [
            (w["k_cache"].clone(), w["v_cache"].clone()) for _ in range(copies - 1)
        ])  # fmt: skip

        def timed_decode(config):
            k_cache, v_cache = next(caches)
            return exact_attention(
                w["q"], k_cache, v_cache, w["lengths"], scale, rows=w["rows"], block_tables=w["tables"], config=config
            )
    else:
        timed_decode = decode
    rows = []
    for config in CANDIDATES:
        row = {"shape": name, "config": list(config)}
        try:
            got = decode(config)
            row["invariant"] = bool(torch.equal(got, contiguous(config)))
            row["as_now"] = bool(torch.equal(got, reference))
            row["decode_us"] = 1000 * timed(lambda: timed_decode(config), args.reps)  # noqa: B023
            row["train_ms"] = timed(lambda: train(config), max(1, args.reps // 10))  # noqa: B023
        except Exception as e:  # a configuration the compiler refuses: say so, go on
            row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
        rows.append(row)
        print(
            f"{name:5s} key block {config[0]:4d} warps {config[1]} stages {config[2]}: "
            + (row["error"] if "error" in row else
               f"decode {row['decode_us']:7.2f} us, train {row['train_ms']:7.3f} ms, "
               f"invariant {row['invariant']}, bits as now {row['as_now']}"),
            flush=True,
        )  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="0.5b,7b")
    parser.add_argument("--batch", type=int, default=256, help="decode: sequences a step")
    parser.add_argument("--context", default="128,384", help="decode: the shortest and longest context, tokens")
    parser.add_argument("--block-size", type=int, default=16, help="decode: the paged block (rollout.block_size)")
    parser.add_argument("--tokens", type=int, default=32768, help="train: packed tokens a micro-batch")
    parser.add_argument("--sample", type=int, default=384, help="train: tokens a sample")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument(
        "--cold", action="store_true", help="decode: cycle through copies of the cache filling twice the L2 (read from "
        "memory, as each layer's cache in a step)"
    )  # fmt: skip
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.context = tuple(int(c) for c in args.context.split(","))
    if not torch.cuda.is_available():
        sys.exit("bench/exact_attention.py needs CUDA (the Triton kernels)")
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": []}
    for shape in args.shapes.split(","):
        report["results"] += run_shape(shape, args)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
