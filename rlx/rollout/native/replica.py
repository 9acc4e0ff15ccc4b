"""A full copy of an FSDP-sharded policy (or of a LoRA policy, merged) for the native engine to generate with.

The decode loop runs each rank's own sequences at its own pace, which FSDP's per-layer all-gathers (every
rank in every forward) cannot follow. So before a rollout every rank gathers the shards, one parameter at a
time, into a replica of the model in the rollout dtype: built once on the meta device (no initialisation),
filled in place before each `generate` (the decode CUDA graphs keep pointing at the same storage), and freed
by the engine's `sleep()` so the trainer gets the memory back. Peak extra memory: the replica plus one
gathered parameter in float32.

A LoRA policy (PEFT layers, rlx.models.lora) gets either a plain replica holding the merged weights
(W + alpha/r B A, computed in float32 and rounded once, each expert's own delta on adapted expert weights; after the
first fill only the adapted weights and a trained head are refreshed) or, FSDP-sharded, a replica with the same
adapters, filled tensor by tensor.
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from rlx.models.lora import ADAPTER, adapted_parameters, hf_name, import_peft, is_adapter_param, trained_parameters
from rlx.models.lora_merge import merged_layer_weight
from rlx.rollout.native.fused import fusable, merge_projections, projection_groups
from rlx.utils.vmm import VirtualBuffer, carve


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether any parameter of `model` is a DTensor (FSDP2 shards)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def _unsharded_class(model: torch.nn.Module) -> type:
    """FSDP2 swaps a module's class for a subclass named 'FSDP<Class>'; the model class it wraps."""
    name = type(model).__name__.removeprefix("FSDP")
    return next(c for c in type(model).__mro__ if c.__name__ == name and not issubclass(c, FSDPModule))


def build_replica(
    model: torch.nn.Module, device: torch.device, dtype: torch.dtype, adapters: bool = False,
    releasable: bool = False, config=None,
) -> tuple[torch.nn.Module, VirtualBuffer | None]:  # fmt: skip
    """An empty unsharded model of `model`'s class and config on `device` in `dtype`, its buffers (rotary
    frequencies and the like, never sharded) copied from `model`; `fill_replica` writes the weights. With
    `adapters`, it gets `model`'s LoRA adapters too (same names and shapes, in `dtype`). With `releasable` (CUDA),
    the parameters live in one VirtualBuffer (rlx.utils.vmm), also returned: its memory can be released and
    taken back at the same addresses, so CUDA graphs reading the weights stay valid. The decoder layers' q/k/v and
    gate/up weights are rows of merged tensors where the native engine decodes through them (fused.py). `config`:
    another config of the same class (a tensor-parallel rank's slice, tensor_parallel.py) instead of `model`'s."""
    config = copy.deepcopy(model.config if config is None else config)
    with torch.device("meta"):
        replica = _unsharded_class(model)(config)
        if adapters:
            peft_config = copy.deepcopy(model.peft_config[ADAPTER])
            import_peft().inject_adapter_in_model(peft_config, replica, adapter_name=ADAPTER)
    replica = replica.to(dtype=dtype)
    memory = None
    if releasable:
        memory = _place_in_buffer(replica, device)
        for module in replica.modules():  # the module buffers, left on the meta device
            for name, value in module._buffers.items():
                if value is not None:
                    module._buffers[name] = torch.empty_like(value, device=device)
    else:
        replica = replica.to_empty(device=device)
        replica.tie_weights()  # to_empty makes new tensors: a tied head would be a separate one
        merge_projections(replica)
    with torch.no_grad():
        for name, value in model.named_buffers():
            replica.get_buffer(name).copy_(value)
    return replica.eval().requires_grad_(False), memory


def _place_in_buffer(replica: torch.nn.Module, device: torch.device) -> VirtualBuffer:
    """Give every parameter of `replica` (on the meta device) storage in one new VirtualBuffer on `device` (a
    parameter shared by two modules, a tied head, stays shared; merged projections: rows of one tensor)."""
    params = {id(p): p for p in replica.parameters()}
    groups = [[id(p) for p in group] for group in projection_groups(replica)] if fusable(replica) else []
    grouped = {key for group in groups for key in group}
    alone = [key for key in params if key not in grouped]
    shapes = [((sum(params[k].shape[0] for k in g), *params[g[0]].shape[1:]), params[g[0]].dtype) for g in groups]
    buffer, tensors = carve(shapes + [(tuple(params[k].shape), params[k].dtype) for k in alone], device)
    placed = {key: torch.nn.Parameter(t, requires_grad=False) for key, t in zip(alone, tensors[len(groups) :])}
    for group, merged in zip(groups, tensors):
        for key, rows in zip(group, merged.split([params[k].shape[0] for k in group])):
            placed[key] = torch.nn.Parameter(rows, requires_grad=False)
    for module in replica.modules():
        for name, param in module._parameters.items():
            if param is not None:
                module._parameters[name] = placed[id(param)]
    return buffer


def _gathered(param: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A parameter's full value (all-gathered when it is an FSDP shard: a collective)."""
    if not isinstance(param, DTensor):
        return param.detach()
    # the shard on the replica's device first: with CPU offload it lives on the host, and NCCL gathers only
    # device memory
    local = param.to_local().to(device)
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    ).full_tensor()


def _whole(name: str, value: torch.Tensor) -> torch.Tensor:
    return value


@torch.no_grad()
def fill_replica(replica: torch.nn.Module, model: torch.nn.Module, take=_whole, bucket_bytes: int = 0) -> None:
    """Copy `model`'s current weights into `replica` (a collective: every rank of the shards' mesh calls it,
    with the same model). `take(name, full value)`: the part of each gathered parameter the replica holds (a
    tensor-parallel rank's slice). FSDP shards on the replica's device are gathered `bucket_bytes` at a time, one
    all-gather a bucket (`gathered_in_buckets`; 0, or shards elsewhere such as offloaded to the host: one parameter
    at a time, each its own collective)."""
    params = dict(replica.named_parameters())
    named = list(model.named_parameters())
    device = next(iter(params.values())).device if params else None
    local = [p.to_local() for _, p in named if isinstance(p, DTensor)]
    if bucket_bytes and local and all(t.device == device for t in local):
        from rlx.parallel.fsdp import gathered_in_buckets

        for name, value in gathered_in_buckets(((n, p.detach()) for n, p in named), bucket_bytes):
            params[name].copy_(take(name, value))
        return
    for name, param in named:
        params[name].copy_(take(name, _gathered(param, params[name].device)))


@torch.no_grad()
def fill_merged_replica(
    replica: torch.nn.Module, model: torch.nn.Module, include_frozen: bool = True, take=_whole
) -> int:
    """Copy LoRA `model`'s weights with the adapters merged into the plain `replica` (Hugging Face names); without
    `include_frozen` only what training changes (adapted weights, a critic's head). A collective when sharded.
    `take` as for `fill_replica`. Returns the number of tensors copied."""
    params = dict(replica.named_parameters())
    layers = adapted_parameters(model)  # linear layers' and expert weights' (rlx.models.lora_experts)
    trained, count = trained_parameters(model), 0
    for name, param in model.named_parameters():
        if is_adapter_param(name):
            continue  # they go in with their base weight
        target = params.get(hf_name(name))
        if target is None:
            raise ValueError(f"{type(replica).__name__} has no parameter {hf_name(name)} to fill")
        if name in layers:
            layer = layers[name]
            a, b = (_gathered(m[ADAPTER].weight, target.device) for m in (layer.lora_A, layer.lora_B))
            value = merged_layer_weight(layer, _gathered(param, target.device), a, b)
        elif include_frozen or name in trained:
            value = _gathered(param, target.device)
        else:
            continue
        target.copy_(take(hf_name(name), value))
        count += 1
    return count
