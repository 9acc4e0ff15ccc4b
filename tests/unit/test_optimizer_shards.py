"""A checkpoint's optimizer state read into the running optimizer's own tensors, shard by shard (the 'fsdp' layout):
what `--resume` under a launcher does on every rank instead of reading the full state (tests/distributed/test_scale.py
resumes through it at two ranks, bit for bit). Here in one process, the DCP files as save_dcp writes them."""

from __future__ import annotations

import pytest
import torch

from rlx.checkpoints.fsdp import save_dcp
from rlx.checkpoints.meta import CheckpointMeta
from rlx.checkpoints.registry import read_optimizer_shards
from rlx.errors import UserError
from rlx.training.optim import sharded_optimizer_state


def trained(seed: int, width: int = 4) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(5, width)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def write(folder, model, optimizer) -> None:
    state = sharded_optimizer_state(model, optimizer) if optimizer is not None else None
    meta = CheckpointMeta(layout="fsdp", step=2)
    save_dcp(folder, dict(model.state_dict()), state, {}, meta, is_main=True)


def test_the_state_is_read_into_the_optimizers_own_tensors(tmp_path):
    model, optimizer = trained(0)
    write(tmp_path / "ckpt", model, optimizer)
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    fresh.load_state_dict(model.state_dict())
    resumed = torch.optim.AdamW(fresh.parameters(), lr=0.1)  # no step yet: no state
    assert read_optimizer_shards(tmp_path / "ckpt", lambda: sharded_optimizer_state(fresh, resumed))
    saved, read = sharded_optimizer_state(model, optimizer), sharded_optimizer_state(fresh, resumed)
    assert saved.keys() == read.keys() and len(saved) == 12  # 4 parameters x (step, exp_avg, exp_avg_sq)
    for key in saved:
        assert read[key].equal(saved[key]), key
    for module in (model, fresh):  # and the next step goes the same way
        module(torch.ones(5, 4)).sum().backward()
    optimizer.step(), resumed.step()
    assert all(a.equal(b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True))


def test_no_stored_state_leaves_the_optimizer_alone_and_a_mismatch_is_named(tmp_path):
    model, optimizer = trained(1)
    write(tmp_path / "weights-only", model, None)
    untouched = torch.optim.AdamW(model.parameters())
    assert read_optimizer_shards(tmp_path / "weights-only", lambda: pytest.fail("no state to read into"))
    assert not untouched.state  # no zero step taken: AdamW's bias correction counts steps
    write(tmp_path / "ckpt", model, optimizer)
    other = torch.nn.Sequential(torch.nn.Linear(4, 3))  # the second layer's state has no parameter here
    with pytest.raises(UserError, match=r"ckpt: optimizer state for unknown parameter '1\.(bias|weight)'"):
        read_optimizer_shards(
            tmp_path / "ckpt", lambda: sharded_optimizer_state(other, torch.optim.AdamW(other.parameters()))
        )
    assert not read_optimizer_shards(tmp_path, lambda: pytest.fail("not a checkpoint"))  # a plain folder
