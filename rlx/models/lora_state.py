"""What a LoRA checkpoint holds: the trained tensors by stable name, and an identity of the base model they
were trained on, so that loading them onto another base fails with the difference named.

Adapter state: `adapter_state(model)` -> {name: float32 tensor} for the adapters (and a value model's head),
named as `hf_name` writes them ('model.layers.0.self_attn.q_proj.lora_A.weight', 'score.weight'): the same in
every process and run, whatever PEFT's adapter name; `load_adapter_state` puts them back, by name and shape.

Base identity: `base_identity(model)` describes the frozen base weights: the model class, its config (minus
bookkeeping keys), every tensor's shape, and a fingerprint: sha256 over each tensor's name, shape and up to
`SAMPLE_SIZE` evenly spaced values rounded to bfloat16. The rounding makes it the same for a base held in
float32 and the same base cast to bf16 (as `apply_lora` casts it), so it can be computed before or after;
the sample keeps it cheap on any device (a base that differs only at unsampled positions goes unnoticed).
"""

from __future__ import annotations

import hashlib
import json

import torch

from rlx.errors import UserError
from rlx.models.lora import hf_name, trained_parameters

SAMPLE_SIZE = 4096
"""Values per tensor in the fingerprint."""
_BOOKKEEPING = {"transformers_version", "dtype", "torch_dtype", "use_cache", "architectures"}
"""Config keys that say how a model was saved or is run, not what it computes."""


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole value of a parameter: a DTensor shard (FSDP) is gathered (a collective: every rank calls)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trained tensors (adapters, a value model's head) by stable name, float32, on the CPU. Under FSDP
    every rank must call it (each tensor is gathered) and every rank gets the whole state."""
    trained = trained_parameters(model).items()
    return {hf_name(name): full(param.detach()).float().cpu().clone() for name, param in trained}


def load_adapter_state(model: torch.nn.Module, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Copy `tensors` (from `adapter_state`) into a model with the same adapters, before any sharding; names
    missing on either side and shape mismatches (another rank or target set) are UserErrors."""
    params = {hf_name(n): p for n, p in trained_parameters(model).items()}
    if any(hasattr(p, "full_tensor") for p in params.values()):
        raise ValueError("load the adapter state before sharding the model (FSDP)")
    missing = [n for n in params if n not in tensors]
    unknown = [n for n in tensors if n not in params]
    if unknown:
        raise UserError(f"{where}: adapter tensor {unknown[0]} has no counterpart in this model ({_count(unknown)})")
    if missing:
        raise UserError(f"{where}: adapter state lacks {missing[0]} ({_count(missing)} missing)")
    for name, param in params.items():
        if tuple(tensors[name].shape) != tuple(param.shape):
            raise UserError(
                f"{where}: adapter tensor {name} has shape {tuple(tensors[name].shape)}, this model's has "
                f"{tuple(param.shape)} (another rank or base model?)"
            )
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(tensors[name])


def _count(names: list[str]) -> str:
    return f"{len(names)} tensor" + ("s" if len(names) != 1 else "")


def base_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The frozen base weights by Hugging Face name (tied duplicates once), for a plain model or the same
    model with adapters: adapters and a value model's trained head are left out."""
    trained = trained_parameters(model)
    return {hf_name(name): param for name, param in model.named_parameters() if name not in trained}


def _config_dict(config) -> dict:
    """The config as JSON reads it back (tuples as lists), bookkeeping keys left out."""
    kept = {k: v for k, v in sorted(config.to_dict().items()) if not k.startswith("_") and k not in _BOOKKEEPING}
    return json.loads(json.dumps(kept, default=str))


def _sample(tensor: torch.Tensor) -> bytes:
    """Up to SAMPLE_SIZE evenly spaced values of `tensor`, rounded to bfloat16, as bytes."""
    flat = full(tensor.detach()).reshape(-1)
    if flat.numel() > SAMPLE_SIZE:
        flat = flat[torch.arange(SAMPLE_SIZE, device=flat.device) * (flat.numel() - 1) // (SAMPLE_SIZE - 1)]
    return flat.to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes()


def base_identity(model: torch.nn.Module) -> dict:
    """{'architecture', 'config', 'shapes', 'fingerprint'} of the frozen base weights (JSON-ready). Under FSDP
    every rank must call it; cheaper before sharding."""
    weights = base_weights(model)
    digest = hashlib.sha256()
    for name in sorted(weights):
        tensor = weights[name]
        digest.update(f"{name}:{list(tensor.shape)}\n".encode())
        digest.update(_sample(tensor))
    return {
        "architecture": type(model).__name__,
        "config": _config_dict(model.config),
        "shapes": {name: list(weights[name].shape) for name in sorted(weights)},
        "fingerprint": digest.hexdigest(),
    }


def check_base_identity(expected: dict, model: torch.nn.Module, where: str) -> None:
    """Fail unless `model`'s base is the one `expected` (a `base_identity`) describes, naming the first
    difference: the model class, a tensor's shape, a missing tensor, a config key, or the weights."""
    found = base_identity(model)
    if found["architecture"] != expected["architecture"]:
        raise UserError(
            f"{where}: the adapters were trained on a {expected['architecture']}, this base model is a "
            f"{found['architecture']}"
        )
    want, have = expected["shapes"], found["shapes"]
    for name, shape in want.items():
        if name not in have:
            raise UserError(f"{where}: the base model has no tensor {name} (the adapters' base had {shape})")
        if have[name] != shape:
            raise UserError(
                f"{where}: base tensor {name} has shape {tuple(have[name])}, the adapters' base had {tuple(shape)}"
            )
    extra = [n for n in have if n not in want]
    if extra:
        raise UserError(f"{where}: the base model has tensor {extra[0]}, which the adapters' base did not")
    for key in sorted(set(expected["config"]) | set(found["config"])):
        if expected["config"].get(key) != found["config"].get(key):
            raise UserError(
                f"{where}: base config {key} is {found['config'].get(key)!r}, the adapters' base had "
                f"{expected['config'].get(key)!r}"
            )
    if found["fingerprint"] != expected["fingerprint"]:
        raise UserError(
            f"{where}: the base model's weights differ from the adapters' base (fingerprint "
            f"{found['fingerprint'][:12]} vs {expected['fingerprint'][:12]}): not the model they were trained on"
        )
