"""The 'fsdp' layout's pinned host buffers, reserved ahead of the first checkpoint (rlx.ppo.loop pins them on the
writer thread after the first step): what `FsdpLayout.host_buffers` reserves is exactly what the save then copies
into (same tags, names, local shapes and dtypes), so the save's step pins nothing itself. On the CPU no buffer is
pinned (only CUDA tensors are), so the check records the buffers asked for instead."""

from __future__ import annotations

import torch

import rlx.checkpoints.fsdp as fsdp
from rlx.checkpoints.base import CheckpointPart, LocalState
from rlx.checkpoints.meta import CheckpointMeta


class State:
    """A trained state as the FSDP backend gives it (whole tensors stand for a lone process's shards)."""

    is_main = True

    def __init__(self, scale: int):
        self.weights = {"a.weight": torch.ones(4 * scale, 3), "b.bias": torch.zeros(scale)}
        self.optimizer = {"a.weight::exp_avg": torch.ones(4 * scale, 3), "a.weight::step": torch.tensor(1.0)}

    def local_state(self) -> LocalState:
        return LocalState("dtensor", self.weights, self.optimizer)


def test_reserved_buffers_are_the_ones_the_save_copies_into(tmp_path, monkeypatch):
    every = lambda tensors: {k: (v.shape, v.dtype) for k, v in tensors.items()}  # noqa: E731 - CPU tensors count too
    monkeypatch.setattr(fsdp, "layout", every)
    states = {"": State(1), "critic": State(2)}
    reserved = fsdp.FsdpLayout().host_buffers(states)
    copied = []
    monkeypatch.setattr(fsdp, "snapshot", lambda tensors, tag: copied.append((every(tensors), tag)) or tensors)
    parts = {name: CheckpointPart(state, {}, CheckpointMeta(step=1, layout="fsdp")) for name, state in states.items()}
    write = fsdp.prepare_dcp_write(str(tmp_path / "ckpt"), parts, overwrite=False)
    assert sorted(copied, key=lambda x: x[1]) == sorted(reserved, key=lambda x: x[1])
    assert {tag for _, tag in reserved} == {f"fsdp/{n}/{k}" for n in ("model", "critic") for k in ("weights", "optim")}
    write()
    assert (tmp_path / "ckpt" / "dcp" / ".metadata").is_file() and (tmp_path / "ckpt" / "critic" / "dcp").is_dir()
