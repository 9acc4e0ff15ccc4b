"""Micro-batches through the pipeline stages: stage forward, point-to-point activations, GPipe order.

Every rank of a pipeline holds the same micro-batches (built from the same rows), so each stage knows
the shape of what it will receive ([T, 1, H] activations of a packed row) without asking. The order is
GPipe's: all forwards, then all backwards in reverse (activations of every micro-batch are kept until
the backward; 1F1B would bound them by the number of stages — not done yet). Activations travel in
float32. megatron-core's own schedules allocate on CUDA and are not used.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlx.engine.device import autocast
from rlx.engine.logprobs import PackedRows
from rlx.engine.megatron.parallel import MegatronContext


@dataclass
class MicroBatch:
    """One packed micro-batch as every stage sees it."""

    rows: PackedRows
    """Packing of the micro-batch's rows (on the model's device)."""
    extra: object = None
    """What the last stage's head needs besides the hidden states (tensors, the batch part, weights)."""


def packed_seq_params(rows: PackedRows):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = rows.packed.cu_seqlens.to(torch.int32)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=rows.packed.max_len,
        max_seqlen_kv=rows.packed.max_len,
    )


def stage_forward(model, rows: PackedRows, input_tensor: torch.Tensor | None) -> torch.Tensor:
    """This stage's layers on a packed row: [T, 1, H] (after the final norm on the last stage)."""
    packed = rows.packed
    if model.pre_process:
        hidden = model.embedding(input_ids=packed.input_ids, position_ids=packed.position_ids)  # [T, 1, H]
        if model.padding_idx is not None:  # as nn.Embedding(padding_idx=...): no gradient into that row
            is_pad = (packed.input_ids == model.padding_idx).transpose(0, 1)[..., None]  # [T, 1, 1]
            hidden = torch.where(is_pad, hidden.detach(), hidden)
    else:
        model.set_input_tensor(input_tensor)
        hidden = None
    rotary = model.rotary_pos_emb(packed.max_len, packed_seq=True)  # [max_len, 1, 1, D]
    return model.decoder(
        hidden_states=hidden, attention_mask=None, rotary_pos_emb=rotary, packed_seq_params=packed_seq_params(rows)
    )


def _activation(rows: PackedRows, hidden_size: int, device: torch.device) -> torch.Tensor:
    return torch.empty(rows.packed.total_len, 1, hidden_size, dtype=torch.float32, device=device)


def run_pipeline(
    model,
    ctx: MegatronContext,
    micro_batches: list[MicroBatch],
    head: Callable[[torch.Tensor, MicroBatch], torch.Tensor | None],
    dtype: torch.dtype,
    forward_only: bool,
) -> None:
    """Forward every micro-batch through the stages (and backward unless `forward_only`).

    On the last stage `head(hidden [T, 1, H], micro_batch)` runs after each forward; when training it
    returns the (already weighted) loss to differentiate, else whatever it records itself."""
    hidden_size = model.config.hidden_size
    prev_rank, next_rank = ctx.groups["prev"], ctx.groups["next"]
    stash: list[tuple[torch.Tensor | None, torch.Tensor]] = []
    grad_mode = torch.no_grad() if forward_only else torch.enable_grad()
    with grad_mode:
        for mb in micro_batches:
            received = None
            if not ctx.is_first_stage:
                received = _activation(mb.rows, hidden_size, ctx.device)
                dist.recv(received, src=prev_rank)
                received.requires_grad_(not forward_only)
            with autocast(ctx.device, dtype):
                out = stage_forward(model, mb.rows, received)
                if ctx.is_last_stage:
                    out = head(out, mb)
            if not ctx.is_last_stage:
                dist.send(out.detach().float().contiguous(), dst=next_rank)
            if not forward_only:
                stash.append((received, out))
    if forward_only:
        return
    for received, out in reversed(stash):
        if ctx.is_last_stage:
            out.backward()
        else:
            grad = torch.empty(out.shape, dtype=torch.float32, device=ctx.device)
            dist.recv(grad, src=next_rank)
            out.backward(grad.to(out.dtype))
        if received is not None:
            dist.send(received.grad.contiguous(), dst=prev_rank)
