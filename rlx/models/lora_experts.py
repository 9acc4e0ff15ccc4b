"""LoRA on a mixture-of-experts model's fused expert weights, through PEFT's `lora.ParamWrapper` (PEFT's
`target_parameters`, rlx's `lora.target_parameters`).

transformers 5.17 keeps an MoE layer's experts as two 3-D parameters, `mlp.experts.gate_up_proj` [E, 2I, H] and
`mlp.experts.down_proj` [E, H, I] (rlx.models.moe): not `nn.Linear`s, so `target_modules` cannot reach them. PEFT
wraps the experts module in one `ParamWrapper` per targeted parameter (nested when both are: the inner one, at
`mlp.experts.base_layer`, adapts gate_up_proj, the outer one, at `mlp.experts`, down_proj). Each expert e gets its
own factors A_e [r, in] and B_e [out, r], which PEFT holds as one A [r E, in] and one B [out, r E] (A's rows expert
by expert, B's columns rank-major: column j * E + e is expert e's j-th); while the wrapper runs the experts module
it swaps the parameter (torch's parametrize) for W_e + (alpha / r) B_e A_e, so every experts forward that reads the
module's parameters inside that call applies the adapters: transformers' own implementations and rlx's autocast
grouped GEMMs (rlx.parallel.experts) alike. Read outside the call, the parameter is the frozen base.

Names: the experts module's own parameters sit at `mlp.experts.base_layer.base_layer.gate_up_proj` (`hf_name` gives
`mlp.experts.gate_up_proj` back); the adapters keep PEFT's paths (`mlp.experts.base_layer.lora_A.weight`:
gate_up_proj's, `mlp.experts.lora_A.weight`: down_proj's), as PEFT's adapter_model.safetensors names them.

Here: which parameters `target_parameters` selects (`resolve_parameter_targets`), their delta as one tensor
(`expert_delta`, the merge of rlx merge and the rollout replicas), and the weights the wrapped experts compute with
(`active_expert_weights`, for the native engine's own expert kernels).
"""

from __future__ import annotations

import torch

from rlx.errors import UserError
from rlx.models.lora_config import ALL_EXPERTS

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
"""The fused expert parameters of transformers' `*Experts` modules that LoRA can adapt."""


def expert_parameter_names(model: torch.nn.Module) -> list[str]:
    """Full names of the fused expert weights of `model`'s MoE layers (its family's experts modules), in module
    order; [] for a dense model."""
    from rlx.models.family import family_of

    family = family_of(model.config)
    if not family.routed_experts:
        return []
    experts = {id(m) for m in family.expert_modules(model)}
    return [f"{name}.{w}" for name, m in model.named_modules() if id(m) in experts for w in EXPERT_WEIGHTS]


def resolve_parameter_targets(model: torch.nn.Module, targets: list[str]) -> list[str]:
    """Full names of the expert weights `targets` selects (see LoraConfig.target_parameters), in module order; []
    for no targets. A dense model, or a target that matches no expert weight, is a UserError."""
    if not targets:
        return []
    names = expert_parameter_names(model)
    if not names:
        raise UserError(
            f"LoRA target_parameters {targets}: {type(model).__name__} has no routed experts (target_parameters "
            f"adapts a mixture-of-experts model's fused expert weights; linear layers are target_modules)"
        )
    if targets == [ALL_EXPERTS]:
        return names
    chosen = set()
    for target in targets:
        hits = [n for n in names if n == target or n.endswith("." + target)]
        if not hits:
            short = sorted({".".join(n.split(".")[-3:]) for n in names})
            raise UserError(
                f"LoRA target_parameters: {target!r} matches no expert weight of {type(model).__name__} (its "
                f"expert weights: {', '.join(short)}, or '{ALL_EXPERTS}')"
            )
        chosen.update(hits)
    return [n for n in names if n in chosen]


def compact_parameter_targets(model: torch.nn.Module, names: list[str]) -> list[str]:
    """The shortest suffixes ('experts.gate_up_proj', ...) that PEFT's matching of parameter paths selects exactly
    `names` with (readable in adapter_config.json), else the full names."""
    params = [n for n, _ in model.named_parameters()]
    for parts in (2, 3):
        short = sorted({".".join(n.split(".")[-parts:]) for n in names})
        if {n for n in params if any(n == s or n.endswith("." + s) for s in short)} == set(names):
            return short
    return sorted(names)


def is_param_wrapper(layer: torch.nn.Module) -> bool:
    """Whether a PEFT LoRA layer adapts a parameter (`ParamWrapper`) rather than wrapping a linear layer."""
    return hasattr(layer, "parameter_name") and hasattr(layer, "base_layer")


def wrapped_module(layer: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    """(the module under a stack of PEFT wrappers, its full name): `mlp.experts` -> (the experts module,
    'mlp.experts.base_layer.base_layer') when two ParamWrappers nest there."""
    while is_param_wrapper(layer):
        layer, name = layer.base_layer, f"{name}.base_layer"
    return layer, name


def expert_delta(a: torch.Tensor, b: torch.Tensor, num_experts: int, scaling: float, swapped: bool) -> torch.Tensor:
    """A ParamWrapper's delta in float32, shaped as its parameter: a [r E, in] and b [out, r E] (PEFT's layout, see
    the module doc) -> [E, out, in] (`swapped`, the parameter stored [E, out, in] as the rlx families store theirs;
    else [E, in, out]): (alpha / r) B_e A_e for each expert e."""
    a = a.float().reshape(num_experts, -1, a.shape[-1])  # [E, r, in]
    b = b.float().reshape(b.shape[0], -1, num_experts)  # [out, r, E]
    delta = torch.einsum("ore,eri->eoi", b, a) * scaling
    return delta if swapped else delta.transpose(1, 2)


def merged_expert_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, layer: torch.nn.Module,
                         adapter: str) -> torch.Tensor:  # fmt: skip
    """W + the ParamWrapper `layer`'s delta (a, b: its gathered A and B weights) in float32, cast once to W's dtype
    (a new tensor)."""
    delta = expert_delta(a, b, layer.num_experts, layer.scaling[adapter], layer._did_swap_in_out_features)
    return (weight.float() + delta.to(weight.device)).to(weight.dtype)


def active_expert_weights(experts: torch.nn.Module, adapter: str) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """(the experts module under any ParamWrappers, gate_up_proj, down_proj): the weights the wrapped module's forward
    computes with, each adapter's delta added where it is on (as PEFT's forward adds it: W + (alpha / r) B A in W's
    dtype, one batched matmul per weight). A plain experts module gives its own parameters."""
    module, factors = experts, {}
    while is_param_wrapper(module):
        if not module.disable_adapters and not module.merged and adapter in module.lora_A:
            factors[module.parameter_name] = module.get_delta_factors(adapter)  # (lhs, rhs, scaling)
        module = module.base_layer
    weights = []
    for name in EXPERT_WEIGHTS:
        weight = getattr(module, name)
        if name in factors:
            lhs, rhs, scaling = factors[name]
            weight = torch.baddbmm(weight, lhs, rhs, alpha=scaling)
        weights.append(weight)
    return module, weights[0], weights[1]
