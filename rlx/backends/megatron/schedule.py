"""Micro-batches through the pipeline stages: stage forward, point-to-point activations, GPipe order.

Every rank of a pipeline holds the same micro-batches (built from the same rows), so each stage knows
the shape of what it will receive ([T, 1, H] activations of a packed row) without asking. The order is
1F1B (one forward, one backward once the pipeline is full), so a stage keeps at most as many
micro-batches' activations as there are stages; sends and receives between neighbours are issued
together so that they cannot deadlock. Activations travel in float32 (under sequence parallelism, an MoE model
under tensor parallelism, each rank's 1/tp of the row padded to a multiple of tp). megatron-core's own schedules
allocate on CUDA and are not used.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlx.backends.megatron.parallel import MegatronContext
from rlx.logprobs import PackedRows
from rlx.models.attention import PackedBatch
from rlx.models.megatron.model import packed_params, packed_rotary
from rlx.models.megatron.routing import set_aux_loss_scale, stage_routing
from rlx.parallel.ulysses import padded_length
from rlx.utils.device import autocast


@dataclass
class MicroBatch:
    """One packed micro-batch as every stage sees it."""

    rows: PackedRows
    """Packing of the micro-batch's rows (on the model's device)."""
    extra: object = None
    """What the last stage's head needs besides the hidden states (tensors, the batch part, weights)."""
    is_filler: bool = False
    """A one-token row run only so that every rank of an expert-parallel group takes part in each MoE layer's
    all-to-all as often as the others (its output is dropped, its loss is zero)."""
    routes: torch.Tensor | None = None
    """An MoE model's recorded experts of the packed row's tokens [T, layers, k] (-1: no record), or None."""
    aux_loss_scale: torch.Tensor | None = None
    """The weight of an MoE model's router losses in this micro-batch's backward (its share of the loss)."""


def sequence_parallel_row(packed: PackedBatch, tp_degree: int) -> PackedBatch:
    """A packed row padded to a multiple of `tp_degree` tokens for sequence parallelism: the padding (token 0,
    positions 0, 1, ...) forms one more sample, so no real token attends to it; the head drops it again."""
    total = padded_length(packed.total_len, tp_degree)
    pad = total - packed.total_len
    if not pad:
        return packed
    ids, positions = packed.input_ids, packed.position_ids
    return PackedBatch(
        input_ids=torch.cat([ids, ids.new_zeros(1, pad)], dim=1),
        position_ids=torch.cat([positions, torch.arange(pad, device=positions.device)[None]], dim=1),
        cu_seqlens=torch.cat([packed.cu_seqlens, packed.cu_seqlens.new_tensor([total])]),
        max_len=max(packed.max_len, pad),
        lengths=[*packed.lengths, pad],
    )


def stage_tokens(model, rows: PackedRows) -> int:
    """Tokens of a packed row that this stage's rank holds between layers: all of them, or under sequence
    parallelism its 1/tp of the padded row."""
    config = model.config
    if not config.sequence_parallel:
        return rows.packed.total_len
    tp = config.tensor_model_parallel_size
    return padded_length(rows.packed.total_len, tp) // tp


def prepare_routing(model, mb: MicroBatch, force: bool) -> torch.Tensor | None:
    """Hand an MoE stage's routers this rank's part of the micro-batch's recorded experts (its slice of the
    sequence-parallel row, the stage's layers; padding gets -1) and which of its tokens are real (not the
    sequence-parallel padding, not a filler row); nothing for a dense stage. Returns megatron's padding mask of this
    rank's tokens ([1, T_local], True: padding) when the row has sequence-parallel padding, else None (a filler's
    router losses are weighted 0 instead)."""
    routing = stage_routing(model)
    if routing is None:
        return None
    config, total = model.config, mb.rows.packed.total_len
    tp = config.tensor_model_parallel_size if config.sequence_parallel else 1
    padded = padded_length(total, tp)
    valid = torch.arange(padded, device=mb.rows.packed.input_ids.device) < (0 if mb.is_filler else total)
    routes = None
    if mb.routes is not None:
        routes = mb.routes[:, routing.layers]  # [T, L_stage, k]
        routes = torch.cat([routes, routes.new_full((padded - total, *routes.shape[1:]), -1)])
    if tp > 1:
        valid = valid.chunk(tp)[_tp_rank()]
        routes = routes.chunk(tp)[_tp_rank()] if routes is not None else None
    share = mb.aux_loss_scale if mb.aux_loss_scale is not None else 0.0  # the weight of its router-loss metrics
    routing.prepare(routes, valid, 0 if mb.is_filler else total, force, share)
    return None if mb.is_filler or padded == total else ~valid[None]


def stage_forward(
    model, rows: PackedRows, input_tensor: torch.Tensor | None, padding_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """This stage's layers on a packed row: [T, 1, H] (after the final norm on the last stage); under sequence
    parallelism [T_pad / tp, 1, H] between stages, the last one gathering the whole row back. `padding_mask`: an MoE
    stage's (`prepare_routing`), which keeps the padding out of megatron's load-balancing loss."""
    config = model.config
    sequence_parallel, tp = config.sequence_parallel, config.tensor_model_parallel_size
    packed = sequence_parallel_row(rows.packed, tp) if sequence_parallel else rows.packed
    if model.pre_process:
        hidden = model.embedding(input_ids=packed.input_ids, position_ids=packed.position_ids)  # [T, 1, H]
        if model.padding_idx is not None:  # as nn.Embedding(padding_idx=...): no gradient into that row
            is_pad = (packed.input_ids == model.padding_idx).transpose(0, 1)[..., None]  # [T, 1, 1]
            if sequence_parallel:  # the embedding scattered the row: this rank's [T_pad / tp, 1, H]
                is_pad = is_pad.chunk(tp)[_tp_rank()]
            hidden = torch.where(is_pad, hidden.detach(), hidden)
    else:
        model.set_input_tensor(input_tensor)
        hidden = None
    rotary = packed_rotary(model, packed.position_ids, packed.max_len)  # applied by rlx's core attention
    params = packed_params(packed.cu_seqlens.to(torch.int32), packed.max_len, rotary)
    out = model.decoder(
        hidden_states=hidden, attention_mask=None, rotary_pos_emb=None, packed_seq_params=params,
        padding_mask=padding_mask,
    )  # fmt: skip
    if sequence_parallel and model.post_process:
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        # the heads compute every rank's full gradient of the row (vocab-parallel statistics all-reduced, a
        # replicated value head): the backward keeps this rank's part
        out = gather_from_sequence_parallel_region(out, tensor_parallel_output_grad=False)[: rows.packed.total_len]
    return out


def _tp_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank()


def _activation(model, rows: PackedRows, device: torch.device) -> torch.Tensor:
    return torch.empty(stage_tokens(model, rows), 1, model.config.hidden_size, dtype=torch.float32, device=device)


def _exchange(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> None:
    """Point-to-point sends and receives issued together (one NCCL group), then waited for: a stage
    sending forward while its neighbour sends backward cannot deadlock."""
    ops = [dist.P2POp(dist.isend, t, peer) for t, peer in sends] + [
        dist.P2POp(dist.irecv, t, peer) for t, peer in recvs
    ]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


class _Pipeline:
    """One stage's part of a schedule: forward / backward of micro-batch i with its neighbours' traffic."""

    def __init__(self, model, ctx: MegatronContext, micro_batches, head, dtype, forward_only: bool, force_routes: bool):
        self.model, self.ctx, self.micro_batches, self.head = model, ctx, micro_batches, head
        self.dtype, self.forward_only, self.force_routes = dtype, forward_only, force_routes
        self.prev, self.next = ctx.groups["prev"], ctx.groups["next"]
        self.stash: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}

    def recv_forward(self, i: int) -> torch.Tensor | None:
        if self.ctx.is_first_stage:
            return None
        received = _activation(self.model, self.micro_batches[i].rows, self.ctx.device)
        _exchange([], [(received, self.prev)])
        return received

    def forward(self, i: int, received: torch.Tensor | None) -> torch.Tensor | None:
        """Run the stage on micro-batch i; returns the activation to send on (None on the last stage)."""
        mb = self.micro_batches[i]
        if received is not None:
            received.requires_grad_(not self.forward_only)
        padding_mask = prepare_routing(self.model, mb, self.force_routes)
        with torch.set_grad_enabled(not self.forward_only), autocast(self.ctx.device, self.dtype):
            out = stage_forward(self.model, mb.rows, received, padding_mask)
            if self.ctx.is_last_stage:
                out = self.head(out, mb)
        if not self.forward_only:
            self.stash[i] = (received, out)
        return None if self.ctx.is_last_stage else out.detach().float().contiguous()

    def backward(self, i: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        """Backward of micro-batch i given the gradient of its output; returns the input's gradient."""
        received, out = self.stash.pop(i)
        if self.micro_batches[i].aux_loss_scale is not None:  # every stage's routers, at their backward
            set_aux_loss_scale(self.micro_batches[i].aux_loss_scale)
        if self.ctx.is_last_stage:
            out.backward()
        else:
            out.backward(grad.to(out.dtype))
        return None if received is None else received.grad.contiguous()

    def grad_buffer(self, i: int) -> torch.Tensor:
        return _activation(self.model, self.micro_batches[i].rows, self.ctx.device)


def run_pipeline(
    model,
    ctx: MegatronContext,
    micro_batches: list[MicroBatch],
    head: Callable[[torch.Tensor, MicroBatch], torch.Tensor | None],
    dtype: torch.dtype,
    forward_only: bool,
    force_routes: bool = False,
) -> None:
    """Forward every micro-batch through the stages (and backward unless `forward_only`), 1F1B order:
    stage s runs (stages - s - 1) forwards ahead, then alternates one forward and one backward, so it
    keeps at most `stages` micro-batches' activations.

    On the last stage `head(hidden [T, 1, H], micro_batch)` runs after each forward; when training it
    returns the (already weighted) loss to differentiate, else whatever it records itself. An MoE stage's routers
    see each micro-batch's recorded experts (`MicroBatch.routes`), forced with `force_routes` (routing replay)."""
    pipe = _Pipeline(model, ctx, micro_batches, head, dtype, forward_only, force_routes)
    count = len(micro_batches)
    if forward_only:
        for i in range(count):
            out = pipe.forward(i, pipe.recv_forward(i))
            _exchange([(out, pipe.next)] if out is not None else [], [])
        return
    warmup = min(ctx.pp_degree - ctx.pp_rank - 1, count)
    for i in range(warmup):
        out = pipe.forward(i, pipe.recv_forward(i))
        _exchange([(out, pipe.next)], [])
    received = pipe.recv_forward(warmup) if warmup < count else None
    for i in range(count - warmup):  # steady state: forward warmup+i, backward i
        out = pipe.forward(warmup + i, received)
        grad = None
        if out is not None:  # send the output and take the gradient of the oldest one, together
            grad = pipe.grad_buffer(i)
            _exchange([(out, pipe.next)], [(grad, pipe.next)])
        grad_in = pipe.backward(i, grad)
        last = i == count - warmup - 1
        sends = [(grad_in, pipe.prev)] if grad_in is not None else []
        received = (
            None if last or ctx.is_first_stage else _activation(model, micro_batches[warmup + i + 1].rows, ctx.device)
        )
        _exchange(sends, [(received, pipe.prev)] if received is not None else [])
    for i in range(count - warmup, count):  # cool-down: the remaining backwards
        grad = None
        if not ctx.is_last_stage:
            grad = pipe.grad_buffer(i)
            _exchange([], [(grad, pipe.next)])
        grad_in = pipe.backward(i, grad)
        _exchange([(grad_in, pipe.prev)] if grad_in is not None else [], [])
