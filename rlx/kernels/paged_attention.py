"""Decode-step attention over a paged KV cache (one query token per sequence).

Layout, per layer: `k_cache` and `v_cache` are [num_blocks, block_size, num_kv_heads, head_dim]; token t of
sequence b lives in block `block_tables[b, t // block_size]` at offset `t % block_size` (flat slot
`block_id * block_size + offset`, the index `write_kv` takes). `paged_decode_attention*` computes, for each
sequence and query head, softmax(q . K[:context_len] * scale) @ V[:context_len] with grouped-query heads
(query head h reads kv head h // (num_heads // num_kv_heads)), softmax in float32. The Triton kernel (online
softmax, one program per (sequence, kv head) covering that kv head's query heads) runs on CUDA; the pure
PyTorch reference runs anywhere. `paged_decode_attention` picks one (its `impl`: auto, torch or triton).
"""

from __future__ import annotations

import importlib.util
import math
import os
from typing import Any

import torch

IMPLS = ("auto", "torch", "triton")


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Write new keys/values into the caches in place.

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous.
    slot_mapping: [T] integer flat slots (block_id * block_size + offset), each valid (no -1 padding) and distinct.
    k, v: [T, num_kv_heads, head_dim] (cast to the cache dtype).
    """
    _, _, kv_heads, head_dim = k_cache.shape
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.long)
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, v.to(v_cache.dtype))


def _check_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor) -> int:
    """Validate shapes (no device sync); return the GQA group size num_heads // num_kv_heads."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"expected q [B, H, D] and caches [blocks, block_size, kv_heads, D]; got {tuple(q.shape)}, "
            f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or heads % kv_heads:
        raise ValueError(f"head_dim {head_dim} vs {k_cache.shape[3]}, or {heads} heads not a multiple of {kv_heads}")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be [B={batch}, max_blocks]; got {tuple(block_tables.shape)}")
    return heads // kv_heads


def paged_decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Reference: gather each sequence's blocks, mask positions >= context_len, float32 softmax, weighted sum.

    q: [B, num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim];
    block_tables: [B, max_blocks] int (entries past a sequence's last block are ignored);
    context_lens: [B] int, tokens in the cache per sequence including the current one.
    Returns [B, num_heads, head_dim] in q's dtype (zeros for a sequence with context_len 0).
    """
    group = _check_shapes(q, k_cache, v_cache, block_tables)
    batch, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    ctx = context_lens.to(device=q.device, dtype=torch.long)
    max_ctx = int(ctx.max()) if batch else 0
    n_blocks = max(1, -(-max_ctx // block_size))
    if n_blocks > block_tables.shape[1]:
        raise ValueError(f"context length {max_ctx} needs {n_blocks} blocks; block_tables has {block_tables.shape[1]}")
    pages = block_tables[:, :n_blocks].to(device=q.device, dtype=torch.long)
    # entries past a sequence's length may be anything (-1, stale ids): point them at block 0, masked below
    pages = torch.where(torch.arange(n_blocks, device=q.device)[None] * block_size < ctx[:, None], pages, 0)
    keys = k_cache[pages].reshape(batch, n_blocks * block_size, kv_heads, head_dim).float()
    values = v_cache[pages].reshape(batch, n_blocks * block_size, kv_heads, head_dim).float()
    valid = torch.arange(n_blocks * block_size, device=q.device)[None] < ctx[:, None]  # [B, T]
    scores = torch.einsum("bkgd,btkd->bkgt", q.float().view(batch, kv_heads, group, head_dim), keys) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an empty context gives NaN rows: zeros instead
    out = torch.einsum("bkgt,btkd->bkgd", probs, values)
    return out.reshape(batch, heads, head_dim).to(q.dtype)


def triton_available() -> bool:
    """Whether triton can be imported (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def _kernel() -> Any:
    """(paged decode kernel, split-K reduce kernel), defined on first use."""
    from rlx.kernels.paged_attention_kernels import _paged_decode_kernel, _reduce_kernel

    return _paged_decode_kernel, _reduce_kernel


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    block_n: int | None = None,
    num_warps: int | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    num_splits: int | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Triton kernel; same arguments, result and masking as `paged_decode_attention_torch`, without a device sync.

    The caller guarantees what is not checked here: block_tables has ceil(context_len / block_size) valid block
    ids per sequence, and every context_len <= max_blocks * block_size. q, the caches and the output may be any
    float dtype; the last dim of q and the caches must be contiguous. block_n (tokens per step, a power of 2
    >= 16) and num_warps override the defaults (tuning). new_kv = (k, v [B, kv_heads, D], slot_mapping [B]):
    write each sequence's new key and value first, in the same kernel (`write_kv` for one token a sequence).
    num_splits: flash-decoding splits of each context (a second kernel combines them); default by occupancy.
    rope = (cos, sin [B, D]): rotate q and the new keys first (`rotate`), in float32 inside the kernel.
    num_stages: Triton's software pipelining depth of the token loop (tuning; default Triton's).
    Runs on CUDA, or on the CPU under TRITON_INTERPRET=1.
    """
    group = _check_shapes(q, k_cache, v_cache, block_tables)
    batch, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        q, k_cache, v_cache = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()  # no-ops for int32 contiguous inputs
    context_lens = context_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if batch == 0:
        return out
    block_n = block_n or (16 if q.device.type != "cuda" else 64)
    if new_kv is None:
        k_new = v_new = slots = out  # unused (WRITE_KV off)
    else:  # any row and head strides (views of a q/k/v projection's output)
        k_new, v_new, slots = (t if t.stride(-1) == 1 else t.contiguous() for t in new_kv)
    cos, sin = (out, out) if rope is None else (t if t.stride(-1) == 1 else t.contiguous() for t in rope)
    if cos.stride(0) != sin.stride(0):
        cos, sin = cos.contiguous(), sin.contiguous()
    capacity = block_tables.shape[1] * block_size  # the longest context the table allows (no device sync)
    splits = num_splits or _default_splits(batch * kv_heads, capacity, block_n)
    partition = -(-capacity // splits // block_n) * block_n
    pads = dict(GROUP_PAD=max(16, _next_pow2(group)), DIM_PAD=max(16, _next_pow2(head_dim)))  # tl.dot: dims >= 16
    parts = [out] * 3
    if splits > 1:  # partial max, sum and accumulator of every (sequence, kv head, split)
        rows = batch * kv_heads * splits * pads["GROUP_PAD"]
        parts = [q.new_empty(rows, dtype=torch.float32), q.new_empty(rows, dtype=torch.float32)]
        parts.append(q.new_empty(rows, pads["DIM_PAD"], dtype=torch.float32))
    decode, reduce = _kernel()
    decode[(batch, kv_heads, splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, scale * math.log2(math.e), q.stride(0), q.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0), out.stride(0), out.stride(1),
        k_new, v_new, slots, *k_new.stride()[:2], *v_new.stride()[:2], cos, sin, cos.stride(0), *parts,
        BLOCK_SIZE=block_size, GROUP=group, HEAD_DIM=head_dim, **pads, BLOCK_N=block_n,
        IEEE=k_cache.dtype == torch.float32,  # float32 caches: exact fp32 dots, not TF32
        INTERPRET_TOKENS=capacity if os.environ.get("TRITON_INTERPRET") == "1" else 0,
        WRITE_KV=new_kv is not None, ROPE=rope is not None, NUM_SPLITS=splits, PARTITION=partition,
        num_warps=num_warps or 4, **({"num_stages": num_stages} if num_stages else {}),
    )  # fmt: skip
    if splits > 1:
        reduce[(batch, kv_heads)](
            *parts, out, out.stride(0), out.stride(1), GROUP=group, HEAD_DIM=head_dim, **pads, NUM_SPLITS=splits
        )
    return out


def _default_splits(programs: int, capacity: int, block_n: int) -> int:
    """Flash-decoding splits: none once the (sequence, kv head) programs cover an H100/H200's 132
    multiprocessors (measured 2026-11-22 on an H200, 256 sequences x 2 kv heads: 1 split 11.1 us, 2 splits
    13.7, 3 splits 15.6), else enough to give each one a program, no split shorter than 4 * block_n tokens
    (that regime, few long sequences, is checked for correctness but not timed). RLX_PAGED_SPLITS=N forces N."""
    forced = int(os.environ.get("RLX_PAGED_SPLITS") or 0)
    if forced > 0:
        return forced
    wanted = -(-132 // max(programs, 1))
    return max(1, min(wanted, capacity // (4 * block_n), 16))


def resolve_impl(device: torch.device, impl: str = "auto") -> str:
    """'torch' or 'triton' for `device` and `impl` = auto|torch|triton; auto picks Triton on CUDA when triton
    imports."""
    if impl not in IMPLS:
        raise ValueError(f"paged attention {impl!r}; valid: {', '.join(IMPLS)}")
    if impl == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    return impl


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    impl: str = "auto",
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Decode attention over the paged cache: Triton on CUDA (when triton imports), else the PyTorch reference;
    `impl` = torch|triton forces one. Shapes as in `paged_decode_attention_torch`; new_kv = (k, v
    [B, kv_heads, D], slot_mapping [B]) is written into the caches first (inside the Triton kernel); rope =
    (cos, sin [B, D]) rotates q and the new keys first (`rotate`; inside the Triton kernel, in float32)."""
    if resolve_impl(q.device, impl) == "triton":
        return paged_decode_attention_triton(
            q, k_cache, v_cache, block_tables, context_lens, scale, new_kv=new_kv, rope=rope
        )
    if rope is not None:
        q = rotate(q, *rope)
        new_kv = None if new_kv is None else (rotate(new_kv[0], *rope), *new_kv[1:])
    if new_kv is not None:
        write_kv(k_cache, v_cache, new_kv[2], new_kv[0], new_kv[1])
    return paged_decode_attention_torch(q, k_cache, v_cache, block_tables, context_lens, scale)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions, Llama's rotate-half convention (Hugging Face's `apply_rotary_pos_emb`, in x's dtype):
    x [B, heads, D], cos and sin [B, D] -> x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
