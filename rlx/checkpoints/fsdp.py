"""The 'fsdp' layout: weights and optimizer state as a torch.distributed.checkpoint (DCP).

    CKPT/
      rlx.json, config.json, tokenizer...   as in the 'single' layout (layout = "fsdp")
      dcp/.metadata, dcp/__R_0.distcp       DCP shards: "model.<param>" and "optim.<param>::<state key>"

Each rank writes its own shards (no gather on one rank), and any world size can read them: DCP
reshards on load. A sharded trainer's ranks each read their own shards (`read_shards`: `--resume` under a
launcher); `read_full_*` give the unsharded tensors to a single process (`rlx merge`, `rlx rollout`, a lone
trainer). Saving is atomic: every rank writes
into one temporary folder that rank 0 renames after all ranks are done.

In the background (`prepare_write`, what `rlx ppo` uses under a launcher): the collective part only copies each
rank's shards to host memory (pinned buffers reused from one checkpoint to the next, rlx.utils.host_copy) and agrees
on the temporary folder; the returned write runs on every rank's writer thread, each rank writing its own shards in
parallel, coordinated over a gloo process group of its own so that it never meets the training's collectives.
A nested model (a critic) lies in its own sub-folder with its own dcp/.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from rlx.checkpoints.base import CheckpointPart, Layout
from rlx.checkpoints.files import with_config_dtype, write_aux
from rlx.checkpoints.meta import CheckpointMeta
from rlx.errors import UserError
from rlx.observe.tracking import console
from rlx.parallel.dist import barrier, broadcast_object
from rlx.utils.host_copy import exact_storage, layout, snapshot, wait_copied
from rlx.utils.io import atomic_dir, is_remote

DCP_DIR = "dcp"
WRITE_THREADS = 8
"""Threads (one file each) a rank writes its shards with, without an fsync per file, as torch.save and
transformers' save_pretrained write: on the lent 4 x H100 host (bench/checkpoint_write.py, 6 GB a rank x 4) one
thread with fsync wrote 1.5 GB/s in all, 16 threads with fsync 1.8 GB/s (the disk's flush is the limit), 4 threads
without 15 GB/s and 16 without 38 GB/s. A killed process loses nothing written (the kernel has the pages) and an
unfinished checkpoint is never published (the temporary folder is renamed last); a machine that loses power before
the kernel has flushed the pages (a minute for a 7B model's 91 GB on that disk) may."""


@contextlib.contextmanager
def _quiet():
    """DCP warns that it runs 'in a single process' whenever no process group exists: that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


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


def read_shards(folder: Path, part: str, shards: Callable[[], dict[str, torch.Tensor]]) -> None:
    """Fill this rank's tensors of `part` in place from the checkpoint; collective. `part` is 'model' (the weights) or
    'optim' (the AdamW state, keyed '<param>::<state key>'); `shards()` gives the tensors as the running sharding holds
    them (DTensors under FSDP), keyed as `save_dcp` wrote them. Each rank reads only the bytes of its own shards (DCP
    reshards when the number of ranks changed), where the full tensors on every rank take 12 bytes a parameter on each
    rank's host: a 7B run resuming on four H200 read 365 GB onto one host and spent ~280 s loading (2026-11-29). A
    checkpoint without optimizer state (`rlx shard`'s) leaves the optimizer as it is (`shards()` is not called: it
    would initialize the state); a tensor on one side only, or of another shape, is an error."""
    prefix = f"{part}."
    stored = {k[len(prefix) :]: v for k, v in _metadata(folder).state_dict_metadata.items() if k.startswith(prefix)}
    if not stored and part == "optim":
        return
    state = shards()
    _check_same_tensors(folder, part, {k: tuple(getattr(v, "size", ())) for k, v in stored.items()}, state)
    with _quiet():
        dcp.load({part: state}, checkpoint_id=str(folder / DCP_DIR))


def _check_same_tensors(folder: Path, part: str, stored: dict[str, tuple], state: dict[str, torch.Tensor]) -> None:
    """The stored tensors of `part` (names and global shapes) against the running model's (`state`)."""
    if part == "optim":  # named by parameter: '<param>::<state key>'
        params, saved = ({key.rpartition("::")[0] for key in keys} for keys in (state, stored))
        problems = [f"optimizer state for unknown parameter {name!r}" for name in sorted(saved - params)]
        problems += [f"no optimizer state for parameter {name!r}" for name in sorted(params - saved)]
    else:
        shared = sorted(state.keys() & stored.keys())
        problems = [
            f"tensor {name} has shape {stored[name]}, the config expects {tuple(state[name].shape)}"
            for name in shared
            if tuple(state[name].shape) != stored[name]
        ]
    problems += [
        f"the checkpoint has no {name!r} ({part}; expected by the model)"
        for name in sorted(state.keys() - stored.keys())
    ]
    problems += [
        f"the checkpoint holds {name!r} ({part}), which the model has not"
        for name in sorted(stored.keys() - state.keys())
    ]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UserError(f"{folder}: {problems[0]}{more}")


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
            write_aux(tmp, with_config_dtype(aux, weights))  # the dtype of the shards written
            meta.write(tmp)
            if before_publish is not None:
                before_publish()
    barrier()  # published before any rank goes on


_WRITER_GROUPS: dict = {}


def _writer_group():
    """A gloo process group for the background writes, one per default group (created collectively on the main
    thread at the first save), or None without a process group."""
    if not dist.is_initialized():
        return None
    world = dist.group.WORLD
    if world not in _WRITER_GROUPS:
        _WRITER_GROUPS.clear()  # a process group of an earlier launch in this process is gone
        _WRITER_GROUPS[world] = dist.new_group(backend="gloo")
    return _WRITER_GROUPS[world]


def _host_copy(tensors: dict[str, torch.Tensor], tag: str) -> dict[str, torch.Tensor]:
    """This rank's shards as host copies the next updates leave alone, in the same DTensor layout (DCP plans the
    global checkpoint from it); CUDA shards are still being copied when this returns."""
    from torch.distributed.tensor import DTensor

    copies = {k: exact_storage(v) for k, v in snapshot(_local_tensors(tensors), tag).items()}  # DCP: no copy-out
    return {
        k: DTensor(copies[k], v._spec, requires_grad=False) if isinstance(v, DTensor) else copies[k]
        for k, v in tensors.items()
    }


def _tags(name: str) -> tuple[str, str]:
    """The host buffers' tags of a part's weights and optimizer shards."""
    return f"fsdp/{name or 'model'}/weights", f"fsdp/{name or 'model'}/optim"


def _local_tensors(tensors: dict) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {k: v.to_local() if isinstance(v, DTensor) else v for k, v in tensors.items()}


def _shards(part: CheckpointPart, out: str, name: str) -> dict:
    """A part's DCP state dict of host copies of this rank's shards ('model', 'optim')."""
    local = part.state.local_state()
    if local.kind != "dtensor":
        raise UserError(f"{out}: the fsdp layout stores FSDP shards, not '{local.kind}' state")
    weights_tag, optim_tag = _tags(name)
    state = {"model": _host_copy(local.weights, weights_tag)}
    if local.optimizer:
        state["optim"] = _host_copy(local.optimizer, optim_tag)
    return state


def _nbytes(states: dict) -> int:
    return sum(t.numel() * t.element_size() for state in states.values() for part in state.values()
               for t in _local_tensors(part).values())  # fmt: skip


def prepare_dcp_write(out: str, parts: dict[str, CheckpointPart], overwrite: bool,
                      before_publish: Callable | None = None) -> Callable[[], None]:  # fmt: skip
    """The collective part of an 'fsdp' save now (every rank: host copies of its shards, the temporary folder
    agreed on); returns the write, which every rank runs (possibly on its writer thread): its own shards, then the
    main rank's config, tokenizer and rlx.json, and the rename once every rank is done."""
    is_main = parts[""].state.is_main
    group = _writer_group()
    publish = atomic_dir(out, overwrite=overwrite) if is_main else contextlib.nullcontext()
    tmp = publish.__enter__()
    try:
        tmp = Path(broadcast_object(str(tmp) if is_main else None))
        started = time.perf_counter()
        states = {name: _shards(part, out, name) for name, part in parts.items()}
    except BaseException:
        _abandon(publish)
        raise

    copied = time.perf_counter()

    def write() -> None:
        try:
            waited = time.perf_counter()
            wait_copied()
            on_host = time.perf_counter()
            for name, state in states.items():
                folder = tmp / name if name else tmp
                (folder / DCP_DIR).mkdir(parents=True, exist_ok=True)
                writer = dcp.FileSystemWriter(folder / DCP_DIR, thread_count=WRITE_THREADS, sync_files=False)
                with _quiet():
                    dcp.save(state, storage_writer=writer, process_group=group, no_dist=group is None)
            written = time.perf_counter()
            if group is not None:
                dist.barrier(group=group)  # every rank's shards are on disk
            if is_main:
                console(
                    f"checkpoint {out}: {_nbytes(states) / 1e9:.1f} GB of shards per rank; copies started in "
                    f"{copied - started:.1f} s, on the host {on_host - waited:.1f} s later, files written in "
                    f"{written - on_host:.1f} s, all ranks done {time.perf_counter() - written:.1f} s later"
                )
            if is_main:
                for name, part in parts.items():
                    folder = tmp / name if name else tmp
                    folder.mkdir(exist_ok=True)
                    write_aux(folder, with_config_dtype(part.aux, states[name]["model"]))  # the shards' dtype
                    part.meta.write(folder)
                if before_publish is not None:
                    before_publish()
        except BaseException as e:
            publish.__exit__(type(e), e, e.__traceback__)
            raise
        publish.__exit__(None, None, None)

    return write


def _abandon(publish) -> None:
    """Leave a temporary folder unpublished (an error before any file was written)."""
    with contextlib.suppress(BaseException):
        publish.__exit__(RuntimeError, RuntimeError("abandoned"), None)


class FsdpLayout(Layout):
    name = "fsdp"
    writes_shards = True
    reads_shards = True

    def check_output(self, out: str) -> None:
        if is_remote(out):
            raise UserError(f"--out {out}: the fsdp layout is written to local (or mounted) storage only")

    def read_full_weights(self, folder: Path, config=None) -> dict[str, torch.Tensor]:
        return read_full_weights(folder)

    def read_full_optimizer(self, folder: Path) -> dict[str, torch.Tensor] | None:
        return read_full_optimizer(folder)

    def read_shards(self, folder: Path, part: str, shards: Callable[[], dict[str, torch.Tensor]]) -> None:
        read_shards(folder, part, shards)

    def write_full(self, out, weights, aux, meta, config, overwrite) -> None:
        save_dcp(out, weights, None, aux, meta, is_main=True, overwrite=overwrite)

    def write(
        self, out: str, parts: dict[str, CheckpointPart], overwrite: bool, before_publish: Callable | None = None
    ) -> None:
        self.prepare_write(out, parts, overwrite, before_publish)()
        barrier()  # published before any rank goes on

    def prepare_write(
        self, out: str, parts: dict[str, CheckpointPart], overwrite: bool, before_publish: Callable | None = None
    ) -> Callable[[], None]:
        return prepare_dcp_write(out, parts, overwrite, before_publish)

    def host_buffers(self, states: dict) -> list[tuple[dict, str]]:
        buffers = []
        for name, state in states.items():
            local = state.local_state()
            if local.kind != "dtensor":
                return []
            weights_tag, optim_tag = _tags(name)
            buffers.append((layout(_local_tensors(local.weights)), weights_tag))
            if local.optimizer:
                buffers.append((layout(_local_tensors(local.optimizer)), optim_tag))
        return buffers
