"""Per-token logprob of a target token and entropy of the softmax, straight from hidden states.

    logits = hidden @ weight.T / temperature         [N, V]  (never materialised whole)
    logprob[n] = logits[n, target[n]] - logsumexp(logits[n])
    entropy[n] = logsumexp(logits[n]) - sum_v softmax(logits[n])_v * logits[n, v]

Implementations (same math, same autograd contract; gradients for hidden and weight):
- `naive`: the full [N, V] float32 logits; the reference.
- `chunked`: PyTorch over vocabulary chunks with an online log-sum-exp; memory O(N x chunk).
- `triton`: Triton kernels that fuse the logits matmul with the online statistics (forward) and
  with the gradient of the logits (backward); see rlx/kernels/triton_logprob.py.

Backward, with upstream gradients a = dL/dlogprob and b = dL/dentropy per row and p = softmax:
    dL/dlogits[n, v] = a[n] (1[v = target] - p[n, v]) - b[n] p[n, v] (logits[n, v] - E_p[logits[n]])
    dL/dhidden = dlogits @ weight / T,   dL/dweight = dlogits.T @ hidden / T
Rows whose target is `ignore_index` get logprob 0, entropy 0 and no gradient.
"""

from __future__ import annotations

import torch

from rlx.kernels.logprob_math import acc_dtype, row_grads

IGNORE_INDEX = -100
IMPLS = ("auto", "naive", "chunked", "triton")
DEFAULT_CHUNK_BYTES = 512 * 2**20


def _chunk_size(n: int, vocab: int, chunk: int | None) -> int:
    if chunk:
        return chunk
    return max(256, min(vocab, DEFAULT_CHUNK_BYTES // max(4 * n, 1)))


def naive_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: materialise float32 logits [N, V].  Returns (logprob [N], entropy [N]) float32."""
    logits = (hidden @ weight.T).to(acc_dtype(hidden)) / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    valid = targets != ignore_index
    safe = torch.where(valid, targets, torch.zeros_like(targets))
    logprob = log_probs.gather(-1, safe.unsqueeze(-1)).squeeze(-1) * valid
    entropy = -(log_probs.exp() * log_probs).sum(-1) * valid
    return logprob, entropy


def online_stats(hidden, weight, targets, temperature, chunk, vocab_start: int = 0):
    """One pass over vocabulary chunks of `weight` (rows vocab_start ...): per-row running max m, sum of
    exp(z - m) s, sum of exp(z - m) * z t, and the target's logit (0 when the target is elsewhere)."""
    n, vocab, dtype = hidden.shape[0], weight.shape[0], acc_dtype(hidden)
    m = torch.full((n,), float("-inf"), device=hidden.device, dtype=dtype)
    s = torch.zeros(n, device=hidden.device, dtype=dtype)
    t = torch.zeros(n, device=hidden.device, dtype=dtype)
    target_logit = torch.zeros(n, device=hidden.device, dtype=dtype)
    for lo in range(0, vocab, chunk):
        z = (hidden @ weight[lo : lo + chunk].T).to(dtype) / temperature  # [N, c]
        m_new = torch.maximum(m, z.max(dim=-1).values)
        e = torch.exp(z - m_new.unsqueeze(-1))
        scale = torch.exp(m - m_new)
        s = s * scale + e.sum(-1)
        t = t * scale + (e * z).sum(-1)
        m = m_new
        first = vocab_start + lo
        inside = (targets >= first) & (targets < first + z.shape[1])
        local = torch.where(inside, targets - first, torch.zeros_like(targets))
        target_logit += torch.where(inside, z.gather(-1, local.unsqueeze(-1)).squeeze(-1), torch.zeros_like(m))
    return m, s, t, target_logit


def chunked_grads(
    hidden, weight, targets, lse, mean, a, b, temperature, chunk, need_weight_grad: bool, vocab_start: int = 0
):
    """(dhidden in the accumulation dtype, dweight) over vocabulary chunks, recomputing chunk logits."""
    dtype = lse.dtype
    grad_hidden = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device)
    grad_weight = torch.empty_like(weight) if need_weight_grad else None
    for lo in range(0, weight.shape[0], chunk):
        w = weight[lo : lo + chunk]
        z = (hidden @ w.T).to(dtype) / temperature
        p = torch.exp(z - lse.unsqueeze(-1))
        dz = -p * (a.unsqueeze(-1) + b.unsqueeze(-1) * (z - mean.unsqueeze(-1)))
        first = vocab_start + lo
        rows = ((targets >= first) & (targets < first + w.shape[0])).nonzero().squeeze(-1)
        dz[rows, targets[rows] - first] += a[rows]
        dz = (dz / temperature).to(hidden.dtype)
        grad_hidden += (dz @ w).to(dtype)
        if grad_weight is not None:
            grad_weight[lo : lo + chunk] = (dz.T @ hidden).to(weight.dtype)
    return grad_hidden, grad_weight


class ChunkedLogprobEntropy(torch.autograd.Function):
    """PyTorch implementation over vocabulary chunks; forward and backward each recompute chunk logits."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, ignore_index, chunk):
        chunk = _chunk_size(hidden.shape[0], weight.shape[0], chunk)
        valid = targets != ignore_index
        with torch.no_grad():
            m, s, t, target_logit = online_stats(hidden, weight, targets, temperature, chunk)
        lse, mean = m + torch.log(s), t / s
        ctx.save_for_backward(hidden, weight, targets, lse, mean)
        ctx.temperature, ctx.ignore_index, ctx.chunk = temperature, ignore_index, chunk
        return (target_logit - lse) * valid, (lse - mean) * valid

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        hidden, weight, targets, lse, mean = ctx.saved_tensors
        a, b = row_grads(grad_logprob, grad_entropy, targets, ctx.ignore_index, lse)
        grad_hidden, grad_weight = chunked_grads(
            hidden, weight, targets, lse, mean, a, b, ctx.temperature, ctx.chunk, ctx.needs_input_grad[1]
        )
        return grad_hidden.to(hidden.dtype), grad_weight, None, None, None, None


class VocabParallelLogprobEntropy(torch.autograd.Function):
    """The vocabulary sharded across a tensor-parallel group: each rank holds weight rows
    [vocab_start, vocab_start + V_local) and the full hidden states; only [N]-sized statistics and the
    [N, H] hidden gradient cross ranks (the full vocabulary is never gathered on one rank)."""

    @staticmethod
    def forward(ctx, hidden, weight_shard, targets, temperature, ignore_index, vocab_start, group, chunk):
        import torch.distributed as dist

        chunk = _chunk_size(hidden.shape[0], weight_shard.shape[0], chunk)
        with torch.no_grad():
            m, s, t, target_logit = online_stats(hidden, weight_shard, targets, temperature, chunk, vocab_start)
            big_m = m.clone()
            dist.all_reduce(big_m, op=dist.ReduceOp.MAX, group=group)
            scale = torch.exp(m - big_m)
            sums = torch.stack([s * scale, t * scale, target_logit])
            dist.all_reduce(sums, group=group)
        lse, mean = big_m + torch.log(sums[0]), sums[1] / sums[0]
        valid = targets != ignore_index
        ctx.save_for_backward(hidden, weight_shard, targets, lse, mean)
        ctx.temperature, ctx.ignore_index, ctx.vocab_start, ctx.group, ctx.chunk = (
            temperature,
            ignore_index,
            vocab_start,
            group,
            chunk,
        )
        return (sums[2] - lse) * valid, (lse - mean) * valid

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        import torch.distributed as dist

        hidden, weight, targets, lse, mean = ctx.saved_tensors
        a, b = row_grads(grad_logprob, grad_entropy, targets, ctx.ignore_index, lse)
        grad_hidden, grad_weight = chunked_grads(
            hidden,
            weight,
            targets,
            lse,
            mean,
            a,
            b,
            ctx.temperature,
            ctx.chunk,
            ctx.needs_input_grad[1],
            ctx.vocab_start,
        )
        dist.all_reduce(grad_hidden, group=ctx.group)
        return grad_hidden.to(hidden.dtype), grad_weight, None, None, None, None, None, None


def vocab_parallel_logprob_entropy(
    hidden: torch.Tensor,
    weight_shard: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    group=None,
    temperature: float = 1.0,
    ignore_index: int = IGNORE_INDEX,
    chunk: int | None = None,
    impl: str = "chunked",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob [N], entropy [N]) with this rank's vocabulary rows `weight_shard` starting at `vocab_start`;
    `targets` are global token ids. Identical on every rank of `group`. `impl`: 'chunked' (PyTorch) or
    'triton' (the fused kernels on the shard; 'auto' picks it on CUDA)."""
    impl = resolve_impl(impl, hidden.device)
    if impl == "triton":
        from rlx.kernels.triton_logprob import TritonVocabParallelLogprobEntropy

        return TritonVocabParallelLogprobEntropy.apply(
            hidden, weight_shard, targets, temperature, ignore_index, vocab_start, group
        )
    return VocabParallelLogprobEntropy.apply(
        hidden, weight_shard, targets, temperature, ignore_index, vocab_start, group, chunk
    )


def triton_available(device: torch.device) -> bool:
    """Triton kernels run on CUDA devices (or anywhere under TRITON_INTERPRET=1, for tests)."""
    import os

    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def resolve_impl(impl: str, device: torch.device) -> str:
    """'auto' is triton where CUDA and Triton are present, else naive (exact, fine for small vocabularies)."""
    if impl not in IMPLS:
        raise ValueError(f"unknown logprob implementation {impl!r} (valid: {', '.join(IMPLS)})")
    if impl == "auto":
        return "triton" if device.type == "cuda" and triton_available(device) else "naive"
    return impl


def logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    ignore_index: int = IGNORE_INDEX,
    impl: str = "auto",
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob [N], entropy [N]) float32 of `targets` under softmax(hidden @ weight.T / temperature).

    hidden: [N, H], weight: [V, H] (same dtype), targets: [N] int64 (ignore_index rows give 0).
    """
    impl = resolve_impl(impl, hidden.device)
    if impl == "naive":
        return naive_logprob_entropy(hidden, weight, targets, temperature, ignore_index)
    if impl == "chunked":
        return ChunkedLogprobEntropy.apply(hidden, weight, targets, temperature, ignore_index, chunk)
    from rlx.kernels.triton_logprob import TritonLogprobEntropy

    return TritonLogprobEntropy.apply(hidden, weight, targets, temperature, ignore_index, chunk)
