"""Mixture-of-experts decoder layers in the native engine: routed experts as grouped GEMMs, routing recorded.

transformers' expert modules (eager) loop over the experts a batch hit in Python, one small GEMM pair each, with a
host sync to find them; that cannot be captured in a CUDA graph and costs a launch per expert per layer. Here a
routed layer's MLP is the family's own router (`mlp.gate`, so top-k, softmax and top-k renormalisation stay
transformers') followed by `rlx.kernels.grouped_experts.routed_experts_mlp` over the layer's fused expert weights:
a fixed number of kernels whatever the routing, and every shape a function of the step's token count, so the layer
compiles and replays in the decode CUDA graphs like a dense one. Qwen2-MoE's shared expert (sigmoid-gated) is the
module's own. Experts with LoRA adapters (a replica decoding with the adapters, `lora_rollout = "adapters"`) run with
each expert's weight plus its delta, computed every step as PEFT's forward computes it.

`moe_layer_step` also returns the experts each token was routed to, so the engine records routing for
`--router-replay rollout` (rlx.models.routing's format) without forward hooks (which a compiled graph cannot
append to a list from).

Which layers qualify (`native_moe_layers`): the decoder layers of rlx's MoE families (rlx.models.moe) whose MLP is
a `*SparseMoeBlock` with a `*TopKRouter` gate and bias-free, untransposed fused experts; dense layers of the same
model (Qwen3-MoE's `mlp_only_layers`) run their own MLP and record nothing, as the hf engine's router hooks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlx.kernels.grouped_experts import ExpertsImpl, routed_experts_mlp
from rlx.models.lora import ADAPTER
from rlx.models.lora_experts import active_expert_weights, wrapped_module
from rlx.models.moe import MOE_FAMILIES


def is_routed(mlp: torch.nn.Module) -> bool:
    """Whether `mlp` is a routed block the native path reproduces (see the module doc); its experts may carry LoRA
    adapters (PEFT's ParamWrappers, rlx.models.lora_experts)."""
    gate, experts = getattr(mlp, "gate", None), wrapped_module(getattr(mlp, "experts", None), "")[0]
    return (
        type(mlp).__name__.endswith("SparseMoeBlock")
        and type(gate).__name__.endswith("TopKRouter")
        and isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
        and isinstance(getattr(experts, "down_proj", None), torch.Tensor)
        and not getattr(experts, "is_transposed", False)
        and not getattr(experts, "has_bias", False)
    )


def native_moe_layers(model, layers) -> list[bool] | None:
    """Per decoder layer whether its MLP is routed, for a model of an MoE family whose routed layers all qualify;
    None for any other model (it decodes through its own layers)."""
    config = model.config.get_text_config()
    if getattr(config, "model_type", None) not in MOE_FAMILIES:
        return None
    routed = [is_routed(layer.mlp) for layer in layers]
    if not any(routed) or any(type(layer.mlp).__name__.endswith("SparseMoeBlock") and not r
                              for layer, r in zip(layers, routed)):  # fmt: skip
        return None
    return routed


def routed_mlp(
    mlp: torch.nn.Module, x: torch.Tensor, impl: ExpertsImpl = "auto", tp_group=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A routed block on x [T, H] -> (output [T, H], experts [T, k] int64), as the block's own forward in eval mode
    (Mixtral's router jitter is a training-time noise). `tp_group`: the block is a tensor-parallel rank's (each
    expert at 1/T of its width, tensor_parallel.py): the routed output is summed over the group (the shared
    expert's down_proj sums itself, through its hook)."""
    _, weights, experts = mlp.gate(x)
    module, gate_up, down = active_expert_weights(mlp.experts, ADAPTER)  # LoRA on the experts: W + its delta
    out = routed_experts_mlp(x, experts, weights, gate_up, down, module.act_fn, impl)
    if tp_group is not None:
        dist.all_reduce(out, group=tp_group)
    shared = getattr(mlp, "shared_expert", None)
    if shared is not None:  # Qwen2-MoE
        out = out + F.sigmoid(mlp.shared_expert_gate(x)) * shared(x)
    return out, experts


def moe_layer_step(
    layer,
    hidden: torch.Tensor,
    position_ids: torch.Tensor,
    rope,
    paged,
    routed: bool,
    impl: ExpertsImpl = "auto",
    tp_group=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One decoder layer (the families' shared pre-norm shape): hidden [1, T, H] -> ([1, T, H], experts [T, k] of a
    routed layer or None). The attention is the layer's own (the paged attention function through `paged`; a
    tensor-parallel rank's o_proj sums itself through its hook, as does a dense MLP's down_proj)."""
    attn, _ = layer.self_attn(
        hidden_states=layer.input_layernorm(hidden), attention_mask=None, position_ids=position_ids,
        position_embeddings=rope, paged=paged,
    )  # fmt: skip
    hidden = hidden + attn
    x = layer.post_attention_layernorm(hidden)
    if not routed:
        return hidden + layer.mlp(x), None
    out, experts = routed_mlp(layer.mlp, x[0], impl, tp_group)
    return hidden + out.unsqueeze(0), experts
