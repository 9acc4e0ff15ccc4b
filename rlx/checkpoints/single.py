"""The 'single' layout: a Hugging Face model dir plus rlx.json and optimizer.safetensors.

    CKPT/
      rlx.json, config.json, tokenizer...   (see rlx/checkpoints/files.py)
      model.safetensors                     full weights with Hugging Face names
      optimizer.safetensors                 AdamW state per parameter name (after a train step)

Because the folder is a valid Hugging Face model dir, any tool loads it. A training backend's state is
gathered onto the main process, which writes it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from rlx.checkpoints.base import CheckpointPart, Layout
from rlx.checkpoints.files import (
    OPTIMIZER_NAME,
    read_optimizer_state,
    with_config_dtype,
    write_aux,
    write_optimizer_state,
    write_weights,
)
from rlx.checkpoints.meta import META_NAME, CheckpointMeta
from rlx.errors import UserError
from rlx.models.loading import read_weights
from rlx.utils.host_copy import snapshot, wait_copied
from rlx.utils.io import atomic_dir


def write_files(folder: Path, weights: dict, aux: dict[str, bytes], meta: CheckpointMeta, optimizer=None) -> None:
    """A 'single' checkpoint's files into an existing (temporary) folder, rlx.json last; config.json records the
    dtype the weights are written in (a trainer's float32 master weights of a bfloat16 model: float32)."""
    write_aux(folder, with_config_dtype(aux, weights))
    write_weights(folder, weights)
    if optimizer is not None:
        write_optimizer_state(folder, optimizer)
    meta.write(folder)


def _snapshot(state, name: str) -> tuple[dict, dict | None]:
    """A state's full weights and optimizer tensors as copies the next updates leave alone (a collective)."""
    take = getattr(state, "snapshot_state", None)
    if take is not None:
        return take()
    weights, optimizer = state.full_weights(), state.full_optimizer_state()
    tag = f"single/{name}"
    return snapshot(weights, tag + "/weights"), None if optimizer is None else snapshot(optimizer, tag + "/optim")


def _write_part(folder: Path, part: CheckpointPart, weights: dict, optimizer: dict | None) -> None:
    write_files(folder, weights, part.aux, part.meta, optimizer)


def folder_commit(out: str, parts: dict[str, CheckpointPart], gathered: dict, overwrite: bool,
                  before_publish: Callable | None, write_part: Callable) -> Callable[[], None]:  # fmt: skip
    """The file half of a write whose tensors were gathered (or are still being copied to the host): wait for
    the copies, write each part's folder with `write_part(folder, part, tensors, optimizer)`, publish."""

    def commit() -> None:
        wait_copied()
        with atomic_dir(out, overwrite=overwrite, marker=META_NAME) as tmp:
            for name, part in parts.items():
                folder = tmp / name if name else tmp
                folder.mkdir(exist_ok=True)
                write_part(folder, part, *gathered[name])
            if before_publish is not None:
                before_publish()

    return commit


class SingleLayout(Layout):
    name = "single"
    is_hf_dir = True

    def read_full_weights(self, folder: Path, config=None) -> dict[str, torch.Tensor]:
        return read_weights(Path(folder))

    def read_full_optimizer(self, folder: Path) -> dict[str, torch.Tensor] | None:
        return read_optimizer_state(folder)

    def check_optimizer(self, folder: Path, meta: CheckpointMeta) -> None:
        if meta.optimizer is not None and not (Path(folder) / OPTIMIZER_NAME).is_file():
            raise UserError(
                f"{folder}: rlx.json records {meta.optimizer.get('name', 'optimizer')} state at step {meta.step} but "
                f"{OPTIMIZER_NAME} is missing (an incomplete copy?); copy it too, or train from the weights alone "
                f"with a fresh optimizer: rlx shard --model {folder} --out NEW"
            )

    def write_full(self, out, weights, aux, meta, config, overwrite) -> None:
        with atomic_dir(out, overwrite=overwrite, marker=META_NAME) as tmp:
            write_files(tmp, weights, aux, meta)

    def write(
        self, out: str, parts: dict[str, CheckpointPart], overwrite: bool, before_publish: Callable | None = None
    ) -> None:
        self.prepare_write(out, parts, overwrite, before_publish)()

    def prepare_write(
        self, out: str, parts: dict[str, CheckpointPart], overwrite: bool, before_publish: Callable | None = None
    ) -> Callable[[], None]:
        """Gather every part's weights and optimizer state onto the main process's CPU now (a collective); the
        returned function writes the files and publishes the folder (nothing to do on other processes)."""
        gathered = {name: _snapshot(p.state, name) for name, p in parts.items()}
        if not parts[""].state.is_main:
            return lambda: None

        return folder_commit(out, parts, gathered, overwrite, before_publish, _write_part)
