"""Inverse-CDF token draws on the GPU in two Triton kernels (sampling.py's `draw_tokens` on CUDA).

For each row of temperature-scaled (and filtered) logits x [V] and a uniform u in [0, 1) the kernels return
the first token t with cumsum(exp(x - max))[t] > u * sum(exp(x - max)) (the float64 reference's rule,
`searchsorted(cdf, u * cdf[-1], right=True)`), the row's first argmax, and its logsumexp, in float32:

- `_slice_kernel`, a program per row and vocabulary slice of SLICE tokens: the slice's max, its sum of
  exp(x - max) and of exp(x - max) * (x - max), and its first argmax;
- `_pick_kernel`, a program per row: the row's max, argmax, normaliser and entropy from its slices; the slice in
  which the cumulative sum passes the target; then a scan of that slice alone for the token.

So a decode step reads its logits about once, spread over every multiprocessor, where one program per row read
them twice (at 16 rows: 16 programs over 151,936 tokens each). A row's result depends on that row only (the
slices are fixed, not sized by the batch). A target that rounding puts past a slice's last token gives that
token, past the row's last one the argmax (as the reference does).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

SLICE = 8192
"""Tokens per program of the first kernel (and the most the second one scans)."""
CHUNK = 2048
_NONE = 2147483647


@functools.lru_cache(maxsize=1)
def _kernels() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def _slice_kernel(
        x_ptr, m_ptr, s_ptr, a_ptr, w_ptr, scale, vocab, stride_x, SLICE: tl.constexpr, PAD: tl.constexpr,
        SCALE_PTR: tl.constexpr,
    ):  # fmt: skip
        row, part = tl.program_id(0), tl.program_id(1)
        if SCALE_PTR:  # noqa: SIM108 (the factor in device memory: a CUDA graph's input; else the argument itself)
            factor = tl.load(scale)
        else:
            factor = scale
        offs = part * SLICE + tl.arange(0, SLICE)
        x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=offs < vocab, other=float("-inf"))
        x = x.to(tl.float32) * factor
        m = tl.max(x, 0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        out = row * PAD + part
        p = tl.exp(x - m_safe)
        tl.store(m_ptr + out, m)
        tl.store(s_ptr + out, tl.sum(p, 0))
        tl.store(a_ptr + out, tl.min(tl.where(x == m, offs, 2147483647), 0))
        tl.store(w_ptr + out, tl.sum(tl.where(p > 0, p * (x - m_safe), 0.0), 0))  # for the entropy

    @triton.jit
    def _pick_kernel(
        x_ptr, u_ptr, m_ptr, s_ptr, a_ptr, w_ptr, tok_ptr, arg_ptr, lse_ptr, ent_ptr, scale, vocab, stride_x, slices,
        SLICE: tl.constexpr, CHUNK: tl.constexpr, PAD: tl.constexpr, SCALE_PTR: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        if SCALE_PTR:  # noqa: SIM108 (a constexpr branch: Triton compiles the one taken)
            factor = tl.load(scale)
        else:
            factor = scale
        j = tl.arange(0, PAD)
        valid = j < slices
        m = tl.load(m_ptr + row * PAD + j, mask=valid, other=float("-inf"))
        top = tl.max(m, 0)
        top_safe = tl.where(top == float("-inf"), 0.0, top)
        weight = tl.load(s_ptr + row * PAD + j, mask=valid, other=0.0) * tl.exp(m - top_safe)
        total = tl.sum(weight, 0)
        # the slices' argmaxes grow with j: the first slice at the max holds the row's first argmax
        best = tl.min(tl.where(valid & (m == top), tl.load(a_ptr + row * PAD + j, mask=valid, other=0), 2147483647), 0)
        target = tl.load(u_ptr + row).to(tl.float32) * total
        cum = tl.cumsum(weight, 0)
        found = tl.min(tl.where(valid & (cum > target), j, PAD), 0)  # the slice the target lies in (PAD: none)
        run = tl.sum(tl.where(j < found, weight, 0.0), 0)
        first = tl.minimum(found, slices - 1) * SLICE
        base = x_ptr + row.to(tl.int64) * stride_x
        token = tl.full([], 2147483647, tl.int32)
        last = tl.full([], -1, tl.int32)
        for start in range(0, SLICE, CHUNK):
            offs = first + start + tl.arange(0, CHUNK)
            inside = offs < vocab
            p = tl.exp(tl.load(base + offs, mask=inside, other=float("-inf")).to(tl.float32) * factor - top_safe)
            cdf = run + tl.cumsum(p, 0)
            token = tl.minimum(token, tl.min(tl.where(inside & (cdf > target), offs, 2147483647), 0))
            last = tl.maximum(last, tl.max(tl.where(inside & (p > 0), offs, -1), 0))
            run += tl.sum(p, 0)
        token = tl.where(token == 2147483647, last, token)  # rounding put the target past the slice's last token
        token = tl.where((found == PAD) | (token < 0), best, token)
        tl.store(tok_ptr + row, token.to(tl.int64))
        tl.store(arg_ptr + row, best.to(tl.int64))
        tl.store(lse_ptr + row, top + tl.log(total))
        # entropy = log(total) - sum(p * (x - top)) / total, each slice's sum of p * (x - m) moved to the row's max
        scaled = tl.exp(m - top_safe)
        moved = tl.load(w_ptr + row * PAD + j, mask=valid, other=0.0) + (m - top_safe) * tl.load(
            s_ptr + row * PAD + j, mask=valid, other=0.0)  # fmt: skip
        spread = tl.sum(tl.where(valid & (scaled > 0), moved * scaled, 0.0), 0)
        tl.store(ent_ptr + row, tl.log(total) - spread / total)

    return _slice_kernel, _pick_kernel


def draw_tokens_triton(
    logits: torch.Tensor, uniforms: torch.Tensor, scale: float | torch.Tensor = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(draws [B] int64, argmax [B] int64, logsumexp [B] float32, entropy [B] float32 of softmax(x)) of
    x = float32(logits) * float32(scale),
    logits [B, V] any float dtype on CUDA (or the CPU under TRITON_INTERPRET=1), uniforms [B] in [0, 1) (any
    device / float dtype); no host sync. `scale`: a float, or a float32 tensor of one element on the logits'
    device, read by the kernels (so a CUDA graph captured with it draws at whatever temperature it holds when
    replayed; the same bits as the float).

    x is what PyTorch's CUDA `logits.float() / t` gives for scale = 1 / t (it multiplies by the float32
    reciprocal), so the native engine passes its bf16 logits and 1 / temperature and reads them once, not
    three times, while drawing what the hf engine draws from its float32 scaled logits."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    batch, vocab = logits.shape
    u = uniforms.to(logits.device, torch.float32, non_blocking=True).contiguous()
    out = torch.empty(2, batch, dtype=torch.int64, device=logits.device)  # draws, argmax
    stats = torch.empty(2, batch, dtype=torch.float32, device=logits.device)  # logsumexp, entropy
    if batch:
        slices = -(-vocab // SLICE)
        pad = 1 << max(0, slices - 1).bit_length()
        parts = torch.empty(
            4, batch, pad, dtype=torch.float32, device=logits.device
        )  # max, sum, argmax (bits), sum p*x
        part_m, part_s, part_a, part_w = parts[0], parts[1], parts[2].view(torch.int32), parts[3]
        first, second = _kernels()
        from_ptr = isinstance(scale, torch.Tensor)
        first[(batch, slices)](
            logits, part_m, part_s, part_a, part_w, scale, vocab, logits.stride(0), SLICE=SLICE, PAD=pad,
            SCALE_PTR=from_ptr,
        )  # fmt: skip
        second[(batch,)](
            logits, u, part_m, part_s, part_a, part_w, out[0], out[1], stats[0], stats[1], scale, vocab,
            logits.stride(0), slices, SLICE=SLICE, CHUNK=CHUNK, PAD=pad, SCALE_PTR=from_ptr, num_warps=4,
        )  # fmt: skip
    return out[0], out[1], stats[0], stats[1]


def picked_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, scale: float | torch.Tensor, lse: torch.Tensor
) -> torch.Tensor:
    """The logprob [B] float32 of each row's token under float32(logits) * scale, given the row's logsumexp `lse`
    from `draw_tokens_triton` (the native engine's sampler and exact mode's trainer alike: the same ops, the same
    bits; `scale` a float or a float32 tensor of one element, as there)."""
    return logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).float() * scale - lse
