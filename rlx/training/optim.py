"""AdamW for the trained models, and its state as named tensors so checkpoints survive parameter
reordering and any sharding: the full (unsharded) state is gathered and restored through
torch.distributed.checkpoint.state_dict, which handles plain and FSDP2 modules alike."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from rlx.errors import UserError
from rlx.models.lora import hf_name
from rlx.training.config import TrainConfig

_SEP = "::"
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
_FULL_ON_DEVICE = StateDictOptions(full_state_dict=True)


def build_adamw(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over every trainable parameter (tied parameters once). With every parameter on CUDA, torch's fused
    kernel: the default multi-tensor step holds a float32 temporary the size of the whole state for its square roots
    (4 bytes a parameter: on an 8B mixture-of-experts model over two H100s, 15 GiB a rank, and the step ran out of
    memory there), and the fused step holds none."""
    params = [p for _, p in model.named_parameters() if p.requires_grad]
    optim = cfg.optim
    fused = bool(params) and all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(
        params, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps, weight_decay=optim.weight_decay,
        fused=fused or None,
    )  # fmt: skip


def optimizer_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, offload: bool = True
) -> dict[str, torch.Tensor]:
    """Optimizer state keyed '<param name>::<state key>' (e.g. 'model.norm.weight::exp_avg'), unsharded
    (on rank 0 only when sharded); on the CPU, or with `offload=False` (an unsharded model) the live tensors."""
    options = _FULL if offload else _FULL_ON_DEVICE
    state = get_optimizer_state_dict(model, optimizer, options=options).get("state", {})
    out = {}
    for name, entries in state.items():
        for key, value in entries.items():
            out[f"{name}{_SEP}{key}"] = (
                (value.detach().cpu() if offload else value.detach())
                if torch.is_tensor(value)
                else torch.tensor(value, dtype=torch.float32)
            )
    return out


def load_optimizer_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], where: str
) -> None:
    """Restore state written by `optimizer_tensors` (every rank passes the full tensors); unknown
    parameter names are an error."""
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    names = {**{hf_name(n): n for n in trainable}, **{n: n for n in trainable}}  # LoRA files use the stable names
    state: dict[str, dict] = {}
    for key, value in tensors.items():
        name, _, field = key.rpartition(_SEP)
        if name not in names:
            raise UserError(f"{where}: optimizer state for unknown parameter {name!r}")
        state.setdefault(names[name], {})[field] = value
    params = [n for n, p in model.named_parameters() if p.requires_grad]
    groups = [{**{k: v for k, v in optimizer.param_groups[0].items() if k != "params"}, "params": params}]
    set_optimizer_state_dict(
        model, optimizer, {"state": state, "param_groups": groups}, options=StateDictOptions(full_state_dict=True)
    )


def sharded_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's shards of the model state (DTensors under FSDP, plain tensors otherwise)."""
    return dict(get_model_state_dict(model))


def sharded_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's shards of the optimizer state, flattened to '<param>::<state key>'."""
    out = {}
    for name, entries in get_optimizer_state_dict(model, optimizer).get("state", {}).items():
        for key, value in entries.items():
            out[f"{name}{_SEP}{key}"] = value if torch.is_tensor(value) else torch.tensor(value, dtype=torch.float32)
    return out
