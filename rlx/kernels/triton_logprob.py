"""Triton kernels for the fused logprob + entropy (see rlx/kernels/logprob_entropy.py for the math).

Two variants, chosen per pass (RLX_LOGPROB_FWD / RLX_LOGPROB_BWD, default 'cublas'):

- 'cublas': the logits of a vocabulary chunk come from one cuBLAS matmul in the input dtype (the same
  rounding as the model's own LM head); a Triton kernel reduces the chunk to online-softmax statistics
  per row (max, sum of exp, sum of exp * logit, target logit) in the forward, or overwrites it with
  dL/dlogits in the backward. The fastest on H200 (bench/RESULTS.md).
- 'fused': a Triton matmul (tl.dot, float32 accumulation) with the statistics or dL/dlogits in its
  epilogue, so no logits chunk is written; float32 logits, but slower than cuBLAS at large H.

Either way the backward forms dhidden += dlogits @ W_chunk and dweight_chunk = dlogits.T @ hidden
with cuBLAS. Extra memory: one [N, chunk] buffer (512 MiB), float32 dhidden and small partials; no
[N, V] tensor. Programs run with the row block fastest so programs sharing a weight tile run together.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from rlx.kernels.logprob_entropy import acc_dtype, row_grads

TILES_PER_PROGRAM = 8
BWD_CHUNK_BYTES = 512 * 2**20


@triton.jit
def _tile_logits(
    h_ptr,
    w_ptr,
    offs_n,
    offs_v,
    N,
    V,
    H: tl.constexpr,
    stride_h,
    stride_w,
    inv_temp,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    """logits tile [BLOCK_N, BLOCK_V] = hidden[offs_n] @ weight[offs_v].T * inv_temp, float32."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for k in range(0, H, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        a = tl.load(
            h_ptr + offs_n[:, None] * stride_h + offs_k[None, :],
            mask=(offs_n[:, None] < N) & (offs_k[None, :] < H),
            other=0.0,
        )
        b = tl.load(
            w_ptr + offs_v[:, None] * stride_w + offs_k[None, :],
            mask=(offs_v[:, None] < V) & (offs_k[None, :] < H),
            other=0.0,
        )
        if IEEE:
            acc += tl.dot(a, tl.trans(b), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(b))
    return acc * inv_temp


@triton.jit
def _forward_stats_kernel(
    h_ptr,
    w_ptr,
    tgt_ptr,
    m_ptr,
    s_ptr,
    t_ptr,
    zt_ptr,
    N,
    V,
    H: tl.constexpr,
    stride_h,
    stride_w,
    num_groups,
    inv_temp,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TILES: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_g = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_n < N
    tgt = tl.load(tgt_ptr + offs_n, mask=row_ok, other=-1)
    m = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    t = tl.zeros((BLOCK_N,), dtype=tl.float32)
    zt = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for tile in range(TILES):
        offs_v = (pid_g * TILES + tile) * BLOCK_V + tl.arange(0, BLOCK_V)
        col_ok = offs_v[None, :] < V
        z = _tile_logits(
            h_ptr, w_ptr, offs_n, offs_v, N, V, H, stride_h, stride_w, inv_temp, BLOCK_N, BLOCK_V, BLOCK_K, IEEE
        )
        z_masked = tl.where(col_ok, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z_masked, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile past the vocabulary end
        e = tl.where(col_ok, tl.exp(z_masked - m_safe[:, None]), 0.0)
        scale = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_safe))
        s = s * scale + tl.sum(e, axis=1)
        t = t * scale + tl.sum(e * tl.where(col_ok, z, 0.0), axis=1)
        m = m_new
        zt += tl.sum(tl.where(tgt[:, None] == offs_v[None, :], z, 0.0), axis=1)
    out = offs_n * num_groups + pid_g
    tl.store(m_ptr + out, m, mask=row_ok)
    tl.store(s_ptr + out, s, mask=row_ok)
    tl.store(t_ptr + out, t, mask=row_ok)
    tl.store(zt_ptr + out, zt, mask=row_ok)


@triton.jit
def _backward_dlogits_kernel(
    h_ptr,
    w_ptr,
    tgt_ptr,
    lse_ptr,
    mean_ptr,
    a_ptr,
    b_ptr,
    dz_ptr,
    N,
    V,
    H: tl.constexpr,
    v_start,
    chunk,
    stride_h,
    stride_w,
    stride_dz,
    inv_temp,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_c = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)  # column inside the chunk
    offs_v = v_start + offs_c
    row_ok = offs_n < N
    z = _tile_logits(
        h_ptr, w_ptr, offs_n, offs_v, N, V, H, stride_h, stride_w, inv_temp, BLOCK_N, BLOCK_V, BLOCK_K, IEEE
    )
    lse = tl.load(lse_ptr + offs_n, mask=row_ok, other=0.0)
    mean = tl.load(mean_ptr + offs_n, mask=row_ok, other=0.0)
    a = tl.load(a_ptr + offs_n, mask=row_ok, other=0.0)
    b = tl.load(b_ptr + offs_n, mask=row_ok, other=0.0)
    tgt = tl.load(tgt_ptr + offs_n, mask=row_ok, other=-1)
    p = tl.exp(z - lse[:, None])
    dz = -p * (a[:, None] + b[:, None] * (z - mean[:, None]))
    dz += tl.where(tgt[:, None] == offs_v[None, :], a[:, None], 0.0)
    dz = dz * inv_temp
    ok = row_ok[:, None] & (offs_c[None, :] < chunk) & (offs_v[None, :] < V)
    tl.store(dz_ptr + offs_n[:, None] * stride_dz + offs_c[None, :], dz.to(dz_ptr.dtype.element_ty), mask=ok)


DEFAULT_BLOCKS = (128, 128, 64, 8, 3)


@triton.jit
def _stats_from_logits_kernel(
    z_ptr,
    tgt_ptr,
    part_ptr,
    N,
    width,
    v_start,
    stride_z,
    stride_part,
    group_start,
    inv_temp,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    GROUP_W: tl.constexpr,
):
    """Online statistics of a GROUP_W-column slice of one [N, width] logits chunk (cuBLAS variant).

    Grid: (row blocks, column groups). Writes (max, sum exp, sum exp * z, target logit) to
    part_ptr[k * stride_part + (group_start + group) * N + row], k = 0..3."""
    pid_n = tl.program_id(0)
    pid_g = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_n < N
    tgt = tl.load(tgt_ptr + offs_n, mask=row_ok, other=-1)
    m = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    t = tl.zeros((BLOCK_N,), dtype=tl.float32)
    zt = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for c in range(0, GROUP_W, BLOCK_V):
        offs_c = pid_g * GROUP_W + c + tl.arange(0, BLOCK_V)
        ok = row_ok[:, None] & (offs_c[None, :] < width)
        z = tl.load(z_ptr + offs_n[:, None] * stride_z + offs_c[None, :], mask=ok, other=0.0).to(tl.float32)
        z = z * inv_temp
        z_masked = tl.where(ok, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z_masked, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        e = tl.where(ok, tl.exp(z_masked - m_safe[:, None]), 0.0)
        scale = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_safe))
        s = s * scale + tl.sum(e, axis=1)
        t = t * scale + tl.sum(e * tl.where(ok, z, 0.0), axis=1)
        m = m_new
        zt += tl.sum(tl.where(tgt[:, None] == (v_start + offs_c)[None, :], z, 0.0), axis=1)
    out = part_ptr + (group_start + pid_g) * N + offs_n
    tl.store(out, m, mask=row_ok)
    tl.store(out + stride_part, s, mask=row_ok)
    tl.store(out + 2 * stride_part, t, mask=row_ok)
    tl.store(out + 3 * stride_part, zt, mask=row_ok)


@triton.jit
def _dlogits_from_logits_kernel(
    z_ptr,
    tgt_ptr,
    lse_ptr,
    mean_ptr,
    a_ptr,
    b_ptr,
    N,
    width,
    v_start,
    stride_z,
    inv_temp,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Overwrite a [N, width] logits chunk with dL/dlogits (cuBLAS variant)."""
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_c = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = offs_n < N
    ok = row_ok[:, None] & (offs_c[None, :] < width)
    ptrs = z_ptr + offs_n[:, None] * stride_z + offs_c[None, :]
    z = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32) * inv_temp
    lse = tl.load(lse_ptr + offs_n, mask=row_ok, other=0.0)
    mean = tl.load(mean_ptr + offs_n, mask=row_ok, other=0.0)
    a = tl.load(a_ptr + offs_n, mask=row_ok, other=0.0)
    b = tl.load(b_ptr + offs_n, mask=row_ok, other=0.0)
    tgt = tl.load(tgt_ptr + offs_n, mask=row_ok, other=-1)
    p = tl.exp(z - lse[:, None])
    dz = -p * (a[:, None] + b[:, None] * (z - mean[:, None]))
    dz += tl.where(tgt[:, None] == (v_start + offs_c)[None, :], a[:, None], 0.0)
    tl.store(ptrs, (dz * inv_temp).to(z_ptr.dtype.element_ty), mask=ok)


def _variant(name: str, hidden: torch.Tensor) -> str:
    """'cublas' (default: cuBLAS bf16 logits chunks + Triton elementwise kernels; the same logits rounding
    as the model's own head, and the fastest on H200) or 'fused' (Triton matmul with the statistics in
    its epilogue: float32 logits, no logits chunk written, slower at large H). Env RLX_LOGPROB_FWD /
    RLX_LOGPROB_BWD choose per pass."""
    return os.environ.get(name, "cublas")


_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_ELEMENTWISE_N, _ELEMENTWISE_V, _ELEMENTWISE_WARPS = (16, 16, 1) if _INTERPRET else (32, 256, 8)
_STATS_GROUP = 64 if _INTERPRET else 2048  # columns per program of the statistics kernel


def _blocks(hidden: torch.Tensor) -> dict:
    """Tile sizes: BLOCK_N x BLOCK_V logits tiles over BLOCK_K slices of H, plus launch warps/stages.
    RLX_TRITON_BLOCKS="N,V,K,warps,stages" overrides them (for benchmark sweeps)."""
    if hidden.device.type != "cuda":  # the interpreter (tests): small tiles
        return {"BLOCK_N": 16, "BLOCK_V": 16, "BLOCK_K": 16, "num_warps": 1}
    text = os.environ.get("RLX_TRITON_BLOCKS")
    n, v, k, warps, stages = (int(x) for x in text.split(",")) if text else DEFAULT_BLOCKS
    return {"BLOCK_N": n, "BLOCK_V": v, "BLOCK_K": k, "num_warps": warps, "num_stages": stages}


def _launch_kwargs(blocks: dict) -> dict:
    return {k: v for k, v in blocks.items() if k in ("num_warps", "num_stages")}


def _tile_args(blocks: dict) -> dict:
    return {k: v for k, v in blocks.items() if k.startswith("BLOCK")}


def forward_stats(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float):
    """(lse [N], mean logit [N], target logit [N]) in float32 (float64 inputs: float64 reduction)."""
    n, h = hidden.shape
    vocab = weight.shape[0]
    blocks = _blocks(hidden)
    block_n, block_v = blocks["BLOCK_N"], blocks["BLOCK_V"]
    if _variant("RLX_LOGPROB_FWD", hidden) == "cublas":
        return _forward_stats_cublas(hidden, weight, targets, temperature)
    groups = triton.cdiv(vocab, block_v * TILES_PER_PROGRAM)
    parts = torch.empty((4, n, groups), dtype=torch.float32, device=hidden.device)
    grid = (triton.cdiv(n, block_n), groups)
    _forward_stats_kernel[grid](
        hidden,
        weight,
        targets,
        parts[0],
        parts[1],
        parts[2],
        parts[3],
        n,
        vocab,
        h,
        hidden.stride(0),
        weight.stride(0),
        groups,
        1.0 / temperature,
        TILES=TILES_PER_PROGRAM,
        IEEE=hidden.dtype == torch.float32,
        **_tile_args(blocks),
        **_launch_kwargs(blocks),
    )
    return _combine(*parts, acc_dtype(hidden))


def _chunk_width(n: int, vocab: int, element_size: int, block_v: int) -> int:
    chunk = max(block_v, (BWD_CHUNK_BYTES // max(n * element_size, 1)) // block_v * block_v)
    return min(chunk, triton.cdiv(vocab, block_v) * block_v)


def _combine(m, s, t, zt, dtype):
    """Merge per-group online statistics [N, G] into (lse, mean logit, target logit)."""
    m, s, t, zt = (x.to(dtype) for x in (m, s, t, zt))
    big_m = m.max(dim=1, keepdim=True).values
    scale = torch.exp(m - big_m)
    total = (s * scale).sum(1)
    return big_m.squeeze(1) + torch.log(total), (t * scale).sum(1) / total, zt.sum(1)


def _forward_stats_cublas(hidden, weight, targets, temperature):
    n, vocab = hidden.shape[0], weight.shape[0]
    chunk = _chunk_width(n, vocab, hidden.element_size(), _STATS_GROUP)
    total = sum(triton.cdiv(min(chunk, vocab - v0), _STATS_GROUP) for v0 in range(0, vocab, chunk))
    parts = torch.empty((4, total, n), dtype=torch.float32, device=hidden.device)
    z = torch.empty((n, chunk), dtype=hidden.dtype, device=hidden.device)
    group_start = 0
    for v0 in range(0, vocab, chunk):
        width = min(chunk, vocab - v0)
        torch.matmul(hidden, weight[v0 : v0 + width].T, out=z[:, :width])
        groups = triton.cdiv(width, _STATS_GROUP)
        _stats_from_logits_kernel[(triton.cdiv(n, _ELEMENTWISE_N), groups)](
            z,
            targets,
            parts,
            n,
            width,
            v0,
            z.stride(0),
            parts.stride(0),
            group_start,
            1.0 / temperature,
            BLOCK_N=_ELEMENTWISE_N,
            BLOCK_V=_ELEMENTWISE_V,
            GROUP_W=_STATS_GROUP,
            num_warps=_ELEMENTWISE_WARPS,
        )
        group_start += groups
    return _combine(*parts.transpose(1, 2), acc_dtype(hidden))


def _backward_cublas(hidden, weight, targets, lse32, mean32, a32, b32, temperature, grad_hidden, grad_weight):
    n, vocab = hidden.shape[0], weight.shape[0]
    chunk = _chunk_width(n, vocab, hidden.element_size(), 128)
    z = torch.empty((n, chunk), dtype=hidden.dtype, device=hidden.device)
    for v0 in range(0, vocab, chunk):
        width = min(chunk, vocab - v0)
        block = z[:, :width]
        torch.matmul(hidden, weight[v0 : v0 + width].T, out=block)
        grid = (triton.cdiv(n, 64), triton.cdiv(width, 128))
        _dlogits_from_logits_kernel[grid](
            z,
            targets,
            lse32,
            mean32,
            a32,
            b32,
            n,
            width,
            v0,
            z.stride(0),
            1.0 / temperature,
            BLOCK_N=64,
            BLOCK_V=128,
            num_warps=8,
        )
        grad_hidden += (block @ weight[v0 : v0 + width]).to(grad_hidden.dtype)
        if grad_weight is not None:
            torch.matmul(block.T, hidden, out=grad_weight[v0 : v0 + width])


def backward_grads(hidden, weight, targets, lse, mean, a, b, temperature, need_weight_grad: bool):
    """(dhidden, dweight) for upstream row gradients a (logprob) and b (entropy)."""
    n, h = hidden.shape
    vocab = weight.shape[0]
    blocks = _blocks(hidden)
    block_n, block_v = blocks["BLOCK_N"], blocks["BLOCK_V"]
    chunk = _chunk_width(n, vocab, hidden.element_size(), block_v)
    grad_hidden = torch.zeros((n, h), dtype=acc_dtype(hidden), device=hidden.device)
    grad_weight = torch.empty_like(weight) if need_weight_grad else None
    lse32, mean32 = lse.float().contiguous(), mean.float().contiguous()
    a32, b32 = a.float().contiguous(), b.float().contiguous()
    if _variant("RLX_LOGPROB_BWD", hidden) == "cublas":
        _backward_cublas(hidden, weight, targets, lse32, mean32, a32, b32, temperature, grad_hidden, grad_weight)
        return grad_hidden.to(hidden.dtype), grad_weight
    dz = torch.empty((n, chunk), dtype=hidden.dtype, device=hidden.device)
    for v0 in range(0, vocab, chunk):
        width = min(chunk, vocab - v0)
        grid = (triton.cdiv(n, block_n), triton.cdiv(width, block_v))
        _backward_dlogits_kernel[grid](
            hidden,
            weight,
            targets,
            lse32,
            mean32,
            a32,
            b32,
            dz,
            n,
            vocab,
            h,
            v0,
            width,
            hidden.stride(0),
            weight.stride(0),
            dz.stride(0),
            1.0 / temperature,
            IEEE=hidden.dtype == torch.float32,
            **_tile_args(blocks),
            **_launch_kwargs(blocks),
        )
        block = dz[:, :width]
        grad_hidden += (block @ weight[v0 : v0 + width]).to(grad_hidden.dtype)
        if grad_weight is not None:
            torch.matmul(block.T, hidden, out=grad_weight[v0 : v0 + width])
    return grad_hidden.to(hidden.dtype), grad_weight


class TritonLogprobEntropy(torch.autograd.Function):
    """Fused logprob + entropy with Triton kernels (CUDA; the interpreter for CPU tests)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, ignore_index, chunk):
        hidden, weight, targets = hidden.contiguous(), weight.contiguous(), targets.contiguous()
        valid = targets != ignore_index
        lse, mean, target_logit = forward_stats(hidden, weight, targets, temperature)
        ctx.save_for_backward(hidden, weight, targets, lse, mean)
        ctx.temperature, ctx.ignore_index = temperature, ignore_index
        return (target_logit - lse) * valid, (lse - mean) * valid

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        hidden, weight, targets, lse, mean = ctx.saved_tensors
        a, b = row_grads(grad_logprob, grad_entropy, targets, ctx.ignore_index, lse)
        grad_hidden, grad_weight = backward_grads(
            hidden, weight, targets, lse, mean, a, b, ctx.temperature, ctx.needs_input_grad[1]
        )
        return grad_hidden, grad_weight, None, None, None, None


class TritonVocabParallelLogprobEntropy(torch.autograd.Function):
    """The Triton kernels on this rank's vocabulary rows [vocab_start, vocab_start + V_local): per-shard
    (lse, mean logit, target logit) merged over `group` (only [N]-sized statistics cross ranks), and the
    backward run on the shard with the merged statistics (the hidden gradient summed over `group`)."""

    @staticmethod
    def forward(ctx, hidden, weight_shard, targets, temperature, ignore_index, vocab_start, group):
        import torch.distributed as dist

        hidden, weight_shard = hidden.contiguous(), weight_shard.contiguous()
        local = (targets - vocab_start).contiguous()  # out-of-shard targets match no row here
        with torch.no_grad():
            lse, mean, target_logit = forward_stats(hidden, weight_shard, local, temperature)
            big = lse.clone()
            dist.all_reduce(big, op=dist.ReduceOp.MAX, group=group)
            weight = torch.exp(lse - big)
            sums = torch.stack([weight, weight * mean, target_logit])
            dist.all_reduce(sums, group=group)
            lse, mean = big + torch.log(sums[0]), sums[1] / sums[0]
        valid = targets != ignore_index
        ctx.save_for_backward(hidden, weight_shard, local, lse, mean, targets)
        ctx.temperature, ctx.ignore_index, ctx.group = temperature, ignore_index, group
        return (sums[2] - lse) * valid, (lse - mean) * valid

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        import torch.distributed as dist

        hidden, weight, local, lse, mean, targets = ctx.saved_tensors
        a, b = row_grads(grad_logprob, grad_entropy, targets, ctx.ignore_index, lse)
        grad_hidden, grad_weight = backward_grads(
            hidden, weight, local, lse, mean, a, b, ctx.temperature, ctx.needs_input_grad[1]
        )
        grad_hidden = grad_hidden.float() if grad_hidden.dtype != torch.float64 else grad_hidden
        dist.all_reduce(grad_hidden, group=ctx.group)
        return grad_hidden.to(hidden.dtype), grad_weight, None, None, None, None, None
