"""The 'lora' layout: low-rank adapters and their optimizer state, on top of a base model the checkpoint points to.

    CKPT/
      rlx.json, config.json, tokenizer...   as in the 'single' layout (layout = "lora"; the base's config)
      lora.json                 the adapters' settings and the base: where it comes from, its identity
      adapter.safetensors       the trained tensors by stable name, float32: each adapted layer's lora_A [rank, in]
                                and lora_B [out, rank] ('model.layers.0.self_attn.q_proj.lora_A.weight'), a critic's
                                value head ('score.weight') too
      optimizer.safetensors     AdamW state of those tensors, '<name>::<state key>' (after a train step)
      critic/                   a nested critic (`rlx ppo`), in the 'lora' or the 'single' layout

Its size is proportional to the rank, not to the model. Reading one rebuilds the base, checks its identity and puts
the adapters in (PEFT's layers, rlx.models.lora). `read_full_weights` gives the merged weights (W + alpha/r B A), so
every command that reads full weights (merge, rollout, score, eval) takes a LoRA checkpoint unchanged; the training
backend, scoring and the rollout engines that apply adapters ask the registry's `read_lora` for the adapters instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from rlx.checkpoints.base import CheckpointPart, Layout
from rlx.checkpoints.files import read_optimizer_state, write_aux, write_optimizer_state
from rlx.checkpoints.lora_base import LORA_FILE, LoraSpec, load_base, read_lora_json, write_lora_json
from rlx.checkpoints.meta import CheckpointMeta
from rlx.checkpoints.single import folder_commit, write_files
from rlx.errors import UserError
from rlx.models.loading import read_safetensors
from rlx.models.lora import apply_lora, hf_name
from rlx.models.lora_merge import merged_weights
from rlx.models.lora_state import load_adapter_state
from rlx.utils.files import apply_umask
from rlx.utils.host_copy import snapshot

ADAPTER_FILE = "adapter.safetensors"


@dataclass
class LoraCheckpoint:
    """The adapters of a 'lora' checkpoint folder (read on demand: the base is loaded only by `build_model`)."""

    folder: Path
    spec: LoraSpec

    def tensors(self) -> dict[str, torch.Tensor]:
        """The adapter tensors by stable name, float32."""
        return read_safetensors(self.folder / ADAPTER_FILE)

    def optimizer(self) -> dict[str, torch.Tensor] | None:
        """AdamW state of the adapters ('<name>::<state key>'), or None before the first train step."""
        return read_optimizer_state(self.folder)

    def build_model(self, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        """The base (identity checked) with the adapters in: base weights frozen in `dtype`, adapters float32."""
        model = load_base(self.spec.base, self.spec.role, str(self.folder))
        apply_lora(model, self.spec.config, dtype)
        load_adapter_state(model, self.tensors(), str(self.folder / ADAPTER_FILE))
        return model

    def has_zero_delta(self) -> bool:
        """Whether every adapter's B A is zero (a step-0 checkpoint with B initialised to 0): then the checkpoint
        computes exactly what its base does."""
        tensors = self.tensors()
        for name, a in tensors.items():
            if name.endswith(".lora_A.weight"):
                b = tensors[name.replace(".lora_A.", ".lora_B.")]
                if bool(a.any()) and bool(b.any()):
                    return False
        return not any(".lora_" not in name for name in tensors)  # a trained head is no base either


def read_lora(folder: str | Path) -> LoraCheckpoint:
    """The LoraCheckpoint of a 'lora' checkpoint folder."""
    folder = Path(folder)
    return LoraCheckpoint(folder, read_lora_json(folder))


def write_lora_files(folder: Path, spec: LoraSpec, aux: dict[str, bytes], tensors: dict, optimizer: dict | None,
                     meta: CheckpointMeta) -> None:  # fmt: skip
    """A 'lora' checkpoint's files into an existing (temporary) folder, rlx.json last."""
    write_aux(folder, aux)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / ADAPTER_FILE), metadata={"format": "pt"})
    apply_umask(folder / ADAPTER_FILE)
    if optimizer:  # by the adapters' stable names, as adapter.safetensors
        write_optimizer_state(folder, {_stable(k): v for k, v in optimizer.items()})
    write_lora_json(folder, spec)
    meta.write(folder)


def _stable(key: str) -> str:
    """An optimizer key '<param>::<state key>' with the parameter's stable name."""
    name, sep, field = key.rpartition("::")
    return f"{hf_name(name)}{sep}{field}"


class LoraLayout(Layout):
    name = "lora"

    def check_complete(self, folder: Path) -> None:
        for name in (LORA_FILE, ADAPTER_FILE):
            if not (Path(folder) / name).is_file():
                raise UserError(f"{folder}: LoRA checkpoint without {name}")

    def read_full_weights(self, folder: Path, config=None) -> dict[str, torch.Tensor]:
        return merged_weights(read_lora(folder).build_model())

    def read_lora(self, folder: Path) -> LoraCheckpoint:
        self.check_complete(folder)
        return read_lora(folder)

    def write_full(self, out, weights, aux, meta, config, overwrite) -> None:
        raise UserError(f"{out}: a LoRA checkpoint is made from adapters: rlx shard --lora-rank N (or --layout lora)")

    def write(
        self, out: str, parts: dict[str, CheckpointPart], overwrite: bool, before_publish: Callable | None = None
    ) -> None:
        self.prepare_write(out, parts, overwrite, before_publish)()

    def prepare_write(
        self, out: str, parts: dict[str, CheckpointPart], overwrite: bool, before_publish: Callable | None = None
    ) -> Callable[[], None]:
        """LoRA parts as adapters, others (a critic trained in full beside a LoRA actor) as 'single' folders: the
        tensors are gathered and copied now (a collective), the returned function writes the folder (main process)."""
        gathered = {name: _gather(name, part, self.name) for name, part in parts.items()}  # collectives, in order
        if not parts[""].state.is_main:
            return lambda: None

        def write_part(folder: Path, part: CheckpointPart, tensors: dict, optimizer: dict | None) -> None:
            if part.meta.layout == self.name:
                write_lora_files(folder, part.state.lora, part.aux, tensors, optimizer, part.meta)
            else:
                write_files(folder, tensors, part.aux, part.meta, optimizer)

        return folder_commit(out, parts, gathered, overwrite, before_publish, write_part)


def _gather(name: str, part: CheckpointPart, lora_layout: str) -> tuple[dict, dict | None]:
    """(weights or adapter tensors, optimizer tensors) of a part, gathered on the main process (a collective)."""
    if part.meta.layout == lora_layout:
        if getattr(part.state, "lora", None) is None:
            raise UserError(f"{name or 'the model'}: layout 'lora' needs a trainer with adapters")
        tensors, optimizer = part.state.adapter_state(), part.state.full_optimizer_state()
    elif part.meta.layout != "single":
        raise UserError(f"{name}: a LoRA checkpoint nests 'lora' or 'single' models, not '{part.meta.layout}'")
    else:
        tensors, optimizer = part.state.full_weights(), part.state.full_optimizer_state()
    # copies that the next updates leave alone (the files may be written in the background)
    tag = f"lora/{name}"
    return snapshot(tensors, tag + "/weights"), None if optimizer is None else snapshot(optimizer, tag + "/optim")
