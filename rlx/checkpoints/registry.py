"""The layout registry and the one dispatch on a checkpoint's layout: every command reads, writes, shards and
merges checkpoints through these functions, and nothing outside rlx/checkpoints names a layout.

Adding a layout: a module with a `Layout` subclass (rlx/checkpoints/base.py) and one registry entry
(`register_layout(MyLayout())`, or a line in catalog.py for a built-in one).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

import torch

from rlx.checkpoints import catalog
from rlx.checkpoints.base import CheckpointPart, Layout, LocalState, TrainedState
from rlx.checkpoints.meta import META_NAME, CheckpointMeta, is_checkpoint
from rlx.errors import UserError
from rlx.models.loading import read_weights

_LAYOUTS: dict[str, Layout | str] = {name: path for name, (path, _) in catalog.BUILT_IN.items()}


def register_layout(layout: Layout) -> Layout:
    """Make `layout` known to every command (`rlx shard --layout NAME`, readers, writers)."""
    _LAYOUTS[layout.name] = layout
    return layout


def layout_names() -> list[str]:
    return list(_LAYOUTS)


def get_layout(name: str, where: str = "--layout") -> Layout:
    """The registered layout `name` (imported on first use), or a UserError listing the known ones."""
    if name not in _LAYOUTS:
        raise UserError(f"{where} {name!r} is not available (available: {', '.join(_LAYOUTS)})")
    entry = _LAYOUTS[name]
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        entry = _LAYOUTS[name] = getattr(importlib.import_module(module), attr)()
    return entry


def layout_for_backend(backend: str, sharded: bool = False) -> Layout:
    """The layout a training backend writes when it chooses: the first registered one it trains in place (with
    `sharded`, under a launcher, the first of them whose every rank writes its own shards, if any), else the default
    one (which any backend writes from its full weights)."""
    own = [layout for layout in map(get_layout, _LAYOUTS) if layout.backend == backend]
    parallel = [layout for layout in own if layout.writes_shards] if sharded else []
    return next(iter(parallel + own), get_layout(catalog.DEFAULT))


def read_meta(folder: str | Path) -> CheckpointMeta:
    """A checkpoint's rlx.json, checked against its layout."""
    folder = Path(folder)
    meta = CheckpointMeta.read(folder)
    path = folder / META_NAME
    if meta.layout not in _LAYOUTS:
        raise UserError(f"{path}: layout {meta.layout!r} is not supported here (known: {', '.join(_LAYOUTS)})")
    get_layout(meta.layout).check_meta(meta, path)
    return meta


def read_meta_or_default(folder: str | Path) -> CheckpointMeta:
    """The checkpoint's metadata, or step-0 defaults for a plain Hugging Face dir or GGUF file."""
    folder = Path(folder)
    return read_meta(folder) if folder.is_dir() and is_checkpoint(folder) else CheckpointMeta()


def layout_of(folder: str | Path) -> Layout:
    """The layout of a checkpoint dir; a plain Hugging Face dir reads as 'single'."""
    return get_layout(read_meta_or_default(folder).layout)


def is_hf_dir(folder: str | Path) -> bool:
    """Whether the folder loads as a Hugging Face model dir as it is (else: build the model, then its weights)."""
    return layout_of(folder).is_hf_dir


def check_complete(folder: str | Path) -> CheckpointMeta:
    """The checkpoint's meta after checking every file is there (call before any collective)."""
    meta = read_meta(folder)
    layout = get_layout(meta.layout)
    layout.check_complete(Path(folder))
    layout.check_optimizer(Path(folder), meta)
    return meta


def read_full_weights(folder: str | Path, config=None) -> dict[str, torch.Tensor]:
    """Full weights with Hugging Face names (stored dtypes) of a model dir or a checkpoint of any layout;
    `config`: the folder's config where the caller has read it (a layout that needs it reads it otherwise)."""
    folder = Path(folder)
    if not is_checkpoint(folder):
        return read_weights(folder)
    return layout_of(folder).read_full_weights(folder, config)


def read_full_optimizer(folder: str | Path) -> dict[str, torch.Tensor] | None:
    """The stored optimizer tensors with Hugging Face parameter names, unsharded, or None (none stored, or a
    layout that keeps them in another form: a backend that reads them in its own form does so itself)."""
    folder = Path(folder)
    return layout_of(folder).read_full_optimizer(folder) if is_checkpoint(folder) else None


def reads_shards(folder: str | Path) -> bool:
    """Whether `folder` is a checkpoint whose layout lets each rank of a sharded trainer read its own shards."""
    folder = Path(folder)
    return folder.is_dir() and is_checkpoint(folder) and layout_of(folder).reads_shards


def read_shards(folder: str | Path, part: str, shards) -> None:
    """Fill a sharded trainer's tensors of `part` ('model' or 'optim') from a checkpoint whose layout `reads_shards`,
    each rank reading its own shards (`shards()`: its tensors, filled in place); collective."""
    folder = Path(folder)
    layout_of(folder).read_shards(folder, part, shards)


def read_lora(folder: str | Path):
    """The adapters of a LoRA checkpoint (a LoraCheckpoint: settings, base, tensors), or None for a model dir, a
    GGUF file or a checkpoint of full weights."""
    folder = Path(folder)
    return layout_of(folder).read_lora(folder) if folder.is_dir() and is_checkpoint(folder) else None


def trained_layout(state: TrainedState, default: str) -> str:
    """The layout a trained model is written in: the LoRA layout for a trainer with adapters (its `lora`), else
    `default` (the layout it was read from, or its backend's)."""
    return catalog.LORA if getattr(state, "lora", None) is not None else default


def read_local_state(folder: str | Path, kind: str, coords: dict[str, int]) -> LocalState:
    """One process's shards of a checkpoint in a backend's form (e.g. a megatron stage's state)."""
    return layout_of(folder).read_local_state(Path(folder), kind, coords)


def save(
    out: str | Path,
    state: TrainedState,
    aux: dict[str, bytes],
    meta: CheckpointMeta,
    overwrite: bool = False,
    nested: dict[str, CheckpointPart] | None = None,
    before_publish: Callable[[], None] | None = None,
) -> None:
    """Write a trained model (and nested ones) in `meta.layout`; every process of the launch calls this."""
    prepare_save(out, state, aux, meta, overwrite, nested, before_publish)()


def prepare_save(
    out: str | Path,
    state: TrainedState,
    aux: dict[str, bytes],
    meta: CheckpointMeta,
    overwrite: bool = False,
    nested: dict[str, CheckpointPart] | None = None,
    before_publish: Callable[[], None] | None = None,
) -> Callable[[], None]:
    """`save`'s collective part now (every process); returns the part that only writes files (run it, possibly in a
    background thread, on every process: it is a no-op where there is nothing to write). When a part trains
    adapters, the LoRA layout writes the folder (it writes full parts as 'single' ones)."""
    parts = {"": CheckpointPart(state, aux, meta), **(nested or {})}
    has_adapters = any(part.meta.layout == catalog.LORA for part in parts.values())
    layout = get_layout(catalog.LORA if has_adapters else meta.layout, "layout")
    layout.check_output(str(out))
    return layout.prepare_write(str(out), parts, overwrite, before_publish)
