"""A megatron model's full Hugging Face weights, gathered from every tensor x pipeline rank's slices: streamed on the
device a bucket of layers at a time (the rollout engine's weight sync), or all at once on the CPU (the 'single'
layout's checkpoint files)."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.distributed as dist

from rlx.backends.megatron.parallel import MegatronContext
from rlx.models.megatron.convert import global_experts, megatron_units, unit_of, unit_to_hf
from rlx.models.megatron.model import is_moe, num_experts

EXPERTS = ".mlp.experts."
"""In the name of every expert's tensor (and of its optimizer state) in a stage's state dict."""


def with_all_experts(state: dict[str, torch.Tensor], hf_config, ctx: MegatronContext) -> dict[str, torch.Tensor]:
    """A stage's state (or '<name>::<key>' optimizer state) holding this rank's experts -> holding every expert of
    the stage under its global index, gathered over the expert-parallel group (a collective; as it is without
    expert parallelism or for a dense model). Only experts travel: the group may span tensor-parallel ranks, whose
    other tensors are different slices."""
    if not is_moe(hf_config) or ctx.ep_degree == 1:
        return state
    parts = [None] * ctx.ep_degree
    experts = {k: v.cpu() for k, v in state.items() if EXPERTS in k}
    dist.all_gather_object(parts, (ctx.ep_rank, experts), group=ctx.ep_group)
    device = next(iter(state.values())).device if state else ctx.device
    out = {k: v for k, v in state.items() if EXPERTS not in k}
    for rank, part in parts:
        out |= {k: v.to(device) for k, v in global_experts(part, num_experts(hf_config), ctx.ep_degree, rank).items()}
    return out


@torch.no_grad()
def gather_hf_weights(stage: torch.nn.Module, hf_config, ctx: MegatronContext) -> dict[str, torch.Tensor]:
    """Every rank's slices of `stage` gathered over the model-parallel group -> full HF weights (CPU, float32; copies
    the next updates leave alone)."""
    weights = stream_hf_weights(stage, hf_config, ctx)
    return {name: tensor.to("cpu", torch.float32, copy=True) for name, tensor in weights}


@torch.no_grad()
def stream_hf_weights(
    stage: torch.nn.Module, hf_config, ctx: MegatronContext, bucket_bytes: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF weights (float32) on this rank's device, in Hugging Face order, gathered over the model-parallel
    group about `bucket_bytes` at a time (0: a layer at a time): for each bucket of a stage's layers, each of the
    stage's tensor-parallel ranks broadcasts its slices of them as one flat buffer (NCCL on GPUs: no trip through
    host memory), and the bucket is converted on arrival. Every rank of the group drains the iterator together.
    The tensors may be views of the stage's own parameters or of the bucket's buffers: read them before the next
    update (or the next bucket's)."""
    state = {k: v.detach() for k, v in stage.state_dict().items() if not k.endswith("_extra_state")}
    state = with_all_experts(state, hf_config, ctx)  # every expert of the stage (gathered under EP)
    tp, pp = ctx.tp_degree, ctx.pp_degree
    if getattr(hf_config, "tie_word_embeddings", False):  # the last stage's copy of the tied embedding: not in HF
        state.pop("output_layer.weight", None)
    alone = tp * pp == 1
    layouts = {(ctx.tp_rank, ctx.pp_rank): (0, [(k, tuple(v.shape)) for k, v in state.items()])}
    if not alone:
        gathered = [None] * dist.get_world_size(ctx.mp_group)
        dist.all_gather_object(gathered, (ctx.tp_rank, ctx.pp_rank, layouts[(ctx.tp_rank, ctx.pp_rank)][1]),
                               group=ctx.mp_group)  # fmt: skip
        layouts = {(t, p): (index, entries) for index, (t, p, entries) in enumerate(gathered)}
    for p, units in _buckets(layouts, hf_config, tp, pp, bucket_bytes):
        if alone:
            shards = {(0, 0): state}
        else:
            me = (ctx.tp_rank, ctx.pp_rank)
            shards = {(t, p): _broadcast_slices(state, layouts[(t, p)], units, (t, p) == me, ctx) for t in range(tp)}
        for unit in units:
            for name, tensor in unit_to_hf(shards, hf_config, tp, pp, p, unit).items():
                yield name, tensor.float()


def _buckets(layouts: dict, hf_config, tp: int, pp: int, bucket_bytes: int) -> Iterator[tuple[int, list[str]]]:
    """(pp_rank, units) in Hugging Face order, consecutive units of one stage of at most `bucket_bytes` (float32,
    every tp rank's slices together; a larger unit goes alone)."""
    sizes: dict[tuple[int, str], int] = {}
    for (_, p), (_, entries) in layouts.items():
        for name, shape in entries:
            sizes[(p, unit_of(name))] = sizes.get((p, unit_of(name)), 0) + 4 * math.prod(shape)
    bucket: list[str] = []
    stage, size = 0, 0
    for p, unit in megatron_units(hf_config, pp):
        grow = sizes.get((p, unit), 0)
        if bucket and (p != stage or size + grow > bucket_bytes):
            yield stage, bucket
            bucket, size = [], 0
        bucket.append(unit)
        stage, size = p, size + grow
    if bucket:
        yield stage, bucket


def _broadcast_slices(state: dict, layout: tuple[int, list], units: list[str], mine: bool, ctx: MegatronContext):
    """One rank's tensors of `units` ({name: tensor}) on every rank of the group: broadcast from it as one flat
    float32 buffer on the device."""
    index, entries = layout
    entries = [(name, shape) for name, shape in entries if unit_of(name) in units]
    sizes = [math.prod(shape) for _, shape in entries]
    if mine:
        flat = torch.cat([state[name].reshape(-1).float() for name, _ in entries])
    else:
        flat = torch.empty(sum(sizes), dtype=torch.float32, device=ctx.device)
    dist.broadcast(flat, src=dist.get_global_rank(ctx.mp_group, index), group=ctx.mp_group)
    return {name: part.view(shape) for (name, shape), part in zip(entries, flat.split(sizes))}
