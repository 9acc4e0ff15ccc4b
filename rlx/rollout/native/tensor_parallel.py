"""Tensor parallelism of the native engine: the ranks of a group decode together, each with a slice of every layer.

The split is Megatron's. The q/k/v and gate/up projections are column-parallel (each rank holds
num_heads / T query heads, num_key_value_heads / T key/value heads and intermediate_size / T MLP rows); o_proj
and down_proj are row-parallel (the matching input columns), so each rank's output is a partial sum and one
all-reduce after attention and one after the MLP give every rank the full hidden state. The embedding, the norms
and the LM head stay whole on every rank, so every rank computes the same logits and, with the same per-sample
random draws, samples the same tokens: the ranks of a group stay in step with no other communication (the
scheduler, the block manager and the sampler run on each rank alike). A row-parallel bias is added once: rank 0
holds it, the others zeros. Each rank's KV cache holds its own key/value heads (1/T of the cache per token).

The decoder a rank runs is a Hugging Face model of the same class built from a config with the heads and the MLP
width divided by T (`sliced_config`); forward hooks on o_proj and down_proj add the all-reduce to its own layers
(prefill and eager decode), and the merged decode step (fused.py) all-reduces itself. Its weights come from the
full model one parameter at a time (`rank_slice` of each gathered parameter): a trainer's FSDP shards are gathered
parameter by parameter, never the whole model at once.

Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral) split every expert the way a dense MLP splits: each rank
holds all E experts at 1/T of their width (the gate and up halves of `experts.gate_up_proj` [E, 2I, H] by rows,
`experts.down_proj` [E, H, I] by columns) and the router whole, so every rank routes each token alike and the
routed output is a partial sum, all-reduced like the dense MLP's (moe.py; a forward hook on the experts module for
the model's own layers). Qwen2-MoE's shared expert is a dense MLP (split the same way). OLMoE is refused: its query
and key norms span all heads.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.distributed as dist

from rlx.errors import UserError
from rlx.rollout.native.fused import FAMILIES

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
"""Projections split by output features (their weight's rows, and their bias)."""
ROW_PARALLEL = ("o_proj", "down_proj")
"""Projections split by input features (their weight's columns); their outputs are summed over the group."""
MOE_SPLITTABLE = ("qwen3_moe", "qwen2_moe", "mixtral")
"""MoE model types whose experts split by width (OLMoE's query/key norms over all heads do not split by head)."""
_WIDTHS = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")
"""MLP widths a rank takes 1/T of, where the config has them (dense, routed expert, shared expert)."""


def check_splittable(config, degree: int) -> None:
    """A UserError unless a model of `config` splits over `degree` ranks: a Llama-family text decoder (or an MoE
    one of `MOE_SPLITTABLE`) whose attention heads, key/value heads and MLP widths are multiples of `degree`."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES + MOE_SPLITTABLE:
        raise UserError(
            f"tp_degree {degree}: the native engine splits {', '.join(FAMILIES)} models only, not {model_type!r} "
            f"(and of the mixture-of-experts families {', '.join(MOE_SPLITTABLE)})"
        )
    sizes = {name: getattr(config, name, None) or config.num_attention_heads
             for name in ("num_attention_heads", "num_key_value_heads")}  # fmt: skip
    sizes.update({name: getattr(config, name) for name in _WIDTHS if getattr(config, name, None)})
    for name, value in sizes.items():
        if value % degree:
            raise UserError(
                f"tp_degree {degree}: the model's {name} ({value}) is not a multiple of it (each rank takes an equal "
                f"share); choose a tp_degree dividing it"
            )


def sliced_config(config, degree: int):
    """A copy of `config` for one rank's decoder: heads, key/value heads and MLP width divided by `degree`, the
    head size kept."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    out = copy.deepcopy(config)
    out.head_dim = head_dim
    out.num_attention_heads = config.num_attention_heads // degree
    out.num_key_value_heads = kv_heads // degree
    for name in _WIDTHS:
        if getattr(config, name, None):
            setattr(out, name, getattr(config, name) // degree)
    return out


def rank_slice(name: str, value: torch.Tensor, degree: int, rank: int) -> torch.Tensor:
    """The part of full parameter `name` (Hugging Face name, `value` its whole tensor) that rank `rank` of
    `degree` holds: a view of rows or columns for split projections, zeros for a row-parallel bias off rank 0,
    the whole tensor for everything else. Fused experts: each expert's gate and up rows (a copy), or its down
    projection's columns."""
    *_, module, kind = name.split(".")
    if module == "experts" and kind == "gate_up_proj":  # [E, 2I, H]: the rank's share of the gate rows, then up's
        return value.unflatten(1, (2, -1)).chunk(degree, dim=2)[rank].flatten(1, 2)
    if module == "experts" and kind == "down_proj":  # [E, H, I]
        return value.chunk(degree, dim=2)[rank]
    if module in COLUMN_PARALLEL:
        return value.chunk(degree, dim=0)[rank]
    if module in ROW_PARALLEL:
        if kind == "weight":
            return value.chunk(degree, dim=1)[rank]
        return value if rank == 0 else torch.zeros_like(value)
    return value


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """`x` summed over `group` in place (graph-capturable with NCCL; traced as a functional collective under
    torch.compile)."""
    dist.all_reduce(x, group=group)
    return x


def _reduce_output(module, args, output, group):
    return all_reduce_sum(output, group)


def add_row_parallel_reduce(model: torch.nn.Module, group) -> None:
    """Sum the outputs of every layer's o_proj and down_proj over `group` (forward hooks: the model's own layers
    then compute the full hidden state from the rank's slices); an MoE layer's experts module and shared expert's
    down_proj alike."""
    for layer in model.model.layers:
        mlp = layer.mlp
        partial = [mlp.down_proj] if hasattr(mlp, "down_proj") else [mlp.experts]
        if hasattr(mlp, "shared_expert"):
            partial.append(mlp.shared_expert.down_proj)
        for module in (layer.self_attn.o_proj, *partial):
            module.register_forward_hook(functools.partial(_reduce_output, group=group))
