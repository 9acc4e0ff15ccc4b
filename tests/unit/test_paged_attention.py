"""Paged-KV decode attention: the PyTorch reference equals dense attention per sequence (shuffled blocks, GQA,
ragged lengths); write_kv puts tokens where the block table reads them; the Triton kernel (interpreter on the
CPU, CUDA when present) equals the reference."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from rlx.kernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_torch,
    paged_decode_attention_triton,
    resolve_impl,
    write_kv,
)
from tests.conftest import run_script

HAS_TRITON = importlib.util.find_spec("triton") is not None


def make_problem(context_lens, heads=4, kv_heads=2, head_dim=32, block_size=4, dtype=torch.float32, seed=0):
    """Caches with more blocks than needed, each sequence given shuffled (non-contiguous) block ids; table
    entries past a sequence's last block are -1 (must never be read)."""
    g = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in context_lens]
    max_blocks = max(needed) + 1
    num_blocks = sum(needed) + 5
    ids = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(context_lens), max_blocks), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(needed):
        tables[b, :n] = ids[used : used + n].int()
        used += n
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(len(context_lens), heads, head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(context_lens, dtype=torch.int32)


def dense_attention(q, k_cache, v_cache, tables, context_lens, scale):
    """Naive float64 attention, one sequence and one head at a time, reading tokens one by one."""
    batch, heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(batch, heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        n = int(context_lens[b])
        slots = [(int(tables[b, t // block_size]), t % block_size) for t in range(n)]
        keys = torch.stack([k_cache[i, j] for i, j in slots]).double()  # [n, kv_heads, D]
        values = torch.stack([v_cache[i, j] for i, j in slots]).double()
        for h in range(heads):
            kvh = h // (heads // kv_heads)
            weights = torch.softmax(keys[:, kvh] @ q[b, h].double() * scale, dim=0)
            out[b, h] = weights @ values[:, kvh]
    return out


CASES = [  # (context_lens, heads, kv_heads, head_dim, block_size)
    ([1, 4, 8, 13, 7], 4, 2, 32, 4),
    ([1, 16, 32, 37, 100], 14, 2, 64, 16),
    ([5, 1, 3], 4, 4, 32, 2),  # plain multi-head
]


@pytest.mark.parametrize("case", CASES)
def test_torch_reference_equals_dense(case):
    lens, heads, kv_heads, head_dim, block_size = case
    q, kc, vc, tables, ctx = make_problem(lens, heads, kv_heads, head_dim, block_size)
    scale = head_dim**-0.5
    got = paged_decode_attention_torch(q, kc, vc, tables, ctx, scale)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert (got.double() - dense_attention(q, kc, vc, tables, ctx, scale)).abs().max() < 1e-5
    # context_len 1: the output is that token's value for every head
    assert torch.allclose(got[lens.index(1)], vc[tables[lens.index(1), 0], 0].repeat_interleave(heads // kv_heads, 0))


def test_torch_reference_edge_cases():
    q, kc, vc, tables, ctx = make_problem([3, 6])
    assert paged_decode_attention_torch(q, kc, vc, tables, torch.tensor([0, 6]), 0.2)[0].abs().max() == 0
    with pytest.raises(ValueError, match="needs 3 blocks"):
        paged_decode_attention_torch(q, kc, vc, tables[:, :2], torch.tensor([3, 9]), 0.2)
    with pytest.raises(ValueError, match="not a multiple"):
        paged_decode_attention_torch(q[:, :3], kc, vc, tables, ctx, 0.2)
    bf16 = [t.bfloat16() for t in (q, kc, vc)]
    assert paged_decode_attention_torch(*bf16, tables, ctx, 0.2).dtype == torch.bfloat16


def test_write_kv_places_tokens_where_the_table_reads_them():
    """Prefill-style writes of whole sequences, then one decode token each; attention over the written cache
    equals dense attention over the written keys/values."""
    lens, block_size, kv_heads, head_dim = [5, 1, 9], 4, 2, 8
    _, _, _, tables, _ = make_problem([n + 1 for n in lens], 4, kv_heads, head_dim, block_size)
    num_blocks = int(tables.max()) + 1
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    g = torch.Generator().manual_seed(1)

    def slots(b, positions):
        return torch.tensor([int(tables[b, t // block_size]) * block_size + t % block_size for t in positions])

    dense = []
    for b, n in enumerate(lens):
        k, v = torch.randn(2, n, kv_heads, head_dim, generator=g)
        write_kv(k_cache, v_cache, slots(b, range(n)), k, v)
        dense.append((k, v))
    new_k, new_v = torch.randn(2, len(lens), kv_heads, head_dim, generator=g)
    write_kv(k_cache, v_cache, torch.cat([slots(b, [n]) for b, n in enumerate(lens)]), new_k, new_v)
    for b, n in enumerate(lens):
        for t in range(n + 1):
            block, offset = int(tables[b, t // block_size]), t % block_size
            want_k, want_v = (dense[b][0][t], dense[b][1][t]) if t < n else (new_k[b], new_v[b])
            assert torch.equal(k_cache[block, offset], want_k) and torch.equal(v_cache[block, offset], want_v)
    q = torch.randn(len(lens), 4, head_dim, generator=g)
    ctx = torch.tensor([n + 1 for n in lens], dtype=torch.int32)
    got = paged_decode_attention_torch(q, k_cache, v_cache, tables, ctx, 0.5)
    assert (got.double() - dense_attention(q, k_cache, v_cache, tables, ctx, 0.5)).abs().max() < 1e-5


def test_dispatch():
    assert resolve_impl(torch.device("cpu")) == "torch"
    if HAS_TRITON:
        assert resolve_impl(torch.device("cuda")) == "triton"
    assert resolve_impl(torch.device("cuda"), "torch") == "torch"
    assert resolve_impl(torch.device("cpu"), "triton") == "triton"
    with pytest.raises(ValueError, match="valid: auto, torch, triton"):
        resolve_impl(torch.device("cpu"), "flash")
    q, kc, vc, tables, ctx = make_problem([2, 7])
    assert torch.equal(
        paged_decode_attention(q, kc, vc, tables, ctx, 0.3), paged_decode_attention_torch(q, kc, vc, tables, ctx, 0.3)
    )


def rope_error(kernel, device="cpu", dtype=torch.float32, **kwargs) -> float:
    """Largest difference between `kernel` and the PyTorch path, given q, k and v as views of one projection's
    output [B, (H + 2 Hkv) D] (k also as a tensor of its own, as after Qwen3's key norm: other strides than v's)
    and rotary positions (rope): the caches written the same (within float32 rounding), the outputs alike,
    unsplit and split in 2."""
    q, kc, vc, tables, ctx = make_problem([6, 13, 1, 30], 4, 2, 32, 4, dtype=dtype)
    q, kc, vc, tables, ctx = (t.to(device) for t in (q, kc, vc, tables, ctx))
    qkv = torch.randn(4, (4 + 2 * 2) * 32, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    q, k, v = (t.view(4, -1, 32) for t in qkv.split([128, 64, 64], dim=-1))
    angles = (ctx.double() - 1)[:, None] / 10000 ** (torch.arange(0, 32, 2, device=device).double() / 32)
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    slots = torch.stack([tables[b, (n - 1) // 4].long() * 4 + (n - 1) % 4 for b, n in enumerate(ctx.tolist())])
    kc2, vc2 = kc.clone(), vc.clone()
    want = paged_decode_attention(q, kc2, vc2, tables, ctx, 0.2, new_kv=(k, v, slots), impl="torch", rope=(cos, sin))
    worst = 0.0
    for splits, keys in ((1, k), (2, k), (1, k.contiguous())):
        kc3, vc3 = kc.clone(), vc.clone()
        new_kv = (keys, v, slots)
        got = kernel(q, kc3, vc3, tables, ctx, 0.2, new_kv=new_kv, num_splits=splits, rope=(cos, sin), **kwargs)
        worst = max(worst, *((a.float() - b.float()).abs().max().item() for a, b in ((kc3, kc2), (vc3, vc2))))
        worst = max(worst, (got.float() - want.float()).abs().max().item())
    return worst


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_triton_kernel_in_the_interpreter():
    """The Triton kernel itself, run by Triton's interpreter on the CPU (TRITON_INTERPRET=1 set before triton is
    imported, hence a subprocess), against the float32 reference."""
    env = {"TRITON_INTERPRET": "1"}
    out = run_script(Path(__file__).parent / "workers" / "triton_paged_attention_check.py", env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.strip().splitlines()[-1]) < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs CUDA and triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_on_gpu(dtype):
    """Qwen2-0.5B-shaped decode batch (14 heads, 2 kv heads, head_dim 64, block_size 16, up to 400 tokens).
    bfloat16: within 2e-2 (absolute) of the reference on the same bf16 inputs (the kernel rounds the
    probabilities to bf16 for the P @ V product; values are O(1)); float32: within 1e-4 (IEEE dots, no TF32)."""
    g = torch.Generator().manual_seed(0)
    lens = [1, 16, 400, 257] + torch.randint(1, 401, (60,), generator=g).tolist()
    q, kc, vc, tables, ctx = make_problem(lens, 14, 2, 64, 16, dtype=dtype)
    q, kc, vc, tables, ctx = (t.cuda() for t in (q, kc, vc, tables, ctx))
    want = paged_decode_attention_torch(q, kc, vc, tables, ctx, 0.125)
    got = paged_decode_attention(q, kc, vc, tables, ctx, 0.125)
    assert got.dtype == dtype and got.is_cuda
    assert (got.float() - want.float()).abs().max().item() < (2e-2 if dtype == torch.bfloat16 else 1e-4)
    for splits in (1, 4, 7):  # one pass, and flash-decoding with a reduce kernel
        got = paged_decode_attention_triton(q, kc, vc, tables, ctx, 0.125, num_splits=splits)
        assert (got.float() - want.float()).abs().max().item() < (2e-2 if dtype == torch.bfloat16 else 1e-4)
    # the fused write of each sequence's new key and value (its last position), split or not
    slots = torch.stack([tables[b, (n - 1) // 16].long() * 16 + (n - 1) % 16 for b, n in enumerate(ctx.tolist())])
    new_k, new_v = torch.randn(2, len(lens), 2, 64, device="cuda").to(dtype).unbind(0)
    kc2, vc2 = kc.clone(), vc.clone()
    write_kv(kc2, vc2, slots, new_k, new_v)
    want = paged_decode_attention_torch(q, kc2, vc2, tables, ctx, 0.125)
    for splits in (1, 4):
        kc3, vc3 = kc.clone(), vc.clone()
        new_kv = (new_k, new_v, slots)
        got = paged_decode_attention_triton(q, kc3, vc3, tables, ctx, 0.125, new_kv=new_kv, num_splits=splits)
        assert torch.equal(kc3, kc2) and torch.equal(vc3, vc2)
        assert (got.float() - want.float()).abs().max().item() < (2e-2 if dtype == torch.bfloat16 else 1e-4)
    # rotary inside the kernel, on strided q/k/v views (bf16: the PyTorch path rounds each product, the kernel once)
    assert rope_error(paged_decode_attention_triton, "cuda", dtype) < (6e-2 if dtype == torch.bfloat16 else 1e-4)
