"""Splitting a launch into rollout ranks and trainer ranks (asynchronous RL).

    roles = split_roles(num_rollout=1, device_name="auto")    # every launched process calls it first
    roles.is_rollout, roles.rank_in_role, roles.store, roles.bridge

The first `num_rollout` processes generate, the others train. Each side gets what it needs and nothing that ties
it to the other side's pace:
- trainer ranks: the default process group over the trainers only (initialised here), so FSDP, scoring, the
  checkpoint gathers and every other collective of the synchronous code run among them unchanged;
- rollout ranks: no default group at all (each generates on its own, with no collective among rollout ranks);
- both: the launcher's key-value store (torch.distributed's TCPStore: batches and notices go through it, and a
  side polls it without blocking the other) and the "bridge" process group of the rollout ranks plus the first
  trainer (bridge rank `num_rollout`), over which new weights are broadcast.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlx.errors import UserError
from rlx.parallel.dist import COLLECTIVES, collective_timeout_s, group_collectives, launcher_env, rank_device


@dataclass
class Roles:
    """This process's side of an asynchronous launch."""

    is_rollout: bool
    rank: int
    """Global rank in the launch."""
    world: int
    num_rollout: int
    device: torch.device
    store: object
    """The launch's key-value store (set / get / check / delete_key)."""
    bridge: object | None
    """The weight-broadcast group (rollout ranks + first trainer); None on the other trainers."""
    timeout_s: float

    @property
    def rank_in_role(self) -> int:
        return self.rank if self.is_rollout else self.rank - self.num_rollout

    @property
    def is_lead_trainer(self) -> bool:
        """The first trainer: it writes the run folder, takes the batches and broadcasts the weights."""
        return self.rank == self.num_rollout

    @property
    def bridge_root(self) -> int:
        """The lead trainer's rank in the bridge group."""
        return self.num_rollout


def check_split(num_rollout: int, sp_degree: int, launched: tuple[int, int, int] | None) -> tuple[int, int, int]:
    """(rank, world, local rank) when `num_rollout` rollout ranks leave trainers for `sp_degree`; else a UserError
    saying how to launch."""
    how = (
        f"launch it with torchrun, e.g. `torchrun --nproc_per_node {num_rollout + 1} -m rlx ppo RECIPE` "
        f"({num_rollout} rollout rank(s) from async.rollout_ranks, the rest train)"
    )
    if launched is None:
        raise UserError(f"[async] runs rollout and training in separate processes: {how}")
    rank, world, local_rank = launched
    trainers = world - num_rollout
    if trainers < 1:
        raise UserError(
            f"async.rollout_ranks = {num_rollout} leaves no trainer among the {world} launched processes "
            f"(it must be less than the number of processes); {how}"
        )
    if trainers % sp_degree:
        raise UserError(
            f"async.rollout_ranks = {num_rollout} leaves {trainers} trainer(s) of {world} processes, which do not "
            f"split into sequence-parallel groups of train.sp_degree = {sp_degree}"
        )
    return rank, world, local_rank


def split_roles(num_rollout: int, device_name: str = "auto", sp_degree: int = 1) -> Roles:
    """Join the launch as a rollout rank or a trainer (see the module docstring). On trainers, RANK and WORLD_SIZE
    are rewritten to the trainer-only numbering, so `rlx.parallel.dist.setup` then builds the trainers'
    context (rank 0 = the first trainer, which writes the run folder) on the group initialised here."""
    rank, world, local_rank = check_split(num_rollout, sp_degree, launcher_env())
    timeout_s = collective_timeout_s()
    timeout = datetime.timedelta(seconds=timeout_s)
    device = rank_device(device_name, local_rank)
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
    is_rollout = rank < num_rollout
    collectives = COLLECTIVES[device.type]
    if not is_rollout:
        dist.init_process_group(
            group_collectives(device),
            store=dist.PrefixStore("rlx-trainers", store),
            rank=rank - num_rollout,
            world_size=world - num_rollout,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank - num_rollout), str(world - num_rollout)
    bridge = None
    if rank <= num_rollout:  # the rollout ranks and the first trainer
        bridge_store = dist.PrefixStore("rlx-bridge", store)
        bridge = _bridge_group(collectives, bridge_store, rank, num_rollout + 1, timeout, device)
    return Roles(is_rollout, rank, world, num_rollout, device, store, bridge, timeout_s)


def _bridge_group(collectives: str, store, rank: int, size: int, timeout: datetime.timedelta, device: torch.device):
    """A process group outside torch.distributed's registry (the default group is the trainers' own)."""
    if collectives == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if collectives == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    raise UserError(f"[async] does not support {collectives} collectives yet (devices: cuda, cpu)")


def broadcast(group, tensor: torch.Tensor, root: int) -> None:
    """Broadcast `tensor` in place from `root` over a group built by `_bridge_group`."""
    options = dist.BroadcastOptions()
    options.rootRank = root
    group.broadcast([tensor], options).wait()
