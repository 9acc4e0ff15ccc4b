"""Expert parallelism (EP) for mixture-of-experts models under FSDP2: each MoE layer's experts split over the
`ep_degree` ranks of an expert-parallel group, tokens sent to the rank holding their expert and back with
all-to-all (`torch.distributed.all_to_all_single`, which gloo, NCCL and HCCL all run).

The ranks form a (edp, ep) grid, expert-parallel neighbours adjacent: rank = edp_rank * ep_degree + ep_rank. EP
rank r holds experts [r * E / ep, (r + 1) * E / ep) of every MoE layer. The expert parameters (`gate_up_proj`
[E, 2I, H], `down_proj` [E, H, I]) become DTensors sharded on dim 0 over the ep dimension, then FSDP-shards them
over the edp dimension (the world / ep ranks that hold the same experts): their own `fully_shard` unit inside
each decoder layer's. Everything else (attention, norms, routers, embeddings) is FSDP-sharded over all ranks as
without EP. The state dicts (`get_model_state_dict` with full tensors, DCP shards) see whole [E, ...] tensors, so
checkpoints and `rlx merge` are the same with EP on.

The forward plugs in through transformers' experts-function registry (`ExpertsInterface`, the
`@use_experts_implementation` dispatch on `config._experts_implementation`), not by replacing `forward`: the
router stays in place (routing replay and the router probes keep working), and the registered function reads the
`ExpertShard` that `apply_expert_parallel` leaves on each experts module. It targets transformers 5.17's experts
modules (the decorator's `_apply_gate`, `has_bias`, `is_transposed` and the undecorated `forward.__wrapped__`);
tests/distributed/test_moe_ep.py compares it with transformers' own experts forward and fails when those change.

Local experts: the rows a rank receives are sorted by its local expert and run as one grouped GEMM per projection
(gate/up, then down; `torch.nn.functional.grouped_mm` with per-expert row offsets computed on the device, with its
autograd), so a layer costs no Python loop over experts and no host sync beyond the all-to-all's split sizes. Where
the grouped kernel cannot run (dtype, row alignment, old torch) the experts run one by one (`run_sorted_experts`).

Gradients: every rank's loss is scaled by the world size and FSDP averages over the ranks that share a parameter.
A dense parameter is shared by all ranks (world / world = 1); an expert's weights receive the gradients of every
token its EP group sent to it and are averaged over edp = world / ep ranks only, so their gradient is scaled by
1 / ep in the forward (`_scale_grad`) to equal one process's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from rlx.errors import UserError
from rlx.kernels.grouped_experts import grouped_linear, grouped_mm_trains
from rlx.models.family import family_of
from rlx.parallel.dist import DistContext

EP_IMPLEMENTATION = "rlx_expert_parallel"
"""The name rlx's expert-parallel forward is registered under in transformers' ExpertsInterface."""
EXPERT_PARAMS = ("gate_up_proj", "down_proj")
"""The fused expert parameters EP splits on dim 0 (experts)."""


@dataclass(frozen=True)
class ExpertShard:
    """What an experts module under EP needs in its forward: its group and which experts it holds."""

    group: object
    """The expert-parallel process group (ep_degree ranks)."""
    degree: int
    """ep_degree."""
    rank: int
    """This process's rank in `group`."""
    num_experts: int
    """E, the layer's experts over all ranks."""

    @property
    def num_local(self) -> int:
        return self.num_experts // self.degree


def validate_ep(model: torch.nn.Module, ctx: DistContext, ep_degree: int) -> None:
    """UserError unless `ep_degree` fits the model and the launch: an MoE model, several processes under a
    launcher, world size and expert count divisible by it, no sequence parallelism."""
    if ep_degree == 1:
        return
    family = family_of(model.config)
    if not family.routed_experts:
        raise UserError(f"ep_degree {ep_degree}: expert parallelism needs a mixture-of-experts model "
                        f"({model.config.model_type} has no routed experts)")  # fmt: skip
    if not ctx.distributed or ctx.world % ep_degree:
        raise UserError(f"ep_degree {ep_degree} must divide the number of processes ({ctx.world}; launch with "
                        f"torchrun --nproc_per_node N)")  # fmt: skip
    if ctx.sp_degree > 1:
        raise UserError(f"ep_degree {ep_degree} with sp_degree {ctx.sp_degree}: expert and sequence parallelism "
                        f"do not combine yet")  # fmt: skip
    for experts in family.expert_modules(model):
        num_experts = experts.gate_up_proj.shape[0]
        if num_experts % ep_degree:
            raise UserError(f"ep_degree {ep_degree} must divide the number of experts per layer ({num_experts})")
        if getattr(experts, "has_bias", False) or getattr(experts, "is_transposed", False):
            raise UserError(f"ep_degree {ep_degree}: {type(experts).__name__} has a weight layout rlx's "
                            f"expert-parallel forward does not run (bias or transposed experts)")  # fmt: skip


def build_ep_mesh(ctx: DistContext, ep_degree: int) -> DeviceMesh:
    """The (edp, ep) device mesh of all ranks, ep neighbours adjacent."""
    return init_device_mesh(ctx.device.type, (ctx.world // ep_degree, ep_degree), mesh_dim_names=("edp", "ep"))


def apply_expert_parallel(model: torch.nn.Module, ctx: DistContext, ep_degree: int, fsdp_kwargs: dict) -> None:
    """Split every MoE layer's experts over the EP groups (in place), FSDP-shard them over the edp dimension
    with `fsdp_kwargs` (mixed precision, offload; not the mesh) and route their forward through EP. Call before
    the decoder layers' own `fully_shard`."""
    from torch.distributed.fsdp import fully_shard
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    validate_ep(model, ctx, ep_degree)
    mesh = build_ep_mesh(ctx, ep_degree)
    ep_mesh, ep_rank = mesh["ep"], mesh.get_local_rank("ep")
    ALL_EXPERTS_FUNCTIONS.register(EP_IMPLEMENTATION, expert_parallel_forward)
    for experts in family_of(model.config).expert_modules(model):
        num_experts = experts.gate_up_proj.shape[0]
        shard = ExpertShard(ep_mesh.get_group(), ep_degree, ep_rank, num_experts)
        lo, hi = ep_rank * shard.num_local, (ep_rank + 1) * shard.num_local
        for name in EXPERT_PARAMS:
            full = getattr(experts, name)
            local = DTensor.from_local(full.detach()[lo:hi].clone(), ep_mesh, [Shard(0)], run_check=False)
            experts.register_parameter(name, torch.nn.Parameter(local, requires_grad=full.requires_grad))
        experts.expert_shard = shard
        experts.config._experts_implementation = EP_IMPLEMENTATION
        fully_shard(experts, mesh=mesh["edp"], **fsdp_kwargs)


AUTOCAST_IMPLEMENTATION = "rlx_autocast_experts"
"""rlx's one-process experts forward (grouped GEMMs in autocast's dtype) in transformers' ExpertsInterface."""


def use_autocast_experts(model: torch.nn.Module) -> None:
    """Run `model`'s routed experts in autocast's dtype where autocast is on (a process training float32 weights
    under bf16 autocast, without FSDP), as autocast runs every `nn.Linear`: transformers' grouped_mm experts cast
    the tokens to the weights' float32 instead, and CUDA's grouped GEMM in float32 is torch's per-group loop without
    tensor cores. Elsewhere (no autocast, or weights already in its dtype) the model's own experts forward runs
    unchanged. Experts with biases or another weight layout keep transformers' forward."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    modules = family_of(model.config).expert_modules(model)
    layouts = [(m.has_bias, m.is_transposed, m.is_concatenated, m.has_gate) for m in modules if hasattr(m, "has_bias")]
    if not modules or len(layouts) != len(modules) or any(layout != (False, False, True, True) for layout in layouts):
        return
    ALL_EXPERTS_FUNCTIONS.register(AUTOCAST_IMPLEMENTATION, autocast_experts_forward)
    own = {id(m.config): m.config._experts_implementation for m in modules}  # before any is set (configs are shared)
    for experts in modules:  # a second model on the same config object: transformers' default
        implementation = own[id(experts.config)]
        unknown = implementation == AUTOCAST_IMPLEMENTATION
        experts.own_experts_implementation = "grouped_mm" if unknown else implementation
    for experts in modules:
        experts.config._experts_implementation = AUTOCAST_IMPLEMENTATION


def autocast_experts_forward(experts, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
    """transformers' experts forward signature (see `expert_parallel_forward`) on one process: under autocast with
    weights of another dtype, each (token, slot) pair sorted by expert and run as grouped GEMMs in autocast's dtype
    (`run_sorted_experts`), the routing weights applied and summed per token in the hidden states' dtype; otherwise
    the experts' own implementation."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    device = hidden_states.device.type
    if not torch.is_autocast_enabled(device) or torch.get_autocast_dtype(device) == experts.gate_up_proj.dtype:
        own = getattr(experts, "own_experts_implementation", "grouped_mm")  # another model built from this config
        forward = ALL_EXPERTS_FUNCTIONS.get_interface(own, type(experts).forward.__wrapped__)
        return forward(experts, hidden_states, top_k_index, top_k_weights)
    order, sizes = _sort_by_expert(top_k_index, experts.gate_up_proj.shape[0])
    rows = hidden_states[order // top_k_index.shape[1]]  # [N k, H] sorted by expert
    outputs = run_sorted_experts(experts, experts.gate_up_proj, experts.down_proj, rows, sizes)
    return _weighted_sum(hidden_states, outputs, order, top_k_weights)


def _sort_by_expert(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """top_k_index [N, k] -> (order [N k]: the (token, slot) pairs grouped by expert, stable; sizes [E]: each
    expert's pairs, a bincount of static size: no host sync)."""
    flat = top_k_index.reshape(-1)
    sizes = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    return flat.argsort(stable=True), sizes.scatter_add_(0, flat, torch.ones_like(flat))


def _weighted_sum(hidden_states, outputs, order, top_k_weights) -> torch.Tensor:
    """outputs [N k, H] of the pairs in `order` -> [N, H]: each token's expert outputs times its routing weights,
    summed in the hidden states' dtype."""
    weights = top_k_weights.reshape(-1)[order, None]
    final = torch.zeros_like(hidden_states)
    return final.index_add_(0, order // top_k_weights.shape[1], (outputs * weights).to(final.dtype))


class _AllToAll(torch.autograd.Function):
    """all_to_all_single along dim 0 with uneven splits; the backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times `scale` (see the module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def _local_weights(experts: torch.nn.Module, shard: ExpertShard) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's experts' (gate_up [E/ep, 2I, H], down [E/ep, H, I]) as plain tensors with autograd to the
    parameters, their gradient scaled by 1 / ep."""
    out = []
    for name in EXPERT_PARAMS:
        weight = getattr(experts, name)
        weight = weight.to_local() if isinstance(weight, DTensor) else weight
        out.append(_ScaleGrad.apply(weight, 1.0 / shard.degree))
    return out[0], out[1]


def expert_parallel_forward(experts, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
    """transformers' experts forward signature under EP: hidden_states [N, H], top_k_index / top_k_weights
    [N, k] (global expert ids and the router's weights) -> [N, H], the weighted sum of each token's experts.

    Each (token, slot) pair is sorted by expert, sent to the EP rank holding that expert, run there, and sent
    back; the routing weights are applied where the token lives (so the router's gradient stays local)."""
    shard: ExpertShard | None = getattr(experts, "expert_shard", None)
    if shard is None:  # another model built from the same config object (not split): transformers' own loop
        return type(experts).forward.__wrapped__(experts, hidden_states, top_k_index, top_k_weights)
    top_k = top_k_index.shape[1]
    order, counts = _sort_by_expert(top_k_index, shard.num_experts)  # pairs grouped by expert, so by destination
    received_counts = torch.empty_like(counts)  # [ep * E/ep]: per source rank, its pairs for my experts
    dist.all_to_all_single(received_counts, counts, group=shard.group)
    received_counts = received_counts.view(shard.degree, shard.num_local)
    sizes = torch.stack((counts.view(shard.degree, shard.num_local).sum(1), received_counts.sum(1)))  # [2, ep]
    send, receive = sizes.tolist()  # the one host sync: all_to_all_single takes its split sizes as lists
    received = _AllToAll.apply(hidden_states[order // top_k], receive, send, shard.group)  # [M, H]
    outputs = _run_local_experts(experts, shard, received, received_counts)  # [M, H]
    returned = _AllToAll.apply(outputs, send, receive, shard.group)  # [N k, H] in `order`
    return _weighted_sum(hidden_states, returned, order, top_k_weights)


def _run_local_experts(experts, shard: ExpertShard, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Run `tokens` [M, H] (grouped by source rank, then by local expert, `counts` [ep, E/ep]) through this rank's
    experts; [M, H] in the same order."""
    gate_up, down = _local_weights(experts, shard)
    local_ids = torch.arange(shard.num_local, device=tokens.device).repeat(shard.degree)  # [ep * E/ep]
    expert_of = local_ids.repeat_interleave(counts.flatten(), output_size=tokens.shape[0])  # [M]
    order = expert_of.argsort(stable=True)  # rows by local expert, each expert's rows by source rank
    outputs = run_sorted_experts(experts, gate_up, down, tokens[order], counts.sum(0))  # [M, H] in `order`
    return torch.empty_like(outputs).index_copy(0, order, outputs)


def run_sorted_experts(
    experts, gate_up: torch.Tensor, down: torch.Tensor, rows: torch.Tensor, sizes: torch.Tensor, impl: str = "auto"
) -> torch.Tensor:
    """rows [M, H] sorted by expert, `sizes` [E'] (each expert's rows, a device tensor) through the experts gate_up
    [E', 2I, H] and down [E', H, I] (gated by `experts._apply_gate`) -> [M, H] in rows' dtype.

    impl 'grouped': one grouped GEMM per projection (rlx.kernels.grouped_experts.grouped_linear), in autocast's
    dtype where autocast is on (as `F.linear` would), else the weights'; 'loop': two `F.linear` per expert after one
    host sync (the fallback); 'auto': grouped where `grouped_mm_trains`. No rows (an EP rank no token was sent to)
    gives zero gradients for the weights all the same, so FSDP's reduce over the rank's peers lines up."""
    if not rows.shape[0]:
        return rows + (gate_up[:0].sum() + down[:0].sum()).to(rows.dtype)
    device = rows.device
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else gate_up.dtype
    if impl == "auto":
        impl = "grouped" if grouped_mm_trains(device, dtype, gate_up, down) else "loop"
    if impl == "grouped":
        offsets = sizes.cumsum(0, dtype=torch.int32)  # [E']: the end row of each expert's group
        gated = experts._apply_gate(grouped_linear(rows.to(dtype), gate_up.to(dtype), offsets))  # [M, I]
        return grouped_linear(gated.to(dtype), down.to(dtype), offsets).to(rows.dtype)
    if impl != "loop":
        raise ValueError(f"local experts impl {impl!r}: expected auto, grouped or loop")
    outputs = []  # unbind, not gate_up[e]: its backward stacks the experts' gradients once, not E full-size zeros
    for chunk, gate_up_e, down_e in zip(rows.split(sizes.tolist()), gate_up.unbind(0), down.unbind(0), strict=True):
        hidden = experts._apply_gate(torch.nn.functional.linear(chunk, gate_up_e))  # [n, I]
        outputs.append(torch.nn.functional.linear(hidden, down_e))  # [n, H]
    return torch.cat(outputs).to(rows.dtype)


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for FSDP-sharded parameters whose DTensors live on several device meshes
    (the dense model's and the experts' (edp, ep) mesh). Every gradient element lies in exactly one rank's shard
    (FSDP and EP only shard), so the squared norm is the sum of each rank's local squares, reduced once over all
    ranks. Returns the total norm (the same on every rank)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not all(isinstance(g, DTensor) and _only_sharded(g) for g in grads):
        raise ValueError("clip_grad_norm takes sharded DTensor gradients only (FSDP2 under expert parallelism)")
    local = [g.to_local() for g in grads]
    squares = torch.stack([n.float() for n in torch._foreach_norm(local)]).square().sum() if local else None
    squares = squares if squares is not None else torch.zeros((), device=torch.device("cpu"))
    if dist.is_initialized():
        dist.all_reduce(squares)
    total_norm = squares.sqrt()
    scale = max_norm / (float(total_norm) + 1e-6)  # as torch: the coefficient clamped at 1
    if scale < 1:
        torch._foreach_mul_(local, scale)
    return total_norm


def _only_sharded(tensor: DTensor) -> bool:
    """Whether each element of `tensor` lies on one rank only (sharded on every mesh dimension, FSDP's strided
    shards included)."""
    return not any(p.is_replicate() or p.is_partial() for p in tensor.placements)
