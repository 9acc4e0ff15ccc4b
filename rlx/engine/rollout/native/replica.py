"""A full copy of an FSDP-sharded policy for the native engine to generate with.

The decode loop runs each rank's own sequences at its own pace, which FSDP's per-layer all-gathers (every
rank in every forward) cannot follow. So before a rollout every rank gathers the shards, one parameter at a
time, into a replica of the model in the rollout dtype: built once on the meta device (no initialisation),
filled in place before each `generate` (the decode CUDA graphs keep pointing at the same storage), and freed
by the engine's `sleep()` so the trainer gets the memory back. Peak extra memory: the replica plus one
gathered parameter in float32.
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether any parameter of `model` is a DTensor (FSDP2 shards)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def _unsharded_class(model: torch.nn.Module) -> type:
    """FSDP2 swaps a module's class for a subclass named 'FSDP<Class>'; the model class it wraps."""
    name = type(model).__name__.removeprefix("FSDP")
    return next(c for c in type(model).__mro__ if c.__name__ == name and not issubclass(c, FSDPModule))


def build_replica(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """An empty unsharded model of `model`'s class and config on `device` in `dtype`, its buffers (rotary
    frequencies and the like, never sharded) copied from `model`; `fill_replica` writes the weights."""
    config = copy.deepcopy(model.config)
    with torch.device("meta"):
        replica = _unsharded_class(model)(config)
    replica = replica.to(dtype=dtype).to_empty(device=device)
    replica.tie_weights()  # to_empty makes new tensors: a tied head would be a separate one
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            replica.get_buffer(name).copy_(buffer)
    return replica.eval().requires_grad_(False)


@torch.no_grad()
def fill_replica(replica: torch.nn.Module, model: torch.nn.Module) -> None:
    """Copy `model`'s current weights into `replica` (a collective: every rank of the shards' mesh calls it,
    with the same model)."""
    params = dict(replica.named_parameters())
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            # the shard on the replica's device first: with CPU offload it lives on the host, and NCCL gathers
            # only device memory
            local = param.to_local().to(params[name].device)
            param = DTensor.from_local(
                local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
            ).full_tensor()
        params[name].copy_(param)
