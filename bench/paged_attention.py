"""The Triton paged decode kernel alone: time per call and achieved bandwidth for a few launch settings.

    python bench/paged_attention.py                     # Qwen2-0.5B attention shape, 256 sequences x 256 tokens

Each setting is checked against the PyTorch reference first, then timed with CUDA-graph replays (median of
triton.testing.do_bench). Bytes counted: the keys and values each sequence reads once, plus q and the output.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlx.kernels.paged_attention import paged_decode_attention_torch, paged_decode_attention_triton  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
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
    q = torch.randn(args.batch, args.heads, args.head_dim, device=dev, dtype=dtype)
    scale = args.head_dim**-0.5
    ref = paged_decode_attention_torch(q.float(), k_cache.float(), v_cache.float(), tables, lens, scale)
    kv_bytes = 2 * int(lens.sum()) * args.kv_heads * args.head_dim * dtype.itemsize
    print(f"{'block_n':>7} {'warps':>5} {'splits':>6} {'us':>8} {'TB/s':>6} {'rel err':>8}")
    settings = [(64, 4, s) for s in (1, 2, 3, 4, 6)] + [(n, w, 0) for n in (32, 64, 128) for w in (2, 4, 8)]
    for block_n, warps, splits in settings:  # splits 0: the default for this batch and table width
        run = functools.partial(
            paged_decode_attention_triton, q, k_cache, v_cache, tables, lens, scale, block_n, warps, num_splits=splits
        )
        out = run().float()
        err = float((out - ref).norm() / ref.norm())
        ms = triton.testing.do_bench_cudagraph(run, rep=50, return_mode="median")
        line = f"{block_n:>7} {warps:>5} {splits or 'auto':>6} {ms * 1e3:>8.1f} {kv_bytes / ms / 1e9:>6.2f} {err:>8.1e}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
