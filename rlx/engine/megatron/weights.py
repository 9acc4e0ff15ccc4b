"""A megatron model's full Hugging Face weights, gathered from every tensor x pipeline rank's slices (for the rollout
engine's weights and the 'single' layout)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from rlx.engine.megatron.parallel import MegatronContext
from rlx.models.megatron.convert import megatron_to_hf


@torch.no_grad()
def gather_hf_weights(stage: torch.nn.Module, hf_config, ctx: MegatronContext) -> dict[str, torch.Tensor]:
    """Every rank's slices of `stage` gathered over the model-parallel group -> full HF weights (CPU, float32)."""
    state = {k: v.detach() for k, v in stage.state_dict().items() if not k.endswith("_extra_state")}
    if ctx.tp_degree * ctx.pp_degree == 1:
        shards = {(ctx.tp_rank, ctx.pp_rank): {k: v.float().cpu() for k, v in state.items()}}
    else:
        shards = _broadcast_stages(state, ctx)
    return megatron_to_hf(shards, hf_config, ctx.tp_degree, ctx.pp_degree)


def _broadcast_stages(state: dict[str, torch.Tensor], ctx: MegatronContext) -> dict:
    """{(tp_rank, pp_rank): state} of every model-parallel rank, on the CPU. Each rank's state travels as one
    flat float32 buffer broadcast from it on the device (NCCL on GPUs) and moves to the CPU on arrival, so a
    rank holds one other rank's slices on the device at a time; only names and shapes travel as objects."""
    layouts = [None] * dist.get_world_size(ctx.mp_group)
    dist.all_gather_object(layouts, (ctx.tp_rank, ctx.pp_rank, [(k, tuple(v.shape)) for k, v in state.items()]),
                           group=ctx.mp_group)  # fmt: skip
    me, shards = dist.get_rank(ctx.mp_group), {}
    for index, (tp_rank, pp_rank, entries) in enumerate(layouts):
        sizes = [math.prod(shape) for _, shape in entries]
        if index == me:
            flat = torch.cat([state[name].reshape(-1).float() for name, _ in entries])
        else:
            flat = torch.empty(sum(sizes), dtype=torch.float32, device=ctx.device)
        dist.broadcast(flat, src=dist.get_global_rank(ctx.mp_group, index), group=ctx.mp_group)
        parts = flat.cpu().split(sizes)
        shards[(tp_rank, pp_rank)] = {name: part.view(shape) for (name, shape), part in zip(entries, parts)}
    return shards
