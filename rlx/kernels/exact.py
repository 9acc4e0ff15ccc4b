"""Batch-invariant arithmetic for exact mode: each token's result is computed with reductions whose order does not
depend on how many other tokens share its call, where it sits among them, or which cache holds its context.

Three schemes, all plain PyTorch (the same code on CPU and CUDA):

- GEMMs (`blocked_linear`): the rows are cut into blocks of exactly `ROW_BLOCK` rows (the last one zero-padded),
  so every call has the same shape, hence the same kernel and the same reduction order over K for every row (a
  row's result is measured not to depend on its position within the block: tests/stages/test_exact.py).
- Reductions over a row (`tree_sum`; RMSNorm, log-softmax): elementwise additions only, halving a zero-padded
  power-of-two width, so a fixed pairwise order whatever the other dimensions are. A max needs no care (exact).
- Attention (`blocked_attention`): for each query, its keys in blocks of `KEY_BLOCK` aligned at position 0, taken
  in block order and merged with an online softmax; dot products and the value sum are `tree_sum`s. A query at
  position t performs the same arithmetic whether its keys come from a paged KV cache or from the same forward.

Transcendental functions go through `pointwise`: on the CPU, PyTorch's vectorised loops hand the elements after the
last full vector to a scalar function that may round differently, so the input is padded to a multiple of
`_CPU_VECTOR` elements and no element of interest takes the scalar path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

ROW_BLOCK = 64
"""Rows per GEMM call (every call has exactly this many rows)."""
KEY_BLOCK = 64
"""Keys per attention block (blocks aligned at position 0). 64 on every device: the trainer's forward and the engine
must sum in the same blocks. bench/exact_attention.py on an H200 (bench/RESULTS.md, "Exact", sixteenth session):
a 0.5B decode step's attention 16.0 us against 18.7 with blocks of 32, a 32,768-token micro-batch 0.72 ms against
0.83."""
_CPU_VECTOR = 64  # elements: a multiple of every CPU vector loop's stride (two AVX-512 float32 vectors and more)


def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`fn(x)` for an elementwise `fn`, every element on the vectorised path (CPU: input padded to whole vectors)."""
    if x.device.type != "cpu":
        return fn(x)
    flat = x.reshape(-1)
    pad = (-flat.numel()) % _CPU_VECTOR
    out = fn(F.pad(flat, (0, pad)) if pad else flat)
    return (out[: flat.numel()] if pad else out).view(x.shape)


def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over `dim` in a fixed pairwise order made of elementwise additions (the dimension is dropped)."""
    x = x.movedim(dim, -1)
    width = x.shape[-1]
    full = 1 << max(width - 1, 0).bit_length()
    if full != width:
        x = F.pad(x, (0, full - width))  # x + 0 == x: the padding changes no sum
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def blocked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` over the flattened rows of x [..., K] in calls of exactly ROW_BLOCK rows.  -> [..., N]."""
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    # a fresh buffer: every block starts at the same alignment (GEMM libraries may pick kernels by pointer alignment)
    padded = torch.cat([rows, rows.new_zeros(-(-max(count, 1) // ROW_BLOCK) * ROW_BLOCK - count, rows.shape[1])])
    out = torch.cat([F.linear(block, weight, bias) for block in padded.split(ROW_BLOCK)])
    return out[:count].view(*x.shape[:-1], out.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Llama-family RMSNorm (float32 statistics, weight times the result in x's dtype) with a `tree_sum`."""
    h = x.float()
    variance = tree_sum(h * h, -1) / h.shape[-1]
    h = h * pointwise(torch.rsqrt, variance + eps).unsqueeze(-1)
    return weight * h.to(x.dtype)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dimension (float32 in, float32 out) with a fixed-order normaliser."""
    shifted = logits - logits.amax(-1, keepdim=True)
    total = tree_sum(pointwise(torch.exp, shifted), -1)
    return shifted - pointwise(torch.log, total).unsqueeze(-1)


def entropy_from_log_probs(log_probs: torch.Tensor) -> torch.Tensor:
    """-sum p log p over the last dimension, in a fixed order."""
    return -tree_sum(pointwise(torch.exp, log_probs) * log_probs, -1)


def target_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool = False, chunk_rows: int = 1024
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logprob of each target, entropy or None) float32 for logits [..., V] and targets [...], with `log_softmax`,
    `chunk_rows` rows at a time (every operation is per row: the chunking changes no value). Under autograd each
    chunk is recomputed in the backward rather than keeping its [rows, V] intermediates."""
    flat, picks = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1, 1)
    grad = torch.is_grad_enabled() and flat.requires_grad
    parts = []
    for rows, wanted in zip(flat.split(chunk_rows), picks.split(chunk_rows)):
        if grad:
            parts.append(checkpoint(_chunk_logprobs, rows, wanted, temperature, with_entropy, use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(rows, wanted, temperature, with_entropy))
    picked = torch.cat([p[0] for p in parts]).view(targets.shape) if parts else flat.new_zeros(targets.shape)
    entropy = None
    if with_entropy:
        entropy = torch.cat([p[1] for p in parts]).view(targets.shape) if parts else flat.new_zeros(targets.shape)
    return picked.float(), entropy if entropy is None else entropy.float()


def _chunk_logprobs(rows, wanted, temperature: float, with_entropy: bool):
    log_probs = log_softmax(rows.float() / temperature)
    picked = log_probs.gather(-1, wanted).squeeze(-1)
    return picked, entropy_from_log_probs(log_probs) if with_entropy else picked


def key_slots(rows: torch.Tensor, tables: torch.Tensor, block_size: int, width: int) -> torch.Tensor:
    """[N, width] int64: the flat cache slot of key positions 0..width-1 of each query's sequence (`rows`: its row of
    the block tables [B, max_blocks]); positions past a table's end point at its last block (masked anyway)."""
    positions = torch.arange(width, device=tables.device)
    blocks = (positions // block_size).clamp(max=tables.shape[1] - 1)
    return tables.long()[rows][:, blocks] * block_size + positions % block_size


def blocked_attention(
    q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # fmt: skip
    """Causal attention of each query over its own keys, batch-invariantly.

    q [N, H, D]; k_store [S, Hkv, D], v_store [S, Hkv, Dv] (H a multiple of Hkv); slots [N, L] int64 (L a multiple of
    KEY_BLOCK): the store row of each query's key positions; lengths [N]: keys each query sees (its position + 1).
    -> [N, H, Dv] in q's dtype, computed in float32."""
    n, heads, dim = q.shape
    kv_heads, group = k_store.shape[1], heads // k_store.shape[1]
    qf = q.float().view(n, 1, kv_heads, group, dim)
    lengths = lengths.to(q.device).long().clamp(min=1)
    m = q.new_full((n, kv_heads, group), float("-inf"), dtype=torch.float32)
    total = torch.zeros_like(m)
    acc = q.new_zeros((n, kv_heads, group, v_store.shape[-1]), dtype=torch.float32)
    offsets = torch.arange(KEY_BLOCK, device=q.device)
    last = int(lengths.max()) if n else 0  # blocks past every query add exactly nothing: skip them
    for start in range(0, min(slots.shape[1], last), KEY_BLOCK):
        idx = slots[:, start : start + KEY_BLOCK]  # [N, KB]
        valid = (start + offsets < lengths[:, None])[:, :, None, None]  # [N, KB, 1, 1]
        k = k_store[idx].float()  # [N, KB, Hkv, D]
        v = torch.where(valid, v_store[idx].float(), 0.0)
        scores = tree_sum(qf * k.unsqueeze(3), -1) * scale  # [N, KB, Hkv, G]
        scores = torch.where(valid, scores, float("-inf"))
        m_new = torch.maximum(m, scores.amax(1))
        alpha = pointwise(torch.exp, m - m_new)  # 1 exactly where the block changes nothing
        p = pointwise(torch.exp, scores - m_new.unsqueeze(1))
        total = total * alpha + tree_sum(p, 1)
        acc = acc * alpha.unsqueeze(-1) + tree_sum(p.unsqueeze(-1) * v.unsqueeze(3), 1)
        m = m_new
    return (acc / total.unsqueeze(-1)).view(n, heads, -1).to(q.dtype)
