"""The checkpoint-layout interface: what every layout (single, fsdp, megatron, ...) implements.

A layout decides how a model's weights and optimizer state lie in a checkpoint folder. Every layout
can be written from full Hugging Face weights in one process (`rlx shard`) and read back as full weights
(`rlx merge`, every loader). A training backend writes its live state collectively through `write`,
handing over a `TrainedState`: the layout asks it for the form it stores (full tensors gathered on rank
0, or this rank's own shards). Callers never name a layout: they go through the registry
(rlx/checkpoints/registry.py), which dispatches on `rlx.json`'s `layout`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Protocol

import torch

from rlx.checkpoints.meta import CheckpointMeta
from rlx.errors import UserError


@dataclass
class LocalState:
    """One process's own part of a model's state, in the form its training backend holds it."""

    kind: str
    """What the tensors are: 'dtensor' (FSDP2 DTensor shards with Hugging Face names, or whole tensors when
    unsharded) or 'megatron' (a tensor x pipeline rank's megatron-core state)."""
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor] | None = None
    """Optimizer tensors keyed '<param name>::<state key>'."""
    coords: dict[str, int] = field(default_factory=dict)
    """Where this process stands in the backend's grid (megatron: tp_rank, pp_rank, dp_rank)."""


class TrainedState(Protocol):
    """What a training backend hands a layout to write (every process of the launch calls `write` together).
    A state may also offer `snapshot_state() -> (weights, optimizer)`: the same tensors as host copies that the
    next updates leave alone, possibly still copying off the device (rlx.utils.host_copy); layouts that write in
    the background use it."""

    @property
    def is_main(self) -> bool:
        """Whether this process writes the shared files (rank 0)."""

    @property
    def world(self) -> int:
        """Processes taking part."""

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Unsharded weights with Hugging Face names on the main process ({} elsewhere); a collective."""

    def full_optimizer_state(self) -> dict[str, torch.Tensor] | None:
        """Unsharded optimizer tensors keyed '<param>::<state key>' on the main process; a collective."""

    def local_state(self) -> LocalState:
        """This process's own shards."""


@dataclass
class CheckpointPart:
    """One model of a checkpoint folder (the folder itself, or a nested one such as 'critic/')."""

    state: TrainedState
    aux: dict[str, bytes]
    meta: CheckpointMeta


@dataclass
class ShardOptions:
    """`rlx shard` options that shape a layout (only some layouts take them)."""

    tp_degree: int | None = None
    pp_degree: int | None = None


class Layout(ABC):
    """A way to lay weights out in a checkpoint folder. Subclasses set the class attributes and implement
    the abstract methods; `register_layout(instance)` makes them known to every command."""

    name: ClassVar[str]
    """The name in rlx.json and `rlx shard --layout`."""
    backend: ClassVar[str] = "fsdp"
    """The training backend that trains a checkpoint of this layout in place."""
    shard_options: ClassVar[tuple[str, ...]] = ()
    """The `rlx shard` options (ShardOptions fields) this layout takes."""
    is_hf_dir: ClassVar[bool] = False
    """Whether the folder is also a loadable Hugging Face model dir (weights in model.safetensors)."""
    writes_shards: ClassVar[bool] = False
    """Whether every rank writes its own shards (no gather onto one rank): what `rlx ppo` saves under a launcher."""
    reads_shards: ClassVar[bool] = False
    """Whether a sharded trainer's ranks can each read their own shards of the weights and optimizer state
    (`read_shards`), so that no rank reads the whole checkpoint on `--resume`."""

    # --- metadata and options ---------------------------------------------------------------------

    def shard_fields(self, options: ShardOptions) -> dict:
        """Extra rlx.json fields for `rlx shard` options (only those in `shard_options` are ever given)."""
        return {}

    def check_meta(self, meta: CheckpointMeta, path: Path) -> None:
        """Raise a UserError when rlx.json lacks what this layout needs."""
        return None  # nothing to check by default

    def check_output(self, out: str) -> None:
        """Raise a UserError when this layout cannot be written to `out` (e.g. a URL)."""
        return None  # nothing to check by default

    def check_model(self, config, fields: dict, where: str) -> None:
        """Raise a UserError when the model of `config` (its transformers config) cannot take this layout with
        these rlx.json `fields`; called before the weights are read."""
        return None  # every model fits by default

    def prepare_files(self, config, aux: dict[str, bytes]) -> tuple[object, dict[str, bytes]]:
        """(config, aux) as this layout stores them (e.g. with the architecture named)."""
        return config, aux

    def check_complete(self, folder: Path) -> None:
        """Raise a UserError when a file of the checkpoint is missing (before any collective starts)."""
        return None  # nothing to check by default

    def check_optimizer(self, folder: Path, meta: CheckpointMeta) -> None:
        """Raise a UserError when rlx.json says optimizer state is stored (meta.optimizer) and it is not there: a
        train step would otherwise start AdamW over without a word (e.g. a copy that skipped the largest file)."""
        return None  # nothing to check by default

    # --- reading ----------------------------------------------------------------------------------

    @abstractmethod
    def read_full_weights(self, folder: Path, config=None) -> dict[str, torch.Tensor]:
        """All weights, unsharded, with Hugging Face names and their stored dtypes (`config`: the folder's
        config where the caller has read it)."""

    def read_full_optimizer(self, folder: Path) -> dict[str, torch.Tensor] | None:
        """Unsharded optimizer tensors keyed '<param>::<state key>' (Hugging Face names), or None."""
        return None

    def read_shards(self, folder: Path, part: str, shards: Callable[[], dict[str, torch.Tensor]]) -> None:
        """Fill a sharded trainer's tensors of `part` ('model': weights, 'optim': AdamW state keyed '<param>::<state
        key>') from the checkpoint, each rank reading only its own shards: `shards()` gives this rank's tensors, filled
        in place. Only layouts that `reads_shards` can; the others are read whole (read_full_*)."""
        raise UserError(f"{folder}: the '{self.name}' layout stores no shards a rank reads alone")

    def read_lora(self, folder: Path):
        """The adapters a checkpoint holds on a base model it points to (a LoraCheckpoint, lora.py), or None for a
        checkpoint of full weights."""
        return None  # full weights by default

    def read_local_state(self, folder: Path, kind: str, coords: dict[str, int]) -> LocalState:
        """One process's shards in a backend's own form (`kind`), resharded when the grid differs."""
        raise UserError(f"{folder}: the '{self.name}' layout stores no '{kind}' shards")

    # --- writing ----------------------------------------------------------------------------------

    @abstractmethod
    def write_full(self, out: str, weights: dict[str, torch.Tensor], aux: dict[str, bytes], meta: CheckpointMeta,
                   config, overwrite: bool) -> None:  # fmt: skip
        """Write a checkpoint from full Hugging Face weights, in one process (`rlx shard`)."""

    @abstractmethod
    def write(self, out: str, parts: dict[str, CheckpointPart], overwrite: bool,
              before_publish: Callable[[], None] | None = None) -> None:  # fmt: skip
        """Write a trained model (parts[""]) and nested ones (parts["critic"], ...) atomically; collective.
        `before_publish()` runs on the main process once every file is written, before the folder appears."""

    def host_buffers(self, states: dict) -> list[tuple[dict, str]]:
        """What `prepare_write` will copy into pinned host buffers for these trained states ({part name: state}, ""
        for the trained model): [(shapes and dtypes, tag)] for `rlx.utils.host_copy.reserve` to pin ahead of the
        first checkpoint; empty when the layout copies nothing there."""
        return []

    def prepare_write(self, out: str, parts: dict[str, CheckpointPart], overwrite: bool,
                      before_publish: Callable[[], None] | None = None) -> Callable[[], None]:  # fmt: skip
        """The collective part of `write` now (every process), and the rest as a function that touches only files
        and may run in the background (on the main process; a no-op elsewhere). By default everything runs now."""
        self.write(out, parts, overwrite, before_publish)
        return lambda: None
