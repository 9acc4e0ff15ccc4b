"""Process groups and devices for multi-process runs (torchrun, SLURM srun) and the single-process default.

One process per device. `setup()` reads the launcher's environment: torchrun's RANK / WORLD_SIZE /
LOCAL_RANK / MASTER_ADDR, or SLURM's SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID when srun starts
the processes itself (MASTER_ADDR must then be exported, e.g. by recipes/slurm/ppo.sbatch). Without
either, the process is alone and nothing is initialised. The collective library follows the device: nccl on
CUDA, hccl on Ascend NPUs (torch_npu is imported only then), gloo on CPU. A collective that waits
longer than `timeout_s` ($RLX_COLLECTIVE_TIMEOUT_S, default 1800) raises instead of hanging;
commands turn that into a one-line error.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import datetime
import os
import sys
from dataclasses import dataclass, field
from typing import NoReturn

import torch
import torch.distributed as dist

from rlx.errors import UserError
from rlx.utils.device import resolve_device

COLLECTIVES = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}
"""The collective-communication library (torch.distributed's process-group backend) of each device type."""


def limit_cpu_threads(device: torch.device) -> None:
    """One intra-op CPU thread for a process that computes on an accelerator, as torchrun gives each of its processes
    when it starts several, unless OMP_NUM_THREADS is set. A process otherwise spins one thread per core in its small
    CPU ops: four plain processes on a 64-core, 4-GPU host each took 3x their time alone, and one process under
    `torchrun --nproc_per_node 1` (no OMP_NUM_THREADS from torchrun) or srun (none ever) took 1.7x a plain one's step
    (bench/RESULTS.md, scale); alone the process was no faster with all the cores."""
    if device.type != "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def group_collectives(device: torch.device) -> str:
    """The process group's collectives for `device` (torch's backend string): on CUDA, gloo for CPU tensors beside
    nccl, so collectives on CPU-offloaded parameters and gradients (train.param_offload: the grad norm of FSDP2's
    CPU shards) have a library to run on."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else COLLECTIVES[device.type]


@dataclass
class DistContext:
    """Where this process stands: global rank and size, its device, and the data/sequence-parallel groups.

    Ranks form a (dp, sp) grid, sequence-parallel neighbours adjacent: rank = dp_rank * sp + sp_rank.
    """

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    collectives: str | None = None
    """The process group's collective library (nccl, hccl, gloo); None outside a launcher."""
    sp_degree: int = 1
    dp_group: object = None
    sp_group: object = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """True under a launcher (torchrun / srun), even with one process: models are then FSDP-sharded."""
        return self.collectives is not None

    @property
    def dp_size(self) -> int:
        return self.world // self.sp_degree

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sp_degree

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp_degree


def launcher_env() -> tuple[int, int, int] | None:
    """(rank, world, local_rank) from torchrun or srun variables, or None for a lone process."""
    env = os.environ
    if "WORLD_SIZE" in env and "RANK" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    if "SLURM_NTASKS" in env and "SLURM_PROCID" in env and int(env["SLURM_NTASKS"]) > 1:
        if "MASTER_ADDR" not in env:
            raise UserError(
                "running under srun with several tasks but MASTER_ADDR is not set "
                "(export it, or launch with torchrun; see recipes/slurm/ppo.sbatch)"
            )
        env.setdefault("MASTER_PORT", "29500")
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0))
    return None


_CONTEXT: DistContext | None = None


def setup(device_name: str = "auto", sp_degree: int = 1, timeout_s: float | None = None) -> DistContext:
    """Initialise the default process group (once) and the dp/sp groups; return this process's context.

    `timeout_s` defaults to $RLX_COLLECTIVE_TIMEOUT_S, else 1800 s."""
    global _CONTEXT
    if timeout_s is None:
        timeout_s = _timeout_from_env()
    if _CONTEXT is not None:
        if _CONTEXT.sp_degree != sp_degree:
            raise UserError(f"sequence parallel degree {sp_degree} differs from the running {_CONTEXT.sp_degree}")
        return _CONTEXT
    found = launcher_env()
    if found is None:
        if sp_degree != 1:
            raise UserError(f"sp_degree {sp_degree} needs {sp_degree} processes (launch with torchrun)")
        _CONTEXT = DistContext(device=resolve_device(device_name))
        limit_cpu_threads(_CONTEXT.device)
        return _CONTEXT
    rank, world, local_rank = found
    if world % sp_degree:
        raise UserError(f"{world} processes cannot be split into sequence-parallel groups of {sp_degree}")
    device = rank_device(device_name, local_rank)
    limit_cpu_threads(device)  # torchrun sets OMP_NUM_THREADS for several processes only, srun never
    collectives = COLLECTIVES[device.type]
    if not dist.is_initialized():
        dist.init_process_group(
            group_collectives(device),
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    _CONTEXT = DistContext(
        rank=rank,
        world=world,
        local_rank=local_rank,
        device=device,
        collectives=collectives,
        sp_degree=sp_degree,
        **_groups(world, sp_degree, rank),
    )
    return _CONTEXT


def collective_timeout_s() -> float:
    """Seconds a collective (or a wait on another process) may take: $RLX_COLLECTIVE_TIMEOUT_S, default 1800."""
    return _timeout_from_env()


def _timeout_from_env() -> float:
    raw = os.environ.get("RLX_COLLECTIVE_TIMEOUT_S", "1800")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise UserError(f"RLX_COLLECTIVE_TIMEOUT_S={raw!r}: expected a positive number of seconds")
    return value


def rank_device(device_name: str, local_rank: int) -> torch.device:
    """The device of the process with `local_rank` on its host (made current on accelerators)."""
    device = resolve_device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if device.type == "npu":
        torch.npu.set_device(local_rank)
        return torch.device("npu", local_rank)
    return device


def _groups(world: int, sp: int, rank: int) -> dict:
    """Every rank creates every group (a torch.distributed rule); keep the two this rank belongs to."""
    out = {"dp_group": None, "sp_group": None}
    for start in range(0, world, sp):
        group = dist.new_group(list(range(start, start + sp)))
        if start <= rank < start + sp:
            out["sp_group"] = group
    for offset in range(sp):
        group = dist.new_group(list(range(offset, world, sp)))
        if rank % sp == offset:
            out["dp_group"] = group
    return out


@dataclass(frozen=True)
class TensorParallelGroup:
    """This rank's place among tensor-parallel groups of `degree` consecutive ranks (rank = index * degree + rank
    in the group): the group (None when alone), its index among the world / degree groups, and the count."""

    degree: int
    rank: int
    index: int
    count: int
    group: object = None
    objects: object = None
    """The same ranks' group for Python objects (gloo: host memory on any device; `group` itself on the CPU)."""

    @property
    def leader(self) -> int:
        """The global rank of the group's first rank."""
        return self.index * self.degree

    def slicing(self) -> dict[str, int]:
        """{'degree', 'rank'}: how this rank slices a full tensor (rank_slice's keywords)."""
        return {"degree": self.degree, "rank": self.rank}


_TP_GROUPS: dict[int, TensorParallelGroup] = {}


def tensor_parallel_group(degree: int, ctx: DistContext | None = None) -> TensorParallelGroup:
    """The tensor-parallel group of this rank for `degree` (made once per degree: every rank calls it together the
    first time, as torch.distributed requires); a UserError when the launch cannot be split so."""
    ctx = ctx or context()
    if degree == 1:
        return TensorParallelGroup(1, 0, ctx.rank, ctx.world)
    if not ctx.distributed:
        raise UserError(f"tp_degree {degree} needs {degree} processes (launch with torchrun --nproc_per_node {degree})")
    if ctx.world % degree:
        raise UserError(f"tp_degree {degree} does not divide the {ctx.world} processes")
    if degree not in _TP_GROUPS:
        mine, objects = None, None
        for start in range(0, ctx.world, degree):
            ranks = list(range(start, start + degree))
            group = dist.new_group(ranks)
            group_objects = group if ctx.collectives == "gloo" else dist.new_group(ranks, backend="gloo")
            if start <= ctx.rank < start + degree:
                mine, objects = group, group_objects
        _TP_GROUPS[degree] = TensorParallelGroup(degree, ctx.rank % degree, ctx.rank // degree, ctx.world // degree,
                                                 mine, objects)  # fmt: skip
    return _TP_GROUPS[degree]


def context() -> DistContext:
    """The current context (a lone CPU/auto process when setup() was never called)."""
    return _CONTEXT if _CONTEXT is not None else DistContext(device=resolve_device("auto"))


def teardown(wait_for_others: bool = True) -> None:
    """Leave the process group rlx joined (not one a library made for itself, e.g. vLLM in one process);
    after a failure, without a final barrier (the others may be gone)."""
    global _CONTEXT
    if _CONTEXT is not None and _CONTEXT.distributed and dist.is_initialized():
        if wait_for_others:
            dist.barrier()
        dist.destroy_process_group()
    _CONTEXT = None
    _TP_GROUPS.clear()


def exit_process(code: int = 0) -> NoReturn:
    """End a process launched by torchrun or srun without Python's interpreter finalization.

    gloo's worker threads release the tensors of the last collectives a moment after the caller's wait
    returns; a release that needs the GIL while the interpreter finalizes kills the process with SIGABRT
    ("terminate called without an active exception") after all its work succeeded, and the launcher
    reports a failed run. So: Python's atexit handlers (log flushing, temporary files) run, then C's
    `exit()`, which runs the C atexit handlers and C++ static destructors (vLLM on CPU unlinks
    its shared-memory segments there; without them the next tensor-parallel run on the machine fails)
    but not the interpreter's finalization. It is called with the GIL held, so no Python thread runs
    while the process ends.
    """
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed, or a reader that went away
            stream.flush()
    with contextlib.suppress(OSError, AttributeError):  # no C library to call: end at once
        ctypes.PyDLL(None).exit(code)
    os._exit(code)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_gather_objects(obj, group=None) -> list:
    """Every rank's `obj`, in rank order (a list of one object when alone)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj, src: int = 0, group=None):
    """`obj` of rank `src` (a global rank) on every rank of `group` (default: all)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_reduce(value: float | int, op: str = "sum", group=None, device: torch.device | None = None) -> float:
    """A number reduced over ranks ('sum', 'max', 'min')."""
    if not dist.is_initialized():
        return value
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    tensor = torch.tensor([float(value)], dtype=torch.float64, device=device or context().device)
    dist.all_reduce(tensor, op=ops[op], group=group)
    return float(tensor.item())


def shard_range(count: int, rank: int, world: int) -> range:
    """The contiguous slice of `count` items rank `rank` of `world` handles (sizes differ by at most one)."""
    base, extra = divmod(count, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))
