"""The Triton paged decode kernel alone: time per call and achieved bandwidth for a few launch settings.

    python bench/paged_attention.py                     # Qwen2-0.5B attention shape, 256 sequences x 256 tokens
    python bench/paged_attention.py --engine-call --batch 16 --context 640 --stages 1,2,3,4

Each setting is checked against the PyTorch reference first, then timed with CUDA-graph replays (median of
triton.testing.do_bench). Bytes counted: the keys and values each sequence reads once. --engine-call times the
kernel as the native engine's merged decode layer calls it: writing each sequence's new key and value, with the
rotary positions applied inside, on q/k/v views of one projection output.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlx.kernels.paged_attention import (  # noqa: E402
    paged_decode_attention,
    paged_decode_attention_torch,
    paged_decode_attention_triton,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--engine-call", action="store_true", help="with the cache write and rotary, as the engine")
    parser.add_argument("--stages", default="0", help="comma-separated num_stages to try (0: Triton's default)")
    args = parser.parse_args()
    import triton.testing

    dev, dtype = torch.device("cuda"), torch.bfloat16
    width = -(-args.context // args.block_size) + 1
    num_blocks = args.batch * width + 1
    shape = (num_blocks, args.block_size, args.kv_heads, args.head_dim)
    k_cache, v_cache = (torch.randn(shape, device=dev, dtype=dtype) for _ in range(2))
    tables = (torch.randperm(num_blocks - 1, device=dev)[: args.batch * width] + 1).view(args.batch, width).int()
    lens = torch.randint(args.context // 2, args.context * 3 // 2 + 1, (args.batch,), device=dev).int()
    lens.clamp_(max=width * args.block_size)
    heads, kv_heads, dim = args.heads, args.kv_heads, args.head_dim
    qkv = torch.randn(args.batch, (heads + 2 * kv_heads) * dim, device=dev, dtype=dtype)
    q, k, v = (t.view(args.batch, -1, dim) for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1))
    scale = dim**-0.5
    extra = {}
    if args.engine_call:  # the last position of each sequence takes the new key and value, rotated by its position
        last = (lens.long() - 1).clamp(min=0)
        slots = tables.gather(1, (last // args.block_size)[:, None])[:, 0].long() * args.block_size
        slots += last % args.block_size
        angles = last.double()[:, None] / 10000 ** (torch.arange(0, dim, 2, device=dev).double() / dim)
        rope = tuple(torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
        extra = {"new_kv": (k, v, slots), "rope": rope}
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        ref = paged_decode_attention(q, k_ref, v_ref, tables, lens, scale, impl="torch", **extra)
    else:
        ref = paged_decode_attention_torch(q.float(), k_cache.float(), v_cache.float(), tables, lens, scale)
    kv_bytes = 2 * int(lens.sum()) * kv_heads * dim * dtype.itemsize
    print(f"{'block_n':>7} {'warps':>5} {'stages':>6} {'splits':>6} {'us':>8} {'TB/s':>6} {'rel err':>8}")
    settings = [(64, 4, s) for s in (1, 2, 3, 4, 6)] + [(n, w, 0) for n in (32, 64, 128) for w in (2, 4, 8)]
    for stages in [int(x) for x in args.stages.split(",")]:
        for block_n, warps, splits in settings:  # splits 0: the default for this batch and table width
            run = functools.partial(
                paged_decode_attention_triton, q, k_cache, v_cache, tables, lens, scale, block_n, warps,
                num_splits=splits, num_stages=stages or None, **extra,
            )  # fmt: skip
            out = run().float()  # (the cache write is idempotent: the same keys at the same slots every call)
            err = float((out - ref.float()).norm() / ref.float().norm())
            ms = triton.testing.do_bench_cudagraph(run, rep=50, return_mode="median")
            print(
                f"{block_n:>7} {warps:>5} {stages or 'auto':>6} {splits or 'auto':>6} {ms * 1e3:>8.1f} "
                f"{kv_bytes / ms / 1e9:>6.2f} {err:>8.1e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
