"""The last stage's heads: vocab-parallel logprobs/entropy of response tokens, and critic values.

The LM head stays sharded over the tensor-parallel group: each rank scores its rows of the vocabulary
against the hidden states and only per-token statistics are all-reduced (rlx/kernels, the same fused
computation the FSDP path runs), so [tokens, vocab] logits never exist. Padding rows of the vocabulary
are left out. The Triton kernels run on CUDA ('auto'; per shard when tensor parallel), chunked PyTorch
elsewhere.
"""

from __future__ import annotations

import torch

from rlx.backends.megatron.parallel import MegatronContext
from rlx.kernels.logprob_entropy import logprob_entropy, resolve_impl, vocab_parallel_logprob_entropy
from rlx.logprobs import PackedRows, unpack_responses
from rlx.models.megatron.model import output_weight


def vocab_shard(model, ctx: MegatronContext, vocab_size: int) -> tuple[torch.Tensor, int]:
    """(this rank's real vocabulary rows of the LM head [V_local, H], index of its first row)."""
    weight = output_weight(model)
    rows = weight.shape[0]
    start = ctx.tp_rank * rows
    return weight[: max(0, min(rows, vocab_size - start))], start


def head_logprobs(
    model,
    ctx: MegatronContext,
    hidden: torch.Tensor,
    rows: PackedRows,
    shape: torch.Size,
    vocab_size: int,
    temperature: float,
    dtype: torch.dtype,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [T, 1, H] of a packed row -> (logprobs [B, R], entropy [B, R]) float32 at the response tokens."""
    keep = rows.keep
    picked_hidden = hidden[keep, 0]
    compute = dtype if dtype != torch.float32 else picked_hidden.dtype
    weight, start = vocab_shard(model, ctx, vocab_size)
    targets = rows.local_targets[keep]
    if ctx.tp_degree == 1:
        logp, entropy = logprob_entropy(
            picked_hidden.to(compute), weight.to(compute), targets, temperature, impl=resolve_impl(impl, hidden.device)
        )
    else:
        logp, entropy = vocab_parallel_logprob_entropy(
            picked_hidden.to(compute), weight.to(compute), targets, start, ctx.tp_group, temperature, impl=impl
        )
    width = rows.local_targets.shape
    full_logp = logp.float().new_zeros(width).index_put((keep,), logp.float())
    full_entropy = entropy.float().new_zeros(width).index_put((keep,), entropy.float())
    return unpack_responses(full_logp, rows, shape), unpack_responses(full_entropy, rows, shape)


def head_values(model, hidden: torch.Tensor, rows: PackedRows, shape: torch.Size) -> torch.Tensor:
    """hidden [T, 1, H] -> a critic's values [B, R] float32 (V of the state before each response token)."""
    values = model.value_head(hidden[:, 0])  # [T]
    return unpack_responses(values, rows, shape)
