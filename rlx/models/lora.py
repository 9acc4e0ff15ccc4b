"""Low-rank adapters (LoRA) on a Hugging Face causal LM or an rlx value model, built with PEFT's layers.

`apply_lora(model, cfg, dtype, seed)` injects PEFT's `lora.Linear` wrappers into the model in place
(`peft.inject_adapter_in_model`) and keeps the Hugging Face module: no `PeftModel` around it. Everything rlx
does with a model keeps working on it unchanged: `model.config`, `base_model_prefix` and the decoder layers
(FSDP shards per layer, `decoder_layers`), `get_output_embeddings` (the fused logprob kernels read the LM
head), the attention registry ("rlx_varlen" packed attention, Ulysses) and tied embeddings (the embedding
and LM head are never wrapped, so `tied_keys` still finds them). A `PeftModel` would prefix every name with
`base_model.model.` and hide those attributes behind forwarding. The one renaming PEFT does is inside each
adapted layer: its weight moves to `<layer>.base_layer.weight`, next to `<layer>.lora_A.default.weight` and
`<layer>.lora_B.default.weight`; `hf_name` maps such names back to the Hugging Face ones. On a mixture-of-experts
model `target_parameters` adapts the fused expert weights too (PEFT's ParamWrapper around the experts module:
rlx.models.lora_experts); `all-linear` never covers them, as in PEFT.

After `apply_lora` the base weights are frozen (requires_grad False) and cast to the compute dtype (bf16 on
accelerators: no float32 master copy of them), the adapters are float32 and the only trainable parameters,
except a value model's scalar head (`*ForTokenClassification`): it is new, so it is trained in full (float32)
beside the adapters. An optimizer built over the trainable parameters then holds state for those only.

`adapters_disabled(model)` runs the base model inside a block, exactly (PEFT's layers then call the base
layer alone): the reference policy without a second copy of the model.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from rlx.errors import UserError
from rlx.models.lora_config import ALL_LINEAR, LoraConfig
from rlx.models.lora_experts import (
    compact_parameter_targets,
    is_param_wrapper,
    resolve_parameter_targets,
    wrapped_module,
)

ADAPTER = "default"
"""The PEFT adapter name rlx uses (one adapter per model); it never appears in the names rlx writes."""
PEFT_INIT = {"default": True, "gaussian": "gaussian", "random": False}
"""LoraConfig.init -> PEFT's init_lora_weights."""
_ADAPTER_PART = re.compile(rf"\.(lora_[AB])\.{ADAPTER}\.")
_BASE_LAYERS = re.compile(r"(?:\.base_layer)+\.")


def import_peft():
    """The peft package, or a UserError saying how to install it."""
    try:
        import peft
    except ImportError:
        raise UserError("LoRA needs PEFT: pip install 'rlx[lora]' (or pip install peft)") from None
    return peft


def is_adapter_param(name: str) -> bool:
    """Whether a parameter name (as `named_parameters` gives it) is a LoRA A or B matrix."""
    return ".lora_A." in name or ".lora_B." in name


def hf_name(name: str) -> str:
    """The name rlx writes for a parameter of a LoRA model: a base weight gets its Hugging Face name back
    ('...q_proj.base_layer.weight' -> '...q_proj.weight', '...experts.base_layer.base_layer.down_proj' ->
    '...experts.down_proj'), an adapter loses PEFT's adapter name only ('...q_proj.lora_A.default.weight' ->
    '...q_proj.lora_A.weight'; nested expert adapters keep their 'base_layer', as in PEFT's files:
    '...experts.base_layer.lora_A.weight'); other names are unchanged."""
    if is_adapter_param(name):
        return _ADAPTER_PART.sub(r".\1.", name)
    return _BASE_LAYERS.sub(".", name)


def backbone(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack without the head(s): `model.<base_model_prefix>`."""
    return getattr(model, model.base_model_prefix, model)


def trains_head(model: torch.nn.Module) -> bool:
    """A value model (token classification, rlx's critic) trains its new scalar head in full beside the adapters."""
    return type(model).__name__.endswith("ForTokenClassification")


def head_param_names(model: torch.nn.Module) -> list[str]:
    """Parameters outside the backbone (the LM head or a value head), tied ones excluded."""
    prefix = model.base_model_prefix + "."
    return [n for n, _ in model.named_parameters() if not n.startswith(prefix)]


def lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Full module name -> PEFT LoRA layer, in module order ({} for a plain model)."""
    if getattr(model, "peft_config", None) is None:
        return {}
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def adapted_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The frozen weight each LoRA layer adapts, by its `named_parameters` name -> the layer, in module order: a
    linear layer's '<layer>.base_layer.weight', an expert weight's '<experts>.base_layer[.base_layer].<name>'."""
    out = {}
    for name, layer in lora_layers(model).items():
        if is_param_wrapper(layer):
            out[f"{wrapped_module(layer, name)[1]}.{layer.parameter_name}"] = layer
        else:
            out[f"{name}.base_layer.weight"] = layer
    return out


def has_expert_adapters(model: torch.nn.Module) -> bool:
    """Whether `model` has adapters on fused expert weights (PEFT's ParamWrapper, `target_parameters`)."""
    return any(is_param_wrapper(layer) for layer in lora_layers(model).values())


def is_lora_model(model: torch.nn.Module) -> bool:
    """Whether `apply_lora` (or PEFT) put adapters into `model`."""
    return bool(lora_layers(model))


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """Full names of the backbone's linear layers (the candidates for adapters), in module order."""
    prefix = model.base_model_prefix
    return [
        f"{prefix}.{name}" if name else prefix
        for name, module in backbone(model).named_modules()
        if isinstance(module, torch.nn.Linear)
    ]


def vision_tower_names(model: torch.nn.Module) -> tuple[str, ...]:
    """Module paths of a vision-language model's vision tower (its family's); () for a text model."""
    from rlx.models.vision.families import is_vision_config, vision_family_of

    return vision_family_of(model.config).vision_modules if is_vision_config(model.config) else ()


def resolve_targets(model: torch.nn.Module, targets: list[str]) -> list[str]:
    """Full names of the linear layers `targets` select (see LoraConfig.target_modules); a target that
    matches nothing is a UserError listing the model's linear layer names; [] for no targets. 'all-linear' on a
    vision-language model means the language model's linear layers: the vision tower (frozen by default) gets
    adapters only where its layers are named."""
    if not targets:  # expert weights only (target_parameters)
        return []
    linear = linear_module_names(model)
    if targets == [ALL_LINEAR]:
        tower = vision_tower_names(model)
        chosen = {n for n in linear if not any(n == t or n.startswith(t + ".") for t in tower)}
    else:
        chosen = set()
        for target in targets:
            hits = [n for n in linear if n == target or n.endswith("." + target)]
            if not hits:
                short = sorted({n.rsplit(".", 1)[-1] for n in linear})
                raise UserError(
                    f"LoRA target_modules: {target!r} matches no linear layer of {type(model).__name__}'s backbone "
                    f"(its linear layers: {', '.join(short)}, or '{ALL_LINEAR}')"
                )
            chosen.update(hits)
    if not chosen:
        raise UserError(f"LoRA: {type(model).__name__} has no linear layer in its backbone to adapt")
    return [n for n in linear if n in chosen]


def compact_targets(model: torch.nn.Module, target_names: list[str]) -> list[str]:
    """The layers' short names ('q_proj', ...) when PEFT's suffix matching of them over the whole model selects
    exactly `target_names` (readable in adapter_config.json), else the full names (matched exactly). PEFT matches
    any module, not only linear ones: a short name such as '0' (a layer of an nn.Sequential) also names whole
    blocks ('layers.0'), and then the full names are used."""
    short = sorted({n.rsplit(".", 1)[-1] for n in target_names})
    matched = {n for n, _ in model.named_modules() if n.rsplit(".", 1)[-1] in short}
    return short if matched == set(target_names) else sorted(target_names)


def peft_lora_config(cfg: LoraConfig, target_modules: list[str], target_parameters: list[str] = ()):
    """PEFT's LoraConfig for `cfg` on the layers `target_modules` and the expert weights `target_parameters` (names
    as PEFT matches them)."""
    peft = import_peft()
    return peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(target_modules),
        target_parameters=list(target_parameters) or None,
        init_lora_weights=PEFT_INIT[cfg.init],
        bias="none",
    )


def apply_lora(model: torch.nn.Module, cfg: LoraConfig, dtype: torch.dtype = torch.float32, seed: int = 0):
    """Put adapters into `model` in place and return it: base weights frozen in `dtype`, adapters float32 and
    trainable (plus a value model's head). The adapters' initial values depend on `seed` only, so every
    process of a run builds the same ones."""
    if is_lora_model(model):
        raise ValueError(f"{type(model).__name__} already has LoRA adapters")
    peft = import_peft()
    modules = resolve_targets(model, cfg.target_modules)
    params = resolve_parameter_targets(model, cfg.target_parameters)
    short = compact_targets(model, modules) if modules else []
    peft_cfg = peft_lora_config(cfg, short, compact_parameter_targets(model, params))
    with torch.random.fork_rng(devices=[]):  # the caller's random stream is left as it was
        torch.manual_seed(seed)
        try:
            peft.inject_adapter_in_model(peft_cfg, model, adapter_name=ADAPTER)
        except ValueError as e:  # e.g. PEFT's v4 -> v5 MoE renaming of gate_proj without up_proj (below)
            raise UserError(f"LoRA on {type(model).__name__}: PEFT refused the targets {short}: {e}") from None
    _check_adapted(model, [f"{n}.weight" for n in modules] + params, short)
    trained = set(trained_parameters(model))
    for name, param in model.named_parameters():
        trainable = name in trained
        wanted = torch.float32 if trainable else dtype
        if param.dtype != wanted:
            param.data = param.data.to(wanted)  # parameters only: buffers (rotary inv_freq) keep their dtype
        param.requires_grad_(trainable)
    return model


def _check_adapted(model: torch.nn.Module, wanted: list[str], short: list[str]) -> None:
    """UserError unless PEFT adapted exactly the weights rlx resolved (Hugging Face names). PEFT (0.21) reads the
    transformers-v4 expert names of some MoE model types in target_modules ('gate_proj', 'up_proj', 'down_proj' on
    Qwen3-MoE and OLMoE, 'w1'-'w3' on Mixtral, 'gate') as the fused expert weights, so a dense MLP layer of such a
    model (Qwen3-MoE's mlp_only_layers) named that way would silently get no adapter and the experts one instead."""
    adapted = {hf_name(name) for name in adapted_parameters(model)}
    extra, missing = sorted(adapted - set(wanted)), sorted(set(wanted) - adapted)
    if extra or missing:
        raise UserError(
            f"LoRA on {type(model).__name__}: PEFT did not adapt what target_modules {short} name "
            f"({'also adapted ' + extra[0] if extra else 'left out ' + missing[0]}): PEFT reads "
            f"{model.config.model_type}'s dense MLP names as its experts (transformers v4 names); target the "
            f"experts with target_parameters and leave those layers out of target_modules"
        )


def trained_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The parameters LoRA training updates, by `named_parameters` name: the adapters and a value model's head
    (for a plain value model, its head alone)."""
    head = set(head_param_names(model)) if trains_head(model) else set()
    return {n: p for n, p in model.named_parameters() if is_adapter_param(n) or n in head}


@contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Inside the block `model` computes exactly what its base model computes (each adapted layer calls its
    base layer alone); a no-op for a plain model.

    PEFT's own switch (`enable_adapters(False)`) also clears the adapters' requires_grad for the block. FSDP2
    reads requires_grad when it initialises lazily at the first forward (the trainable parameters fix its
    gradient dtypes), and the reference pass is often that first forward; so this switch leaves requires_grad
    alone: it only sets the layers' disabled flag, and restores it."""
    layers = list(lora_layers(model).values())
    previous = [layer._disable_adapters for layer in layers]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield model
    finally:
        for layer, was in zip(layers, previous):
            layer._disable_adapters = was
