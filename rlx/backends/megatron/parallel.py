"""megatron-core's process groups (tensor, pipeline, data and expert parallel) on top of rlx's distributed context.

Ranks are laid out the megatron way (tensor-parallel neighbours adjacent, then data parallel, pipeline stages
outermost). Expert parallelism (MoE models) splits the ranks of a stage: ep_degree neighbours hold different experts
of each layer and exchange tokens with all-to-all; the expert-data-parallel group joins the ranks holding the same
experts. Experts are not split by tensor parallelism (expert tensor parallel 1), so under tp > 1 (sequence parallel:
each tensor-parallel rank routes its own tokens) the expert-parallel group takes the tensor-parallel neighbours
first, then data-parallel ranks: ep_degree divides tp x dp. A lone process (no launcher) gets a one-rank process
group so that megatron's parallel state exists; the degrees must then be 1.
"""

from __future__ import annotations

import datetime
import os
import tempfile
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from rlx.errors import UserError
from rlx.parallel.dist import COLLECTIVES, DistContext, setup


@dataclass
class MegatronContext(DistContext):
    """rlx's context plus this rank's place in the (pp, dp, tp) grid; dp_* refer to megatron's data-parallel group."""

    tp_degree: int = 1
    pp_degree: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    megatron_dp_rank: int = 0
    megatron_dp_size: int = 1
    tp_group: object = None
    pp_group: object = None
    mp_group: object = None
    ep_degree: int = 1
    ep_rank: int = 0
    ep_group: object = None
    """The ranks whose experts one MoE layer's all-to-all spans (ep_degree of them)."""
    expert_dp_group: object = None
    """The ranks holding the same experts (their gradients are summed over it)."""
    expert_mp_group: object = None
    """expert x pipeline parallel ranks: every expert parameter of the model once (gradient norms)."""
    groups: dict = field(default_factory=dict)

    @property
    def dp_size(self) -> int:
        return self.megatron_dp_size

    @property
    def dp_rank(self) -> int:
        return self.megatron_dp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_degree - 1


def _lone_process_group(device: torch.device) -> None:
    """A one-rank default group for a process started without a launcher."""
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="rlx-megatron-"), "store"), 1)
    dist.init_process_group(
        COLLECTIVES[device.type], store=store, rank=0, world_size=1, timeout=datetime.timedelta(minutes=30)
    )


def setup_megatron(device_name: str, tp_degree: int, pp_degree: int, ep_degree: int = 1) -> MegatronContext:
    """Initialise (once) megatron's groups for tp x pp x dp (ep_degree of the dp ranks splitting experts) over
    every process of the launch."""
    from rlx.models.megatron import compat

    compat.require_megatron()
    from megatron.core import parallel_state as ps

    base = setup(device_name)
    world = base.world
    if world % (tp_degree * pp_degree):
        raise UserError(
            f"{world} process(es) cannot hold tensor parallel {tp_degree} x pipeline parallel {pp_degree}: "
            f"launch a multiple of {tp_degree * pp_degree} processes (torchrun --nproc-per-node N)"
        )
    if (world // pp_degree) % ep_degree:
        raise UserError(
            f"ep_degree {ep_degree} must divide the {world // pp_degree} tensor x data parallel process(es) of "
            f"each of the {pp_degree} pipeline stage(s)"
        )
    if not dist.is_initialized():
        _lone_process_group(base.device)
    if ps.model_parallel_is_initialized():
        if (
            ps.get_tensor_model_parallel_world_size() != tp_degree
            or ps.get_pipeline_model_parallel_world_size() != pp_degree
            or ps.get_expert_model_parallel_world_size() != ep_degree
        ):
            raise UserError(
                f"tp {tp_degree} x pp {pp_degree} x ep {ep_degree} differs from the running "
                f"tp {ps.get_tensor_model_parallel_world_size()} x pp {ps.get_pipeline_model_parallel_world_size()}"
                f" x ep {ps.get_expert_model_parallel_world_size()}"
            )
    else:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp_degree,
            pipeline_model_parallel_size=pp_degree,
            expert_model_parallel_size=ep_degree,
            expert_tensor_parallel_size=1,  # experts are whole on every rank (rlx/models/megatron/model.py)
        )
    return MegatronContext(
        rank=base.rank,
        world=base.world,
        local_rank=base.local_rank,
        device=base.device,
        collectives=base.collectives,
        tp_degree=tp_degree,
        pp_degree=pp_degree,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        megatron_dp_rank=ps.get_data_parallel_rank(),
        megatron_dp_size=ps.get_data_parallel_world_size(),
        dp_group=ps.get_data_parallel_group(),
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        mp_group=ps.get_model_parallel_group(),
        ep_degree=ep_degree,
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_group=ps.get_expert_model_parallel_group(),
        expert_dp_group=ps.get_expert_data_parallel_group(),
        expert_mp_group=ps.get_expert_tensor_model_pipeline_parallel_group(),
        groups={
            "prev": ps.get_pipeline_model_parallel_prev_rank(),
            "next": ps.get_pipeline_model_parallel_next_rank(),
            "last": ps.get_pipeline_model_parallel_last_rank(),
            "embedding": ps.get_embedding_group() if ps.is_rank_in_embedding_group() else None,
        },
    )
