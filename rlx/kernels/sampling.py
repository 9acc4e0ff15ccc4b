"""Inverse-CDF token draws on the GPU in one Triton kernel (sampling.py's `draw_tokens` on CUDA).

For each row of temperature-scaled (and filtered) logits x [V] and a uniform u in [0, 1) the kernel returns
the first token t with cumsum(exp(x - max))[t] > u * sum(exp(x - max)) (the float64 reference's rule,
`searchsorted(cdf, u * cdf[-1], right=True)`), the row's first argmax, and its logsumexp. One program per
row, two passes over the row in float32 (max and sum; then the running sum until the target): a row's result
depends on that row only, not on the batch it is in. A target that rounding puts past the last token gives
the argmax (as the reference does).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

CHUNK = 4096


@functools.lru_cache(maxsize=1)
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def _draw_kernel(x_ptr, u_ptr, tok_ptr, arg_ptr, lse_ptr, scale, vocab, stride_x, CHUNK: tl.constexpr):
        row = tl.program_id(0)
        base = x_ptr + row.to(tl.int64) * stride_x
        offs = tl.arange(0, CHUNK)
        m = tl.full([], float("-inf"), tl.float32)
        s = tl.zeros([], tl.float32)
        best = tl.full([], float("-inf"), tl.float32)
        best_i = tl.zeros([], tl.int32)
        for start in range(0, vocab, CHUNK):
            x = tl.load(base + start + offs, mask=start + offs < vocab, other=float("-inf")).to(tl.float32) * scale
            chunk_max = tl.max(x, 0)
            chunk_arg = tl.min(tl.where(x == chunk_max, start + offs, 2147483647), 0)
            better = chunk_max > best  # strictly: the first index wins ties across chunks
            best_i = tl.where(better, chunk_arg, best_i)
            best = tl.where(better, chunk_max, best)
            m_new = tl.maximum(m, chunk_max)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), 0)
            m = m_new
        target = tl.load(u_ptr + row).to(tl.float32) * s
        run = tl.zeros([], tl.float32)
        token = tl.full([], 2147483647, tl.int32)
        for start in range(0, vocab, CHUNK):
            x = tl.load(base + start + offs, mask=start + offs < vocab, other=float("-inf")).to(tl.float32) * scale
            p = tl.exp(x - m)
            cdf = run + tl.cumsum(p, 0)
            hit = tl.min(tl.where((cdf > target) & (start + offs < vocab), start + offs, 2147483647), 0)
            token = tl.minimum(token, hit)
            run = run + tl.sum(p, 0)
        token = tl.where(token == 2147483647, best_i, token)
        tl.store(tok_ptr + row, token.to(tl.int64))
        tl.store(arg_ptr + row, best_i.to(tl.int64))
        tl.store(lse_ptr + row, m + tl.log(s))

    return _draw_kernel


def draw_tokens_triton(
    logits: torch.Tensor, uniforms: torch.Tensor, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(draws [B] int64, argmax [B] int64, logsumexp [B] float32) of x = float32(logits) * float32(scale),
    logits [B, V] any float dtype on CUDA, uniforms [B] in [0, 1) (any device / float dtype); no host sync.

    x is what PyTorch's CUDA `logits.float() / t` gives for scale = 1 / t (it multiplies by the float32
    reciprocal), so the native engine passes its bf16 logits and 1 / temperature and reads them once, not
    three times, while drawing what the hf engine draws from its float32 scaled logits."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    batch, vocab = logits.shape
    u = uniforms.to(logits.device, torch.float32, non_blocking=True).contiguous()
    tokens = torch.empty(batch, dtype=torch.int64, device=logits.device)
    argmax = torch.empty_like(tokens)
    lse = torch.empty(batch, dtype=torch.float32, device=logits.device)
    if batch:
        _kernel()[(batch,)](logits, u, tokens, argmax, lse, scale, vocab, logits.stride(0), CHUNK=CHUNK, num_warps=8)
    return tokens, argmax, lse
