"""AdamW for the actor, and its state as named tensors so checkpoints survive parameter reordering."""

from __future__ import annotations

import torch

from rlx.engine.training.config import TrainConfig
from rlx.errors import UserError

_SEP = "::"


def build_adamw(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over every trainable parameter (tied parameters once)."""
    params = [p for _, p in model.named_parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)


def optimizer_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Optimizer state keyed '<param name>::<state key>' (e.g. 'model.norm.weight::exp_avg')."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    out = {}
    for index, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            out[f"{names[index]}{_SEP}{key}"] = (
                value.detach().cpu() if torch.is_tensor(value) else torch.tensor(value, dtype=torch.float32)
            )
    return out


def load_optimizer_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], where: str
) -> None:
    """Restore state written by `optimizer_tensors`; unknown parameter names are an error."""
    index = {n: i for i, n in enumerate(n for n, p in model.named_parameters() if p.requires_grad)}
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        name, _, field = key.rpartition(_SEP)
        if name not in index:
            raise UserError(f"{where}: optimizer state for unknown parameter {name!r}")
        state.setdefault(index[name], {})[field] = value
    current = optimizer.state_dict()
    optimizer.load_state_dict({"state": state, "param_groups": current["param_groups"]})
