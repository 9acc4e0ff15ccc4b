"""rlx ppo at scale, on the CPU with gloo: under a launcher every rank writes its own shards of each checkpoint (the
'fsdp' layout) in the background, and --resume from them gives the weights of an uninterrupted run bit for bit;
two torchrun agents (two "nodes" on this host, rendezvous on localhost) give the run of one node with two ranks."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from rlx.checkpoints.registry import read_full_optimizer, read_full_weights
from tests.conftest import REPO, torchrun

RECIPE = REPO / "recipes" / "quickstart.toml"
SMALL = ["--set", "data.prompts_per_step=6", "--set", "rollout.n=4", "--set", "save_every=1"]


def rewards(run: Path) -> list[float]:
    return [json.loads(line)["reward/mean"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_two_ranks_write_their_own_shards_in_the_background_and_resume_bit_exactly(tmp_path):
    torchrun(2, "ppo", RECIPE, "--out", tmp_path / "whole", "--set", "steps=2", *SMALL)
    torchrun(2, "ppo", RECIPE, "--out", tmp_path / "split", "--set", "steps=1", *SMALL)
    torchrun(2, "ppo", RECIPE, "--out", tmp_path / "split", "--set", "steps=2", *SMALL, "--resume")
    final = Path("checkpoints") / "step_000002"
    folder = tmp_path / "whole" / final
    assert json.loads((folder / "rlx.json").read_text())["layout"] == "fsdp"
    assert sorted(p.name for p in (folder / "dcp").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (folder / "model.safetensors").exists()
    assert (folder / "config.json").is_file()  # config and tokenizer beside the shards, as in every layout
    for read in (read_full_weights, read_full_optimizer):
        whole, split = read(folder), read(tmp_path / "split" / final)
        assert whole.keys() == split.keys() and len(whole) > 0
        for key in whole:
            assert whole[key].equal(split[key]), key
    assert rewards(tmp_path / "whole") == rewards(tmp_path / "split")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_of_one_rank_equal_one_node_of_two(tmp_path):
    """`torchrun --nnodes 2 --nproc_per_node 1` twice (node ranks 0 and 1, static rendezvous on 127.0.0.1) runs the
    same ranks as `--nproc_per_node 2`: the same rewards and final weights."""
    args = ["-m", "rlx", "ppo", str(RECIPE), "--set", "steps=2", *SMALL]
    torchrun(2, *args[2:], "--out", tmp_path / "one")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    port = free_port()
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
              "--master_addr=127.0.0.1", f"--master_port={port}"]  # fmt: skip
    out = str(tmp_path / "two")
    nodes = [
        subprocess.Popen(
            [*launch, f"--node_rank={rank}", *args, "--out", out],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for rank in (0, 1)
    ]
    logs = [node.communicate(timeout=300)[0] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), [log[-3000:] for log in logs]
    final = Path("checkpoints") / "step_000002"
    one, two = read_full_weights(tmp_path / "one" / final), read_full_weights(tmp_path / "two" / final)
    assert all(one[k].equal(two[k]) for k in one)
    assert rewards(tmp_path / "one") == rewards(tmp_path / "two")
