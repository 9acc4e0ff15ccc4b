"""Rollout engines by name (no torch import: recipes and options are checked against it before any model loads).

Adding an engine: a `RolloutEngine` subclass (rlx/rollout/base.py) and one `register_engine` entry.
"""

from __future__ import annotations

import importlib

from rlx.errors import UserError

_ENGINES: dict[str, object] = {
    "hf": "rlx.rollout.hf:HFRolloutEngine",
    "native": "rlx.rollout.native.engine:NativeRolloutEngine",
    "vllm": "rlx.rollout.vllm:VLLMRolloutEngine",
}


def register_engine(name: str, engine: object) -> None:
    """Make `engine` (a RolloutEngine subclass, or 'module:Class' imported on first use) known as `name`."""
    _ENGINES[name] = engine


def engine_names() -> list[str]:
    return list(_ENGINES)


def engine_class(name: str):
    """The engine class registered as `name` (imported now if it was registered by path)."""
    if name not in _ENGINES:
        raise UserError(f"unknown rollout engine {name!r} (available: {', '.join(_ENGINES)})")
    entry = _ENGINES[name]
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        entry = _ENGINES[name] = getattr(importlib.import_module(module), attr)
    return entry
