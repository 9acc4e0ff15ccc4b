"""Training backends by name, and which backend runs a given checkpoint.

Adding a backend: a `TrainingBackend` subclass (rlx/backends/base.py) and one `register_backend` entry;
recipes then choose it with `backend = "NAME"`, and a checkpoint layout names the backend that trains it in
place (rlx/checkpoints/base.py `Layout.backend`).
"""

from __future__ import annotations

import importlib

from rlx.backends.base import Degrees, TrainingBackend
from rlx.checkpoints.meta import CheckpointMeta
from rlx.checkpoints.registry import get_layout
from rlx.errors import UserError

_BACKENDS: dict[str, object] = {
    "fsdp": "rlx.backends.fsdp:FSDPBackend",
    "megatron": "rlx.backends.megatron.backend:MegatronBackend",
}
DEFAULT = "fsdp"


def register_backend(name: str, backend: object) -> None:
    """Make `backend` (a TrainingBackend subclass, or 'module:Class' imported on first use) known as `name`."""
    _BACKENDS[name] = backend


def backend_class(name: str) -> type[TrainingBackend]:
    if name not in _BACKENDS:
        raise UserError(f"unknown training backend {name!r} (available: {', '.join(_BACKENDS)})")
    entry = _BACKENDS[name]
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        entry = _BACKENDS[name] = getattr(importlib.import_module(module), attr)
    return entry


def checkpoint_degrees(meta: CheckpointMeta, sp_degree: int = 1, ep_degree: int = 1) -> Degrees:
    """The parallel grid a checkpoint was written for (its tensor x pipeline degrees, if any), with the sequence and
    expert parallel degrees the run asks for."""
    return Degrees(
        sp_degree=sp_degree, tp_degree=meta.tp_degree or 1, pp_degree=meta.pp_degree or 1, ep_degree=ep_degree
    )


def backend_for_checkpoint(meta: CheckpointMeta) -> type[TrainingBackend]:
    """The backend that trains a checkpoint of this layout in place."""
    return backend_class(get_layout(meta.layout, "layout").backend)


def scoring_backend(meta: CheckpointMeta, world: int, where: str) -> tuple[type[TrainingBackend], Degrees]:
    """The backend that scores a checkpoint: its own where it can run here, else the default one, which reads any
    layout as full Hugging Face weights (the same numbers, one process per replica)."""
    from rlx.observe.tracking import console

    native, degrees = backend_for_checkpoint(meta), checkpoint_degrees(meta)
    if native.name == DEFAULT:
        return native, Degrees()
    reason = native.unavailable(degrees, world)
    if reason is None:
        return native, degrees
    console(f"{where}: {reason}; scoring the merged Hugging Face model instead")
    return backend_class(DEFAULT), Degrees()
