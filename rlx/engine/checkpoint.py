"""rlx checkpoint dirs: an HF model dir plus optimizer state and `rlx.json` (the 'fsdp' layout keeps
weights and optimizer state in a sharded DCP folder instead: see rlx/engine/parallel/dcp.py; the
'megatron' layout one folder per tensor x pipeline rank: see rlx/engine/megatron/checkpoint.py).

    CKPT/
      rlx.json                   layout, step, data position, optimizer hyper-parameters, provenance
      config.json, tokenizer...  copied byte for byte from the source model dir
      model.safetensors          weights with Hugging Face names (sharded + index when large)
      optimizer.safetensors      optimizer state per parameter name (after a train step)

Because the folder is also a valid Hugging Face model dir, every command that reads a model accepts
a checkpoint; for the sharded layouts, `read_full_checkpoint_weights` gathers the full Hugging Face
weights first. Checkpoints are written under a temporary name and renamed into place.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from rlx import __version__
from rlx.engine.io import apply_umask, atomic_dir, read_json
from rlx.errors import UserError
from rlx.models.loading import WEIGHTS_INDEX_NAME, WEIGHTS_NAME, read_safetensors, read_weights

META_NAME = "rlx.json"
OPTIMIZER_NAME = "optimizer.safetensors"
FORMAT_VERSION = 1
LAYOUTS = ("single", "fsdp", "megatron")
MAX_SHARD_SIZE = "5GB"
_NOT_AUX = {META_NAME, OPTIMIZER_NAME, WEIGHTS_INDEX_NAME}


@dataclass(kw_only=True)
class CheckpointMeta:
    """Contents of `rlx.json`: what the checkpoint is and where it came from."""

    format_version: int = FORMAT_VERSION
    """Version of the checkpoint format."""
    layout: str = "single"
    """Weight layout: 'single' (full weights in safetensors), 'fsdp' (a sharded torch.distributed.checkpoint) or
    'megatron' (one megatron-core state per tensor x pipeline rank)."""
    tp_degree: int | None = None
    """Tensor-parallel degree the 'megatron' layout was written with (None for the other layouts)."""
    pp_degree: int | None = None
    """Pipeline-parallel degree the 'megatron' layout was written with (None for the other layouts)."""
    step: int = 0
    """Number of training steps applied since `rlx shard` (0 for a fresh shard)."""
    data_position: int | None = None
    """Prompts consumed so far by `rlx ppo` (None when unknown, e.g. after a hand-run train-step)."""
    optimizer: dict | None = None
    """Optimizer name and hyper-parameters of its param groups, when optimizer state is stored."""
    kl_coef: float | None = None
    """The in-reward KL coefficient after this step (`rlx ppo` with an adaptive controller)."""
    provenance: dict = field(default_factory=dict)
    """Which command wrote it, from what source, with which rlx version and when."""

    @classmethod
    def read(cls, folder: Path) -> CheckpointMeta:
        path = folder / META_NAME
        data = read_json(path)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise UserError(f"{path}: unknown key '{unknown[0]}' (written by a newer rlx?)")
        meta = cls(**data)
        if meta.format_version != FORMAT_VERSION:
            raise UserError(
                f"{path}: checkpoint format_version {meta.format_version} is not supported "
                f"(this rlx reads {FORMAT_VERSION})"
            )
        if meta.layout not in LAYOUTS:
            raise UserError(f"{path}: layout {meta.layout!r} is not supported here (known: {', '.join(LAYOUTS)})")
        if meta.layout == "megatron":
            for name in ("tp_degree", "pp_degree"):
                value = getattr(meta, name)
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise UserError(f"{path}: layout 'megatron' needs '{name}' (a positive integer), got {value!r}")
        return meta


def is_checkpoint(folder: Path) -> bool:
    """True for an rlx checkpoint dir (a model dir with rlx.json)."""
    return (Path(folder) / META_NAME).is_file()


def read_meta_or_default(folder: Path) -> CheckpointMeta:
    """The checkpoint's metadata, or step-0 defaults for a plain Hugging Face dir or GGUF file."""
    folder = Path(folder)
    return CheckpointMeta.read(folder) if folder.is_dir() and is_checkpoint(folder) else CheckpointMeta()


def provenance(command: str, source: str | Path | None = None, **more) -> dict:
    """A provenance record for rlx.json."""
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()
    out = {"created_by": command, "rlx_version": __version__, "created_at": now}
    if source is not None:
        out["source"] = str(source)
    out.update(more)
    return out


def aux_files(folder: Path) -> dict[str, bytes]:
    """Top-level non-weight files of a model dir (config, tokenizer, templates), as bytes."""
    out = {}
    for path in sorted(Path(folder).iterdir()):
        if (
            path.is_file()
            and path.name not in _NOT_AUX
            and not path.name.startswith(".")
            and path.suffix not in (".safetensors", ".bin", ".gguf", ".pt", ".pth")
        ):
            out[path.name] = path.read_bytes()
    return out


def write_weights(folder: Path, state: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> None:
    """Write weights in the Hugging Face layout: one file, or shards plus an index past MAX_SHARD_SIZE."""
    from huggingface_hub import split_torch_state_dict_into_shards

    tensors = {
        k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().cpu().contiguous()
        for k, v in state.items()
    }
    split = split_torch_state_dict_into_shards(
        tensors, filename_pattern="model{suffix}.safetensors", max_shard_size=MAX_SHARD_SIZE
    )
    for filename, keys in split.filename_to_tensors.items():
        save_file({k: tensors[k] for k in keys}, str(folder / filename), metadata={"format": "pt"})
        apply_umask(folder / filename)  # safetensors makes its files 0600
    if split.is_sharded:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
            "weight_map": split.tensor_to_filename,
        }
        (folder / WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    else:
        assert list(split.filename_to_tensors) == [WEIGHTS_NAME]


@dataclass
class CheckpointContent:
    """What one checkpoint dir holds."""

    weights: dict[str, torch.Tensor]
    aux: dict[str, bytes]
    meta: CheckpointMeta
    optimizer_state: dict[str, torch.Tensor] | None = None


def write_aux(folder: Path, aux: dict[str, bytes]) -> None:
    """Write config, tokenizer and other non-weight files byte for byte."""
    for name, data in aux.items():
        (folder / name).write_bytes(data)


def write_optimizer_state(folder: Path, state: dict[str, torch.Tensor]) -> None:
    """Write optimizer tensors keyed '<param>::<state key>' to OPTIMIZER_NAME."""
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in state.items()},
        str(folder / OPTIMIZER_NAME),
        metadata={"format": "rlx-optimizer"},
    )
    apply_umask(folder / OPTIMIZER_NAME)


def write_meta(folder: Path, meta: CheckpointMeta) -> None:
    """Write rlx.json (the marker that the checkpoint is complete: written last)."""
    (folder / META_NAME).write_text(json.dumps(dataclasses.asdict(meta), indent=2) + "\n")


def write_checkpoint(folder: Path, content: CheckpointContent) -> None:
    """Write a checkpoint's files into an existing (temporary) folder."""
    write_aux(folder, content.aux)
    write_weights(folder, content.weights)
    if content.optimizer_state is not None:
        write_optimizer_state(folder, content.optimizer_state)
    write_meta(folder, content.meta)


def save_checkpoint(
    out: Path,
    *,
    weights: dict[str, torch.Tensor],
    aux: dict[str, bytes],
    meta: CheckpointMeta,
    optimizer_state: dict[str, torch.Tensor] | None = None,
    overwrite: bool = False,
    nested: dict[str, CheckpointContent] | None = None,
    before_publish: Callable[[], None] | None = None,
) -> None:
    """Write a complete checkpoint dir atomically (temporary folder, then rename).

    `nested` checkpoints (e.g. the critic of `rlx ppo`) go into sub-folders, inside the same rename.
    `before_publish()` runs once everything is written, just before the rename (if it raises, nothing is
    published).
    """
    with atomic_dir(out, overwrite=overwrite, marker=META_NAME) as tmp:
        write_checkpoint(tmp, CheckpointContent(weights, aux, meta, optimizer_state))
        for name, content in (nested or {}).items():
            (tmp / name).mkdir()
            write_checkpoint(tmp / name, content)
        if before_publish is not None:
            before_publish()


def load_optimizer_state(folder: Path) -> dict[str, torch.Tensor] | None:
    """The stored optimizer tensors of a 'single' or 'fsdp' checkpoint (unsharded), or None when it has none.

    A 'megatron' checkpoint keeps its optimizer state per tensor x pipeline rank, keyed by megatron
    parameter names: only the megatron trainer reads it (rlx.engine.megatron.checkpoint.read_rank_optimizer),
    so this returns None there and a Hugging Face trainer starting from it starts a fresh optimizer."""
    from rlx.engine.megatron.checkpoint import is_megatron_checkpoint
    from rlx.engine.parallel.dcp import is_dcp_checkpoint, read_full_optimizer

    if is_dcp_checkpoint(folder):
        return read_full_optimizer(folder)
    if is_megatron_checkpoint(folder):
        return None
    path = Path(folder) / OPTIMIZER_NAME
    return read_safetensors(path) if path.is_file() else None


def is_sharded_checkpoint(folder: Path) -> bool:
    """True for a checkpoint whose weights are not Hugging Face files ('fsdp' or 'megatron' layout)."""
    from rlx.engine.megatron.checkpoint import is_megatron_checkpoint
    from rlx.engine.parallel.dcp import is_dcp_checkpoint

    return is_dcp_checkpoint(folder) or is_megatron_checkpoint(folder)


def read_full_checkpoint_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Full weights with Hugging Face names (stored dtypes) of a model dir or checkpoint of any layout."""
    from rlx.engine.megatron import checkpoint as megatron
    from rlx.engine.parallel import dcp

    if dcp.is_dcp_checkpoint(folder):
        return dcp.read_full_weights(folder)
    if megatron.is_megatron_checkpoint(folder):
        return megatron.read_full_weights(folder)
    return read_weights(Path(folder))
