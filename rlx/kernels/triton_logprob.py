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

from rlx.kernels.logprob_math import acc_dtype, row_grads
from rlx.kernels.triton_logprob_kernels import (
    backward_dlogits_kernel,
    dlogits_from_logits_kernel,
    forward_stats_kernel,
    stats_from_logits_kernel,
)

TILES_PER_PROGRAM = 8
BWD_CHUNK_BYTES = 512 * 2**20
DEFAULT_BLOCKS = (128, 128, 64, 8, 3)


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
    forward_stats_kernel[grid](
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
        stats_from_logits_kernel[(triton.cdiv(n, _ELEMENTWISE_N), groups)](
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
        dlogits_from_logits_kernel[grid](
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
        backward_dlogits_kernel[grid](
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
