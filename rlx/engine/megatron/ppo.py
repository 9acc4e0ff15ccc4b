"""`rlx ppo` on the megatron backend: the actor (and critic) train as megatron stages; rollouts run on a
Hugging Face replica of the policy whose weights are gathered from the stages after each update.

    megatron stages (tp x pp, dp on top)  --train-->  broadcast over the model-parallel group  -->  HF replica
                                                                                                      | rollout
Old logprobs and values are computed by the stages (the same forward the update uses), and so are the
reference's logprobs (frozen stages cut from the initial policy). Checkpoints use the 'megatron' layout,
critic nested inside.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.distributed as dist

from rlx.engine.checkpoint import CheckpointMeta
from rlx.engine.megatron.checkpoint import (
    RankContent,
    read_rank_optimizer,
    read_rank_state,
    save_megatron_rank_checkpoint,
)
from rlx.engine.megatron.parallel import MegatronContext
from rlx.engine.megatron.stage import MegatronScoringModel, load_stage
from rlx.engine.megatron.trainer import build_megatron_trainer
from rlx.models.loading import tied_keys
from rlx.models.megatron.convert import hf_to_megatron_shard, megatron_to_hf


def build_trainer(model, train_cfg, ctx: MegatronContext, checkpoint=None):
    """A megatron trainer for `model` (an HF policy or value model): its stage cut from the HF weights, or
    read from `checkpoint` (a megatron-layout dir, with this rank's optimizer state) when resuming."""
    config = model.config
    if checkpoint is not None:
        state = read_rank_state(checkpoint, ctx.tp_rank, ctx.pp_rank)
        optimizer_state = read_rank_optimizer(checkpoint, ctx.tp_rank, ctx.pp_rank)
        return build_megatron_trainer(config, train_cfg, ctx, state, str(checkpoint), optimizer_state)
    return build_megatron_trainer(config, train_cfg, ctx, _rank_state(model, ctx), "the initial policy")


def reference_model(model, ctx: MegatronContext) -> MegatronScoringModel:
    """The frozen reference as megatron stages cut from `model` (the initial HF policy) at the actor's tp x pp,
    so no rank keeps a whole reference model."""
    stage = load_stage(model.config, _rank_state(model, ctx), ctx, "the reference policy")
    return MegatronScoringModel(stage.requires_grad_(False).eval(), model.config, ctx)


def _rank_state(model, ctx: MegatronContext) -> dict[str, torch.Tensor]:
    """This rank's megatron slices of an HF model's weights."""
    weights = {k: v for k, v in model.state_dict().items() if k not in tied_keys(model)}  # on every rank
    return hf_to_megatron_shard(weights, model.config, ctx.tp_degree, ctx.pp_degree, ctx.tp_rank, ctx.pp_rank)


def scoring_model(trainer) -> MegatronScoringModel:
    """The trainer's stage as `rlx score` uses megatron models (no copy)."""
    return MegatronScoringModel(trainer.model, trainer.hf_config, trainer.ctx)


@torch.no_grad()
def gather_hf_weights(trainer) -> dict[str, torch.Tensor]:
    """Every rank's slices gathered over the model-parallel group -> full HF weights (CPU, float32)."""
    ctx: MegatronContext = trainer.ctx
    state = {k: v.detach() for k, v in trainer.model.state_dict().items() if not k.endswith("_extra_state")}
    if ctx.tp_degree * ctx.pp_degree == 1:
        shards = {(ctx.tp_rank, ctx.pp_rank): {k: v.float().cpu() for k, v in state.items()}}
    else:
        shards = _broadcast_stages(state, ctx)
    return megatron_to_hf(shards, trainer.hf_config, ctx.tp_degree, ctx.pp_degree)


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


@torch.no_grad()
def sync_replica(replica: torch.nn.Module, trainer) -> None:
    """Copy the trained weights into the rollout replica in place (its dtype and device kept)."""
    weights = gather_hf_weights(trainer)
    params = dict(replica.named_parameters())
    for name, tensor in weights.items():
        params[name].copy_(tensor)
    replica.tie_weights()


def save(out, actor, critic, aux: dict, critic_aux: dict, meta: CheckpointMeta, critic_meta, before_publish) -> None:
    """A 'megatron' checkpoint of the actor (critic nested as 'critic/'), written by every rank."""
    ctx: MegatronContext = actor.ctx
    degrees = {"layout": "megatron", "tp_degree": ctx.tp_degree, "pp_degree": ctx.pp_degree}
    nested = {}
    if critic is not None:
        nested["critic"] = RankContent(
            critic.model_state(), critic.optimizer_state(), critic_aux, replace(critic_meta, **degrees)
        )
    save_megatron_rank_checkpoint(
        out, actor.model_state(), actor.optimizer_state(), aux, replace(meta, **degrees), ctx,
        ctx.tp_rank, ctx.pp_rank, ctx.dp_rank, overwrite=True, nested=nested, before_publish=before_publish,
    )  # fmt: skip
