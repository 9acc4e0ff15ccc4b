"""The 'fsdp' layout: weights and optimizer state as a torch.distributed.checkpoint (DCP).

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
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from rlx.checkpoints.base import CheckpointPart, Layout
from rlx.checkpoints.files import write_aux
from rlx.checkpoints.meta import CheckpointMeta
from rlx.errors import UserError
from rlx.parallel.dist import barrier, broadcast_object
from rlx.utils.io import atomic_dir, is_remote

DCP_DIR = "dcp"


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


def save_dcp(out: str | Path, weights: dict, optimizer: dict | None, aux: dict[str, bytes], meta: CheckpointMeta,
             is_main: bool, overwrite: bool = False, before_publish: Callable | None = None) -> None:  # fmt: skip
    """Write an 'fsdp' checkpoint; collective when a process group exists: every rank passes its own shards
    (DTensors from get_model_state_dict / get_optimizer_state_dict, flattened to '<param>::<key>')."""
    publish = atomic_dir(out, overwrite=overwrite) if is_main else contextlib.nullcontext()
    with publish as tmp:  # the main process renames the folder into place after every rank has written
        tmp = Path(broadcast_object(str(tmp) if is_main else None))
        state = {"model": weights, **({"optim": optimizer} if optimizer else {})}
        with _quiet():
            dcp.save(state, checkpoint_id=str(tmp / DCP_DIR), no_dist=not dist.is_initialized())
        barrier()
        if is_main:
            write_aux(tmp, aux)
            meta.write(tmp)
            if before_publish is not None:
                before_publish()
    barrier()  # published before any rank goes on


class FsdpLayout(Layout):
    name = "fsdp"

    def check_output(self, out: str) -> None:
        if is_remote(out):
            raise UserError(f"--out {out}: the fsdp layout is written to local (or mounted) storage only")

    def read_full_weights(self, folder: Path) -> dict[str, torch.Tensor]:
        return read_full_weights(folder)

    def read_full_optimizer(self, folder: Path) -> dict[str, torch.Tensor] | None:
        return read_full_optimizer(folder)

    def write_full(self, out, weights, aux, meta, config, overwrite) -> None:
        save_dcp(out, weights, None, aux, meta, is_main=True, overwrite=overwrite)

    def write(
        self, out: str, parts: dict[str, CheckpointPart], overwrite: bool, before_publish: Callable | None = None
    ) -> None:
        if set(parts) != {""}:
            nested = ", ".join(sorted(set(parts) - {""}))
            raise UserError(f"{out}: the fsdp layout holds one model (no nested {nested})")
        part = parts[""]
        local = part.state.local_state()
        if local.kind != "dtensor":
            raise UserError(f"{out}: the fsdp layout stores FSDP shards, not '{local.kind}' state")
        is_main = part.state.is_main
        save_dcp(out, local.weights, local.optimizer, part.aux, part.meta, is_main, overwrite, before_publish)
