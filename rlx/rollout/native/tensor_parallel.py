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
parameter by parameter, never the whole model at once. Mixture-of-experts models are refused (not split yet).
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.distributed as dist

from rlx.errors import UserError
from rlx.models.moe import MOE_FAMILIES
from rlx.rollout.native.fused import FAMILIES

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
"""Projections split by output features (their weight's rows, and their bias)."""
ROW_PARALLEL = ("o_proj", "down_proj")
"""Projections split by input features (their weight's columns); their outputs are summed over the group."""


def check_splittable(config, degree: int) -> None:
    """A UserError unless a model of `config` splits over `degree` ranks: a Llama-family text decoder whose
    attention heads, key/value heads and MLP width are multiples of `degree`."""
    model_type = getattr(config, "model_type", None)
    if model_type in MOE_FAMILIES:
        raise UserError(
            f"tp_degree {degree}: the native engine does not split mixture-of-experts models ({model_type}) across "
            f"ranks; use tp_degree = 1 (each rank decodes the whole model)"
        )
    if model_type not in FAMILIES:
        raise UserError(
            f"tp_degree {degree}: the native engine splits {', '.join(FAMILIES)} models only, not {model_type!r}"
        )
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, name, None) or config.num_attention_heads
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
    out.intermediate_size = config.intermediate_size // degree
    return out


def rank_slice(name: str, value: torch.Tensor, degree: int, rank: int) -> torch.Tensor:
    """The part of full parameter `name` (Hugging Face name, `value` its whole tensor) that rank `rank` of
    `degree` holds: a view of rows or columns for split projections, zeros for a row-parallel bias off rank 0,
    the whole tensor for everything else."""
    *_, module, kind = name.split(".")
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
    then compute the full hidden state from the rank's slices)."""
    for layer in model.model.layers:
        for module in (layer.self_attn.o_proj, layer.mlp.down_proj):
            module.register_forward_hook(functools.partial(_reduce_output, group=group))
