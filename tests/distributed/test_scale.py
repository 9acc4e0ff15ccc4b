"""rlx ppo at scale, on the CPU with gloo: under a launcher every rank writes its own shards of each checkpoint (the
'fsdp' layout) in the background, --resume from them continues bit for bit, and two torchrun agents (two "nodes" on
this host, rendezvous on localhost) run what one node with two ranks runs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rlx.checkpoints.registry import read_full_optimizer, read_full_weights
from tests.conftest import REPO, cli, cli_ok, torchrun

RECIPE = REPO / "recipes" / "quickstart.toml"
SMALL = ["--set", "data.prompts_per_step=6", "--set", "rollout.sampling.n=4", "--set", "save_every=1"]


def rewards(run: Path) -> list[float]:
    return [json.loads(line)["reward/mean"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_on_two_nodes(tmp_path: Path, out: Path, *args: str) -> None:
    """`rlx ppo ARGS` under two torchrun agents of one rank each (node ranks 0 and 1, rendezvous on 127.0.0.1)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
              "--master_addr=127.0.0.1", f"--master_port={free_port()}"]  # fmt: skip
    command = ["-m", "rlx", "ppo", str(RECIPE), "--out", str(out), *args]
    nodes = [
        subprocess.Popen(
            [*launch, f"--node_rank={rank}", *command],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for rank in (0, 1)
    ]
    logs = [node.communicate(timeout=400)[0] for node in nodes]
    assert all(node.returncode == 0 for node in nodes), [log[-3000:] for log in logs]


@pytest.mark.slow
def test_sharded_background_checkpoints_resume_bit_exactly_and_two_nodes_equal_one(tmp_path):
    """One node of two ranks runs a step, stops and resumes for the second; two nodes of one rank run both steps at
    once. Each checkpoint holds one DCP shard file per rank (the 'fsdp' layout, written by every rank on its writer
    thread) and no gathered copy; the final weights and AdamW state agree bit for bit, and so do the rewards."""
    torchrun(2, "ppo", RECIPE, "--out", tmp_path / "split", "--set", "steps=1", *SMALL)
    torchrun(2, "ppo", RECIPE, "--out", tmp_path / "split", "--set", "steps=2", *SMALL, "--resume")
    run_on_two_nodes(tmp_path, tmp_path / "nodes", "--set", "steps=2", *SMALL)
    final = Path("checkpoints") / "step_000002"
    folder = tmp_path / "nodes" / final
    assert json.loads((folder / "rlx.json").read_text())["layout"] == "fsdp"
    names = sorted(p.name for p in (folder / "dcp").iterdir())  # __<rank>_<writer thread>.distcp
    assert names[0] == ".metadata" and {name.split("_")[2] for name in names[1:]} == {"0", "1"}
    assert not (folder / "model.safetensors").exists()
    assert (folder / "config.json").is_file()  # config and tokenizer beside the shards, as in every layout
    for read in (read_full_weights, read_full_optimizer):
        nodes, split = read(folder), read(tmp_path / "split" / final)
        assert nodes.keys() == split.keys() and len(nodes) > 0
        for key in nodes:
            assert nodes[key].equal(split[key]), key
    assert rewards(tmp_path / "nodes") == rewards(tmp_path / "split")


def test_checkpoint_layout_in_one_process_and_a_bad_one(tmp_path):
    """checkpoint_layout = 'fsdp' in a lone process writes the DCP folder (no process group) that resumes; an
    unknown layout is refused naming the field."""
    sets = ["--set", "steps=1", "--set", "checkpoint_layout='fsdp'", *SMALL]
    cli_ok("ppo", RECIPE, "--out", tmp_path / "run", *sets)
    folder = tmp_path / "run" / "checkpoints" / "step_000001"
    names = sorted(p.name for p in (folder / "dcp").iterdir())  # __<rank>_<writer thread>.distcp
    assert names[0] == ".metadata" and {name.split("_")[2] for name in names[1:]} == {"0"}
    assert read_full_weights(folder) and read_full_optimizer(folder)
    cli_ok("ppo", RECIPE, "--out", tmp_path / "run", *sets, "--set", "steps=2", "--resume")
    assert len(rewards(tmp_path / "run")) == 2
    bad = cli("ppo", RECIPE, "--out", tmp_path / "bad", "--set", "checkpoint_layout='sharded'", *SMALL)
    assert bad.exit_code == 1 and "checkpoint_layout" in bad.stderr and "single, fsdp" in bad.stderr


@pytest.mark.slow
def test_a_fresh_start_fills_every_rank_from_rank_0_s_weights(tmp_path):
    """Under a launcher only rank 0 loads the policy; the other ranks build it (and the critic made from it)
    unfilled and take their shards (and the reference's whole copy) from rank 0's weights. At learning rate 0 the
    run's checkpoint after one step holds exactly the model folder's weights, in every shard of both ranks, the
    critic's backbone too, and the reference equals the policy (KL 0)."""
    from tests.conftest import save_tiny_hf

    model = save_tiny_hf(tmp_path / "hf", tie=False, seed=3)
    out = tmp_path / "run"
    torchrun(2, "ppo", RECIPE, "--out", out, "--set", "steps=1", *SMALL, "--set", f'model.path="{model}"',
             "--set", 'model.init="pretrained"', "--set", "use_ref=true", "--set", "train.optim.lr=0.0",
             "--set", "train.optim.weight_decay=0.0", "--set", "critic.train.optim.lr=0.0",
             "--set", "critic.train.optim.weight_decay=0.0")  # fmt: skip
    saved = read_full_weights(out / "checkpoints" / "step_000001")
    critic = read_full_weights(out / "checkpoints" / "step_000001" / "critic")
    from safetensors.torch import load_file

    original = load_file(model / "model.safetensors")
    assert saved.keys() == original.keys()
    for key, value in original.items():
        assert saved[key].equal(value), key
        assert key.startswith("lm_head") or critic[key].equal(value), key
    assert critic["score.weight"].abs().sum() > 0  # the seeded head, not zeros
    metrics = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert abs(metrics["actor/ref_kl"]) < 1e-6, metrics["actor/ref_kl"]
