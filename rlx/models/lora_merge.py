"""A LoRA model's weights with the adapters merged (W + (alpha / rank) B A), and its adapters as a PEFT folder.

- `iter_merged_weights` / `merged_weights`: full Hugging Face-named weights, computed from the live model
  without changing it (the merge is done in float32 and cast to the base weight's dtype; adapted expert weights
  get each expert's delta, rlx.models.lora_experts); what `rlx merge` writes and what a rollout engine without
  adapter support runs.
- `refresh_merged_weights(target, model)`: the same weights copied in place into an existing plain model of
  the architecture (a rollout replica), layer by layer, without building the whole state first; after the
  first refresh only the changed tensors need copying (`include_frozen=False`).
- `save_peft_adapter(model, folder)`: adapter_config.json + adapter_model.safetensors, the folder that
  `peft.PeftModel.from_pretrained(base, folder)` loads (a value model's head goes in as a PEFT
  `modules_to_save` module).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from rlx.models.lora import ADAPTER, adapted_parameters, hf_name, import_peft, is_adapter_param, trained_parameters
from rlx.models.lora_experts import is_param_wrapper, merged_expert_weight
from rlx.models.lora_state import adapter_state, full

PEFT_PREFIX = "base_model.model."
"""Where PeftModel puts the wrapped model: the prefix of every key in adapter_model.safetensors."""
PEFT_WEIGHTS = "adapter_model.safetensors"


def merged_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, fan_in_fan_out: bool):
    """W + scaling B A in float32, cast once to W's dtype (a new tensor). weight [out, in] ([in, out] with
    `fan_in_fan_out`), a [rank, in], b [out, rank]."""
    delta = (b.float() @ a.float()) * scaling  # [out, in]
    if fan_in_fan_out:  # transformers' Conv1D keeps its weight as [in, out]
        delta = delta.T
    return (weight.float() + delta.to(weight.device)).to(weight.dtype)


def merged_layer_weight(layer: torch.nn.Module, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The weight a LoRA layer adapts (`weight`, whole) plus its adapter's delta (a, b: its whole A and B weights),
    in the weight's dtype (a new tensor): a linear layer's [out, in], or an expert weight's [E, out, in]."""
    if is_param_wrapper(layer):
        return merged_expert_weight(weight, a, b, layer, ADAPTER)
    return merged_weight(weight, a, b, layer.scaling[ADAPTER], layer.fan_in_fan_out)


@torch.no_grad()
def iter_merged_weights(
    model: torch.nn.Module, include_frozen: bool = True, tied: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, weight) of every parameter with the adapters merged in, in parameter order, tied
    duplicates once (as Hugging Face saves), or with `tied` under each of their names (as `state_dict` lists them:
    what a weight push to an engine that loads a tied LM head by its own name needs, vLLM). The model is not
    changed: adapted weights are new tensors, the others are the model's own (read them, don't modify them).
    `include_frozen=False` yields only what training changes: the adapted weights and a value model's head. Under
    FSDP every rank must iterate."""
    layers = adapted_parameters(model)
    trained = trained_parameters(model)
    for name, param in model.named_parameters(remove_duplicate=not tied):
        if is_adapter_param(name):
            continue
        if name in layers:
            layer = layers[name]
            a, b = (full(m[ADAPTER].weight.detach()) for m in (layer.lora_A, layer.lora_B))
            yield hf_name(name), merged_layer_weight(layer, full(param.detach()), a, b)
        elif include_frozen or name in trained:
            yield hf_name(name), full(param.detach())


def merged_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """All weights of `model` with the adapters merged, by Hugging Face name (see `iter_merged_weights`)."""
    return dict(iter_merged_weights(model))


@torch.no_grad()
def refresh_merged_weights(target: torch.nn.Module, model: torch.nn.Module, include_frozen: bool = True) -> int:
    """Copy `model`'s merged weights into the plain (adapter-free) `target` of the same architecture, in place
    (any device and dtype: each tensor is cast on copy). Returns the number of tensors copied."""
    params = dict(target.named_parameters())
    count = 0
    for name, value in iter_merged_weights(model, include_frozen):
        param = params.get(name)
        if param is None:
            raise ValueError(f"{type(target).__name__} has no parameter {name} to refresh")
        if param.shape != value.shape:
            raise ValueError(f"{name}: the target's shape {tuple(param.shape)} is not {tuple(value.shape)}")
        param.copy_(value)
        count += 1
    return count


def head_module_names(model: torch.nn.Module) -> list[str]:
    """Top-level modules holding a value model's trained head (e.g. ['score'])."""
    return sorted({name.split(".", 1)[0] for name in trained_parameters(model) if not is_adapter_param(name)})


def peft_adapter_config(model: torch.nn.Module, base_model_name_or_path: str | None = None):
    """PEFT's LoraConfig describing `model`'s adapters, with the task type PeftModel needs to wrap the base."""
    import_peft()
    from peft import TaskType

    config = model.peft_config[ADAPTER].to_dict()
    config["base_model_name_or_path"] = base_model_name_or_path
    heads = head_module_names(model)
    if heads:
        config.update(task_type=TaskType.TOKEN_CLS, modules_to_save=heads)
    else:
        config["task_type"] = TaskType.CAUSAL_LM
    return type(model.peft_config[ADAPTER])(**{k: v for k, v in config.items() if k != "peft_type"})


def save_peft_adapter(
    model: torch.nn.Module,
    folder: str | Path,
    base_model_name_or_path: str | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write `model`'s adapters as a PEFT adapter folder (adapter_config.json, adapter_model.safetensors).
    `tensors`: the adapter state when already gathered (else read from the model: under FSDP every rank
    calls, rank 0 writes). `base_model_name_or_path` is recorded for PEFT's loaders."""
    folder = Path(folder)
    tensors = adapter_state(model) if tensors is None else tensors
    folder.mkdir(parents=True, exist_ok=True)
    peft_adapter_config(model, base_model_name_or_path).save_pretrained(str(folder))
    config_path = folder / "adapter_config.json"  # PEFT writes its target set in hash order: sort it
    config = json.loads(config_path.read_text())
    for key in ("target_modules", "target_parameters"):
        if isinstance(config.get(key), list):
            config[key] = sorted(config[key])
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    write_peft_weights(folder, tensors)
    return folder


def write_peft_weights(folder: str | Path, tensors: dict[str, torch.Tensor]) -> None:
    """A PEFT folder's adapter_model.safetensors from adapter tensors by stable name (`adapter_state`)."""
    weights = {PEFT_PREFIX + name: t.contiguous() for name, t in tensors.items()}
    save_file(weights, str(Path(folder) / PEFT_WEIGHTS), metadata={"format": "pt"})
