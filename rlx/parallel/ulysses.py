"""Ulysses sequence parallelism for packed rows of Hugging Face causal LMs (DeepSpeed-Ulysses, as in verl).

The `sp` ranks of a sequence-parallel process group each hold a contiguous slice `[1, T/sp]` of one
packed row (T padded up to a multiple of sp; the padding forms its own dummy sample, so it never
attends to real tokens). Everything but attention is per token. Around attention, an all-to-all
trades the sequence shard for a head shard:

    q/k/v [1, H, T/sp, D] --all-to-all--> [1, H/sp, T, D] --packed attention (full cu_seqlens)-->
    [1, T, H/sp, D] --all-to-all--> [1, T/sp, H, D]

The attention function "rlx_ulysses" is registered with transformers' `AttentionInterface`; the group
and the full row's cu_seqlens reach it as model kwargs (`sp_group`, `cu_seq_lens_q`, `max_length_q`),
which transformers forwards to every attention call. Without `sp_group` it is plain "rlx_varlen"
attention, so one model serves SP=1 and SP>1. GQA: key/value heads are scattered like query heads
when sp divides them, else repeated up to sp (whole heads per rank).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from rlx.errors import UserError
from rlx.models.attention import (
    PackedBatch,
    packed_attention_forward,
    packed_attention_mask,
    register_attention,
    repeat_kv_heads,
    set_attention,
    varlen_attention,
)
from rlx.models.vision.packing import set_decoder_attention

ULYSSES_ATTENTION = "rlx_ulysses"


def validate_sp(config, sp_degree: int) -> None:
    """Raise UserError unless `sp_degree` ranks can split the model's attention heads into whole heads."""
    if hasattr(config, "get_text_config"):  # multimodal configs keep the decoder's under text_config
        config = config.get_text_config()
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    if sp_degree < 1:
        raise UserError(f"sp_degree must be at least 1, got {sp_degree}")
    if num_heads % sp_degree:
        raise UserError(
            f"sequence parallelism: the model's {num_heads} attention heads are not divisible by sp_degree={sp_degree}"
        )
    if num_kv_heads % sp_degree and sp_degree % num_kv_heads:
        raise UserError(
            f"sequence parallelism: the model's {num_kv_heads} key/value heads neither divide nor are divisible by "
            f"sp_degree={sp_degree}"
        )


def _all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split `x` into sp chunks along `scatter_dim`, send chunk j to rank j, concatenate what arrives
    (in rank order) along `gather_dim`."""
    size = dist.get_world_size(group)
    if x.shape[scatter_dim] % size:
        raise ValueError(
            f"all_to_all: dim {scatter_dim} of size {x.shape[scatter_dim]} does not split over {size} ranks"
        )
    sent = torch.stack(x.chunk(size, dim=scatter_dim)).contiguous()  # [sp, *chunk]
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """`_all_to_all` with autograd: the backward is the inverse all-to-all of the gradient."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad.contiguous(), ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Differentiable all-to-all: e.g. [1, H, T/sp, D] with scatter_dim=1, gather_dim=2 -> [1, H/sp, T, D]."""
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence dim; the backward keeps this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, dim=1)[rank].contiguous(), None


def gather_sequence(local: torch.Tensor, group) -> torch.Tensor:
    """[1, T/sp, ...] on each rank -> [1, T, ...] on every rank, in rank order.

    The backward returns this rank's slice of the incoming gradient: right when every rank computes the
    same loss from the gathered tensor (each token's gradient then flows back once, on its owner rank).
    """
    return _GatherSequence.apply(local, group)


def ulysses_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    sp_group=None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The "rlx_ulysses" attention function (transformers' signature).

    query [1, H, T/sp, D], key/value [1, Hkv, T/sp, D] (this rank's slice) -> (attn_output [1, T/sp, H, D], None).
    `cu_seq_lens_q` [n+1] and `max_length_q` describe the FULL padded row of T tokens.
    """
    if sp_group is None:  # traced by torch.compile where packed attention is (a compiled layer stays one graph)
        return packed_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
            sliding_window=sliding_window, cu_seq_lens_q=cu_seq_lens_q, max_length_q=max_length_q, **kwargs,
        )  # fmt: skip
    return _all_to_all_attention(
        module, query, key, value, attention_mask, dropout, scaling, is_causal, sliding_window, sp_group,
        cu_seq_lens_q, max_length_q, **kwargs,
    )  # fmt: skip


@torch.compiler.disable  # collectives and data-dependent sample boundaries: a graph break, not a traced graph
def _all_to_all_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout,
    scaling,
    is_causal,
    sliding_window,
    sp_group,
    cu_seq_lens_q,
    max_length_q,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if dist.get_world_size(sp_group) == 1:
        return packed_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
            sliding_window=sliding_window, cu_seq_lens_q=cu_seq_lens_q, max_length_q=max_length_q, **kwargs,
        )  # fmt: skip
    if attention_mask is not None or query.shape[0] != 1 or cu_seq_lens_q is None:
        raise ValueError(f"{ULYSSES_ATTENTION} takes one packed row and its full cu_seq_lens_q, without a mask")
    size = dist.get_world_size(sp_group)
    if key.shape[1] < size:  # whole kv heads per rank: repeat them up to sp
        key, value = repeat_kv_heads(key, size, dim=1), repeat_kv_heads(value, size, dim=1)
    # [1, H, T/sp, D] -> [1, H/sp, T, D]: this rank's heads over the full row
    q, k, v = (all_to_all(t, sp_group, scatter_dim=1, gather_dim=2) for t in (query, key, value))
    q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))  # [T, H/sp, D]
    if max_length_q is None:
        max_length_q = cu_seq_lens_q.diff().max()
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = varlen_attention(
        q, k, v, cu_seq_lens_q, int(max_length_q), scale=scaling, dropout=dropout, is_causal=is_causal,
        sliding_window=sliding_window,
    )  # fmt: skip
    # [1, T, H/sp, D] -> [1, T/sp, H, D]: this rank's tokens with all heads
    return all_to_all(out.unsqueeze(0), sp_group, scatter_dim=1, gather_dim=2), None


def enable_ulysses_attention(model, decoder_only: bool = False) -> None:
    """Register "rlx_ulysses" and switch `model` to it (pass `sp_group` etc. per call: `sequence_parallel_forward`);
    `decoder_only`: a vision-language model's decoder only (its vision tower keeps sdpa / flash attention per image,
    see rlx.models.vision.packing)."""
    register_attention(ULYSSES_ATTENTION, ulysses_attention_forward, packed_attention_mask)
    if decoder_only:
        set_decoder_attention(model, ULYSSES_ATTENTION)
    else:
        set_attention(model, ULYSSES_ATTENTION)


class SequenceShard(NamedTuple):
    """This rank's slice of a packed row under sequence parallelism."""

    input_ids: torch.Tensor
    """[1, T_pad/sp] int64."""
    position_ids: torch.Tensor
    """[1, T_pad/sp] int64: positions within each sample (the padding counts 0, 1, ... as its own sample)."""
    cu_seqlens: torch.Tensor
    """[n+1] or [n+2] int32: the FULL padded row's sequence starts (the padding as one more sample)."""
    total_len: int
    """T_pad: T rounded up to a multiple of sp."""


def padded_length(length: int, sp_degree: int) -> int:
    """`length` rounded up to a multiple of `sp_degree`."""
    return -(-length // sp_degree) * sp_degree


def slice_sequence(values: torch.Tensor, sp_rank: int, sp_degree: int, pad_value=0) -> torch.Tensor:
    """[1, T, ...] per-token values of a packed row -> this rank's [1, T_pad/sp, ...] (padded with `pad_value`),
    the same slicing `shard_packed` applies to the ids: use it for targets, masks, advantages."""
    length = values.shape[1]
    pad = padded_length(length, sp_degree) - length
    if pad:
        filler = values.new_full((1, pad, *values.shape[2:]), pad_value)
        values = torch.cat([values, filler], dim=1)
    return values.chunk(sp_degree, dim=1)[sp_rank]


def shard_packed(packed: PackedBatch, sp_rank: int, sp_degree: int, pad_id: int = 0) -> SequenceShard:
    """A packed row -> this rank's SequenceShard (local ids/positions [1, T_pad/sp], full cu_seqlens, T_pad)."""
    total = padded_length(packed.total_len, sp_degree)
    pad = total - packed.total_len
    cu_seqlens = packed.cu_seqlens
    positions = packed.position_ids
    if pad:
        cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_tensor([total])])
        positions = torch.cat([positions, torch.arange(pad, device=positions.device).unsqueeze(0)], dim=1)
    return SequenceShard(
        slice_sequence(packed.input_ids, sp_rank, sp_degree, pad_id),
        positions.chunk(sp_degree, dim=1)[sp_rank],
        cu_seqlens,
        total,
    )


def group_rank_size(group) -> tuple[int, int]:
    """(rank, size) within a sequence-parallel group ((0, 1) for None: the whole row on this rank)."""
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def sequence_parallel_inputs(packed: PackedBatch, group=None) -> dict:
    """Model kwargs for this rank's slice [1, T_pad/sp] of a packed row, with the full row's sequence
    lengths (and the group, which switches "rlx_ulysses" attention to its all-to-all form)."""
    rank, size = group_rank_size(group)
    shard = shard_packed(packed, rank, size)
    max_len = max(packed.max_len, shard.total_len - packed.total_len)  # the padding forms its own sample
    inputs = {
        "input_ids": shard.input_ids,
        "position_ids": shard.position_ids,
        "use_cache": False,
        "cu_seq_lens_q": shard.cu_seqlens,
        "cu_seq_lens_k": shard.cu_seqlens,
        "max_length_q": max_len,
        "max_length_k": max_len,
    }
    if size > 1:
        inputs["sp_group"] = group
    return inputs


def sequence_parallel_forward(
    model, packed: PackedBatch, group=None, *, return_hidden: bool = False, gather: bool = True
) -> torch.Tensor:
    """Run `model` (switched by `enable_ulysses_attention`) on a packed row split over the ranks of `group`.

    Returns logits [1, T, V] (or the backbone's last hidden states [1, T, H] with `return_hidden`) of the
    whole row on every rank; with `gather=False`, this rank's slice [1, T_pad/sp, ...] (see `slice_sequence`
    for slicing targets alike). `group=None` runs the whole row on this rank. `packed` is on the model's device.
    """
    validate_sp(model.config, group_rank_size(group)[1])
    inputs = sequence_parallel_inputs(packed, group)
    if return_hidden:
        out = getattr(model, model.base_model_prefix)(**inputs).last_hidden_state
    else:
        out = model(**inputs).logits
    if not gather:
        return out
    if group_rank_size(group)[1] > 1:
        out = gather_sequence(out, group)
    return out[:, : packed.total_len]
