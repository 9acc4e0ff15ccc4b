"""`rlx.json`: what a checkpoint is (layout, step, data position, optimizer settings) and where it came from.

The file is written last, so a folder with a readable rlx.json is a complete checkpoint. Which layouts
exist, and what each requires of its metadata, is the registry's business (rlx/checkpoints/registry.py).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from dataclasses import dataclass, field
from pathlib import Path

from rlx import __version__
from rlx.errors import UserError
from rlx.utils.io import read_json

META_NAME = "rlx.json"
FORMAT_VERSION = 1


@dataclass(kw_only=True)
class CheckpointMeta:
    """Contents of `rlx.json`: what the checkpoint is and where it came from."""

    format_version: int = FORMAT_VERSION
    """Version of the checkpoint format."""
    layout: str = "single"
    """Weight layout, a name in the layout registry: 'single' (full weights in safetensors), 'fsdp' (a sharded
    torch.distributed.checkpoint) or 'megatron' (one megatron-core state per tensor x pipeline rank)."""
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
        """The folder's rlx.json, checked for known keys and the format version (not the layout: see registry)."""
        path = Path(folder) / META_NAME
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
        return meta

    def write(self, folder: Path) -> None:
        """Write rlx.json into `folder` (the marker that the checkpoint is complete: write it last)."""
        (Path(folder) / META_NAME).write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")


def is_checkpoint(folder: str | Path) -> bool:
    """True for an rlx checkpoint dir (a model dir with rlx.json)."""
    return (Path(folder) / META_NAME).is_file()


def provenance(command: str, source: str | Path | None = None, **more) -> dict:
    """A provenance record for rlx.json."""
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()
    out = {"created_by": command, "rlx_version": __version__, "created_at": now}
    if source is not None:
        out["source"] = str(source)
    out.update(more)
    return out
