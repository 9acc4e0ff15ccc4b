"""CPU offload on one GPU: `rlx ppo` as one torchrun process with train.param_offload (FSDP over one rank, its
float32 state on the CPU) and the native engine, whose replica is gathered from the offloaded shards. The engine
once moved the sharded model onto the GPU, which FSDP then refused at the first forward."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_one_launched_process_offloads_and_rolls_out_natively(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "-m", "rlx", "ppo",
           str(REPO / "recipes" / "quickstart.toml"), "--out", str(out), "--set", "steps=2",
           "--set", "train.param_offload=true", "--set", "rollout.engine='native'"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
