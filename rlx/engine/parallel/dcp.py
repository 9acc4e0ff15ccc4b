"""The 'fsdp' checkpoint layout: weights and optimizer state as a torch.distributed.checkpoint (DCP).

    CKPT/
      rlx.json, config.json, tokenizer...   as in the 'single' layout (layout = "fsdp")
      dcp/.metadata, dcp/__R_0.distcp       DCP shards: "model.<param>" and "optim.<param>::<state key>"

Each rank writes its own shards (no gather on one rank), and any world size can read them: DCP
reshards on load, and `read_full_*` give the unsharded tensors to a single process (for `rlx merge`,
`rlx rollout`, or ranks that load full weights before sharding). Saving is atomic: every rank writes
into one temporary folder that rank 0 renames after all ranks are done.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from rlx.engine.io import atomic_dir
from rlx.engine.parallel.dist import DistContext, barrier, broadcast_object
from rlx.errors import UserError

DCP_DIR = "dcp"
_SEP = "::"


@contextlib.contextmanager
def _quiet():
    """DCP warns that it runs 'in a single process' whenever no process group exists: that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def is_dcp_checkpoint(folder: str | Path) -> bool:
    return (Path(folder) / DCP_DIR / ".metadata").is_file()


def _metadata(folder: Path):
    try:
        return dcp.FileSystemReader(str(folder / DCP_DIR)).read_metadata()
    except (OSError, ValueError, RuntimeError) as e:
        raise UserError(f"{folder}/{DCP_DIR}: not a readable distributed checkpoint ({e})") from None


def _read_full(folder: Path, prefix: str) -> dict[str, torch.Tensor]:
    """Unsharded tensors stored under `prefix` (one process; no process group needed)."""
    metadata = _metadata(folder)
    targets = {}
    for key, item in metadata.state_dict_metadata.items():
        if key.startswith(prefix) and hasattr(item, "properties"):
            targets[key[len(prefix) :]] = torch.empty(item.size, dtype=item.properties.dtype)
    if targets:
        with _quiet():
            dcp.load({prefix.rstrip("."): targets}, checkpoint_id=str(folder / DCP_DIR), no_dist=True)
    return targets


def read_full_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """All model tensors of an 'fsdp' checkpoint, unsharded, with their stored dtypes."""
    weights = _read_full(Path(folder), "model.")
    if not weights:
        raise UserError(f"{folder}: the distributed checkpoint holds no model weights")
    return weights


def read_full_optimizer(folder: str | Path) -> dict[str, torch.Tensor] | None:
    """Optimizer tensors keyed '<param>::<state key>' (as optimizer.safetensors), or None."""
    return _read_full(Path(folder), "optim.") or None


def save_dcp_checkpoint(
    out: str | Path,
    model_state: dict[str, torch.Tensor],
    aux: dict[str, bytes],
    meta,
    ctx: DistContext,
    optimizer_state: dict[str, torch.Tensor] | None = None,
    overwrite: bool = False,
) -> None:
    """Write an 'fsdp' checkpoint. Collective under a launcher: every rank passes its shards (DTensors
    from get_model_state_dict / get_optimizer_state_dict, flattened to '<param>::<key>')."""
    publish = atomic_dir(out, overwrite=overwrite) if ctx.is_main else contextlib.nullcontext()
    with publish as tmp:  # rank 0 renames the folder into place after every rank has written
        tmp = Path(broadcast_object(str(tmp) if ctx.is_main else None))
        state = {"model": model_state, **({"optim": optimizer_state} if optimizer_state else {})}
        with _quiet():
            dcp.save(state, checkpoint_id=str(tmp / DCP_DIR), no_dist=not ctx.distributed)
        barrier()
        if ctx.is_main:
            for name, data in aux.items():
                (tmp / name).write_bytes(data)
            (tmp / "rlx.json").write_text(json.dumps(dataclasses.asdict(meta), indent=2) + "\n")
    barrier()  # published before any rank goes on


def sharded_model_state(model: torch.nn.Module, tied: set[str]) -> dict[str, torch.Tensor]:
    """This rank's shards of the model state (DTensors under FSDP, plain tensors otherwise), untied."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return {k: v for k, v in get_model_state_dict(model).items() if k not in tied}


def sharded_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's shards of the optimizer state, flattened to '<param>::<state key>'."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    out = {}
    for name, entries in get_optimizer_state_dict(model, optimizer).get("state", {}).items():
        for key, value in entries.items():
            out[f"{name}{_SEP}{key}"] = value if torch.is_tensor(value) else torch.tensor(value, dtype=torch.float32)
    return out
