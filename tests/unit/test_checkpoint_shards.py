"""A checkpoint's weights and optimizer state read into the running model's and optimizer's own tensors, shard by
shard (the 'fsdp' layout): what `--resume` under a launcher does on every rank instead of reading the whole
checkpoint (tests/distributed/test_scale.py resumes through it at two ranks, bit for bit). Here in one process, the DCP
files as save_dcp writes them."""

from __future__ import annotations

import pytest
import torch

from rlx.checkpoints.fsdp import save_dcp
from rlx.checkpoints.meta import CheckpointMeta
from rlx.checkpoints.registry import read_shards, reads_shards
from rlx.errors import UserError
from rlx.training.optim import sharded_optimizer_state


def net(width: int = 4, layers: int = 2) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(width, 3), *[torch.nn.Linear(3, 3) for _ in range(layers - 2)],
                               torch.nn.Linear(3, 2))  # fmt: skip


def trained(seed: int) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(5, 4)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def write(folder, model, optimizer) -> None:
    state = sharded_optimizer_state(model, optimizer) if optimizer is not None else None
    save_dcp(folder, dict(model.state_dict()), state, {}, CheckpointMeta(layout="fsdp", step=2), is_main=True)


def test_weights_and_state_are_read_into_the_live_tensors(tmp_path):
    model, optimizer = trained(0)
    write(tmp_path / "ckpt", model, optimizer)
    assert reads_shards(tmp_path / "ckpt") and not reads_shards(tmp_path)  # a plain folder: read whole
    torch.manual_seed(1)
    fresh = net()
    resumed = torch.optim.AdamW(fresh.parameters(), lr=0.1)  # no step yet: no state
    read_shards(tmp_path / "ckpt", "model", lambda: dict(fresh.state_dict()))
    read_shards(tmp_path / "ckpt", "optim", lambda: sharded_optimizer_state(fresh, resumed))
    assert all(a.equal(b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True))
    saved, read = sharded_optimizer_state(model, optimizer), sharded_optimizer_state(fresh, resumed)
    assert saved.keys() == read.keys() and len(saved) == 12  # 4 parameters x (step, exp_avg, exp_avg_sq)
    assert all(read[key].equal(saved[key]) for key in saved)
    for module in (model, fresh):  # and the next step goes the same way
        module(torch.ones(5, 4)).sum().backward()
    optimizer.step(), resumed.step()
    assert all(a.equal(b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True))


def test_no_stored_state_leaves_the_optimizer_alone_and_mismatches_are_named(tmp_path):
    model, optimizer = trained(1)
    write(tmp_path / "weights-only", model, None)
    untouched = torch.optim.AdamW(model.parameters())
    read_shards(tmp_path / "weights-only", "optim", lambda: pytest.fail("no state to read into"))
    assert not untouched.state  # no zero step taken: AdamW's bias correction counts steps
    write(tmp_path / "ckpt", model, optimizer)
    deeper = net(layers=3)  # '1' is 3 x 3 here, 2 x 3 stored; '2' is not stored
    shape = r"ckpt: tensor 1.bias has shape \(2,\), the config expects \(3,\) \(and 3 more\)"
    with pytest.raises(UserError, match=shape):
        read_shards(tmp_path / "ckpt", "model", lambda: dict(deeper.state_dict()))
    with pytest.raises(UserError, match=r"ckpt: no optimizer state for parameter '2\.bias'"):
        read_shards(
            tmp_path / "ckpt", "optim", lambda: sharded_optimizer_state(deeper, torch.optim.AdamW(deeper.parameters()))
        )
    shallow = torch.nn.Sequential(torch.nn.Linear(4, 3))
    with pytest.raises(UserError, match=r"ckpt: the checkpoint holds '1.bias' \(model\), which the model has not"):
        read_shards(tmp_path / "ckpt", "model", lambda: dict(shallow.state_dict()))
