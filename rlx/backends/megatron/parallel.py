"""megatron-core's process groups (tensor, pipeline, data parallel) on top of rlx's distributed context.

Ranks are laid out the megatron way (tensor-parallel neighbours adjacent, then data parallel, pipeline
stages outermost). A lone process (no launcher) gets a one-rank process group so that megatron's
parallel state exists; the degrees must then be 1.
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


def setup_megatron(device_name: str, tp_degree: int, pp_degree: int) -> MegatronContext:
    """Initialise (once) megatron's groups for tp x pp x dp over every process of the launch."""
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
    if not dist.is_initialized():
        _lone_process_group(base.device)
    if ps.model_parallel_is_initialized():
        if (
            ps.get_tensor_model_parallel_world_size() != tp_degree
            or ps.get_pipeline_model_parallel_world_size() != pp_degree
        ):
            raise UserError(
                f"tp {tp_degree} x pp {pp_degree} differs from the running "
                f"tp {ps.get_tensor_model_parallel_world_size()} x pp {ps.get_pipeline_model_parallel_world_size()}"
            )
    else:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp_degree, pipeline_model_parallel_size=pp_degree)
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
        groups={
            "prev": ps.get_pipeline_model_parallel_prev_rank(),
            "next": ps.get_pipeline_model_parallel_next_rank(),
            "last": ps.get_pipeline_model_parallel_last_rank(),
            "embedding": ps.get_embedding_group() if ps.is_rank_in_embedding_group() else None,
        },
    )
