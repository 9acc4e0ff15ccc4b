"""FSDP2 for the trained models: `fully_shard` per decoder layer (and vision-tower block) and on the root (the last
step of rlx/parallel/apply.py), and the full (unsharded) weights of a plain or sharded module.

Mixed precision: parameters are gathered in the compute dtype (bf16 on accelerators), gradients are
reduce-scattered in float32, and the sharded master weights and optimizer state stay float32. CPU
offload keeps the shards and their gradients on the CPU, so AdamW's state and step run there too.
FSDP averages gradients over ranks; rlx's losses are already normalised by the global token count,
so trainers multiply each rank's loss by the world size (`GRADIENT_SCALE`) and the average becomes
the gradient of the whole mini-batch. (A divide factor of 1 would say the same, but FSDP then uses
PREMUL_SUM reductions, which gloo lacks.)
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from rlx.models.family import family_of
from rlx.parallel.dist import DistContext


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder blocks of an HF causal LM (or value model): its family's decoder's `layers` list."""
    return family_of(model.config).decoder_layers(model)


def apply_fsdp(
    model: torch.nn.Module, ctx: DistContext, param_dtype: torch.dtype, offload: bool = False, ep_degree: int = 1
):
    """Shard `model` over all ranks of `ctx` (in place) and return it; with `ep_degree` > 1 the MoE experts are
    split over expert-parallel groups first (rlx/parallel/experts.py), each its own FSDP unit."""
    kwargs = {
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32),
        "offload_policy": CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda") if offload else OffloadPolicy(),
    }
    if ep_degree > 1:
        from rlx.parallel.experts import apply_expert_parallel

        apply_expert_parallel(model, ctx, ep_degree, kwargs)
    kwargs["mesh"] = init_device_mesh(ctx.device.type, (ctx.world,))
    for layer in family_of(model.config).fsdp_units(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


@contextlib.contextmanager
def kept_gathered(model: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """Within the block, an FSDP-sharded model's forwards keep their gathered parameters (the next forward and the
    backward gather nothing); all of them are resharded at its end. Nothing for a plain model or `enabled` False.
    A train step in the block also sets `set_reshard_after_backward` per micro-batch (True on the last only), so the
    backward keeps them for the next micro-batch's forward (Trainer.accumulate_gradients)."""
    from torch.distributed.fsdp import FSDPModule

    if not enabled or not isinstance(model, FSDPModule):
        yield
        return
    model.set_reshard_after_forward(False)
    try:
        yield
    finally:
        model.set_reshard_after_forward(True)
        model.set_reshard_after_backward(True)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


@contextlib.contextmanager
def activation_offload(enabled: bool, device: torch.device) -> Iterator[None]:
    """Keep the tensors saved for backward on the CPU during the block (pinned when on CUDA)."""
    if not enabled:
        yield
        return
    with torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda"):
        yield


def full_tensor(value) -> torch.Tensor:
    """A DTensor's full value (e.g. FSDP's gradient norm), or the tensor itself."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def model_weights(model: torch.nn.Module, offload: bool = True) -> dict[str, torch.Tensor]:
    """The model's full state dict on the CPU without tied duplicates (as Hugging Face saves it); for an
    FSDP-sharded model the gathered weights on rank 0 ({} on other ranks): every rank must call it. With
    `offload=False` (an unsharded model) the live tensors on their device."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from rlx.models.loading import tied_keys

    skip = tied_keys(model)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=offload))
    return {k: v for k, v in state.items() if k not in skip}


def gathered_weights(model: torch.nn.Module, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's full (name, tensor) pairs on its device, sharded ones all-gathered a bucket of about
    `bucket_bytes` at a time (every rank must drain the iterator in step); tied names appear under each name."""
    return gathered_in_buckets(model.state_dict().items(), bucket_bytes)


def gathered_in_buckets(
    pairs: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for each (name, tensor, sharded or not) pair, the sharded ones all-gathered a bucket of
    about `bucket_bytes` at a time (a collective: every rank drains the iterator in step, with the same pairs)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in pairs:
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield from _gathered(bucket)
            bucket, size = [], 0
    yield from _gathered(bucket)


def _gathered(bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The bucket's full tensors: row-sharded ones of one mesh and dtype in one all-gather, the rest one by one."""
    full: dict[int, torch.Tensor] = {}
    groups: dict[tuple, list[int]] = {}
    for i, (_, t) in enumerate(bucket):
        if _row_sharded(t):
            groups.setdefault((id(t.device_mesh), t.dtype), []).append(i)
    for indices in groups.values():
        full.update(zip(indices, _all_gather_rows([bucket[i][1] for i in indices])))
    return [
        (n, full[i] if i in full else t.full_tensor() if hasattr(t, "full_tensor") else t.detach())
        for i, (n, t) in enumerate(bucket)
    ]


def _row_sharded(t) -> bool:
    """A DTensor split by rows over a one-dimensional mesh (FSDP2's layout of a parameter)."""
    from torch.distributed.tensor import DTensor, Shard

    return isinstance(t, DTensor) and t.device_mesh.ndim == 1 and tuple(t.placements) == (Shard(0),) and t.ndim > 0


def _all_gather_rows(tensors: list) -> list[torch.Tensor]:
    """The full values of row-sharded DTensors of one mesh and dtype, in one all-gather: each rank sends its
    shards padded to the full chunk (ceil(rows / ranks) rows, as torch.chunk and Shard(0) split), flattened."""
    import torch.distributed as dist

    mesh = tensors[0].device_mesh
    ranks = mesh.size()
    chunks = [-(-t.shape[0] // ranks) for t in tensors]  # rows of a full chunk
    widths = [math.prod(t.shape[1:]) for t in tensors]  # elements per row
    sizes = [c * w for c, w in zip(chunks, widths)]
    local = [t.to_local().detach().reshape(-1) for t in tensors]
    send = torch.cat([torch.nn.functional.pad(x, (0, size - x.numel())) for x, size in zip(local, sizes)])
    out = send.new_empty(ranks * send.numel())
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch >= 2.13 : before
    gather(out, send, group=mesh.get_group())
    per_rank = out.view(ranks, send.numel()).split(sizes, dim=1)
    full = []
    for t, chunk, width, pieces in zip(tensors, chunks, widths, per_rank):
        rows = [max(0, min(chunk, t.shape[0] - r * chunk)) for r in range(ranks)]
        parts = [pieces[r, : rows[r] * width] for r in range(ranks)]
        full.append(torch.cat(parts).view(t.shape))
    return full


@torch.no_grad()
def fill_from_rank0(shards: dict[str, torch.Tensor], full: dict[str, torch.Tensor] | None, device) -> None:
    """Fill every rank's live `shards` ({name: DTensor shard or whole tensor}: a trainer's model_shards) from rank
    0's `full` weights ({name: whole tensor}, None on the other ranks), one tensor at a time: rank 0 scatters each
    sharded one (every rank keeps its rows) and broadcasts the rest. What lets the other ranks of a fresh start
    build their models unfilled instead of each loading the whole float32 policy on the host (a collective: every
    rank calls it with the same names)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, live in shards.items():
        if full is not None and name not in full:
            raise KeyError(f"{name}: not among the weights of the model rank 0 loaded")
        if full is not None:
            source = full[name].to(device, live.dtype)
        else:  # what rank 0 sends lands here (a scatter ignores it)
            source = torch.empty(live.shape, dtype=live.dtype, device=device)
        if isinstance(live, DTensor):
            scattered = distribute_tensor(source, live.device_mesh, live.placements, src_data_rank=0)
            live.to_local().copy_(scattered.to_local())
        else:
            dist.broadcast(source, src=0)
            live.copy_(source)


@torch.no_grad()
def broadcast_module(module: torch.nn.Module) -> None:
    """Every parameter and buffer of `module` (whole on every rank, e.g. a reference model) as rank 0 holds them."""
    import torch.distributed as dist

    for tensor in [*module.parameters(), *module.buffers()]:
        dist.broadcast(tensor.data, src=0)
