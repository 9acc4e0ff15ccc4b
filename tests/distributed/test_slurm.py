"""recipes/slurm/ppo.sbatch in dry-run mode with fake SLURM variables: the torchrun line it would launch,
the first node as rendezvous host, --resume for a run folder that holds a run."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "recipes" / "slurm" / "ppo.sbatch"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def fake_bin(tmp_path: Path, with_scontrol: bool) -> Path:
    """A PATH folder with the few tools the script uses, and (optionally) an scontrol that expands the list."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for tool in ("basename", "dirname", "sed", "head", "hostname", "mkdir"):
        (folder / tool).symlink_to(shutil.which(tool))
    if with_scontrol:
        scontrol = folder / "scontrol"
        scontrol.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] || exit 2\necho node-a17\necho node-a18\n')
        scontrol.chmod(0o755)
    return folder


def dry_run(tmp_path: Path, with_scontrol: bool = True, **env: str) -> tuple[str, list[str]]:
    base = {
        "PATH": str(fake_bin(tmp_path, with_scontrol)),
        "RLX_DRY_RUN": "1",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "node-a[17-18]",
        "SLURM_JOB_ID": "4242",
        "SLURM_GPUS_ON_NODE": "4",
        "RECIPE": "recipes/smollm2_arith.toml",
        "RUN_DIR": str(tmp_path / "runs" / "smollm2"),
    }
    out = subprocess.run(
        [shutil.which("bash"), str(SCRIPT)],
        env={**base, **env},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    first, command = out.strip().splitlines()
    return first, shlex.split(command)


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_dry_run_prints_the_multi_node_torchrun_line(tmp_path):
    exports, argv = dry_run(tmp_path)
    assert exports == "export MASTER_ADDR=node-a17 MASTER_PORT=29500"
    assert argv[0] == "srun" and option(argv, "--ntasks-per-node") == "1"
    torchrun = argv[argv.index("torchrun") :]
    assert option(torchrun, "--nnodes") == "2" and option(torchrun, "--nproc_per_node") == "4"
    assert option(torchrun, "--rdzv_backend") == "c10d"
    assert option(torchrun, "--rdzv_endpoint") == "node-a17:29500"
    assert option(torchrun, "--rdzv_id") == "4242"
    assert torchrun[torchrun.index("-m") :] == [
        "-m",
        "rlx",
        "ppo",
        "recipes/smollm2_arith.toml",
        "--out",
        str(tmp_path / "runs" / "smollm2"),
    ]
    assert not (tmp_path / "runs").exists()  # a dry run creates nothing


def test_a_run_folder_with_a_run_is_resumed_and_extra_args_follow(tmp_path):
    run = tmp_path / "runs" / "smollm2"
    run.mkdir(parents=True)
    (run / "recipe.json").write_text("{}")
    _, argv = dry_run(
        tmp_path, GPUS_PER_NODE="8", MASTER_PORT="31337", EXTRA_ARGS="--set train.optim.lr=1e-6  --set steps=200"
    )
    assert option(argv, "--nproc_per_node") == "8" and option(argv, "--rdzv_endpoint") == "node-a17:31337"
    assert argv[argv.index("--out") :] == [
        "--out",
        str(run),
        "--resume",
        "--set",
        "train.optim.lr=1e-6",
        "--set",
        "steps=200",
    ]


def test_the_network_interface_reaches_nccl_and_gloo(tmp_path):
    """NET_IFNAME names the interface of both NCCL's bootstrap and the checkpoint writers' gloo group."""
    exports, _ = dry_run(tmp_path, NET_IFNAME="ib0")
    assert exports == "export MASTER_ADDR=node-a17 MASTER_PORT=29500 NCCL_SOCKET_IFNAME=ib0 GLOO_SOCKET_IFNAME=ib0"


def test_defaults_without_scontrol_or_run_dir(tmp_path):
    exports, argv = dry_run(tmp_path, with_scontrol=False, RUN_DIR="", SLURM_GPUS_ON_NODE="")
    assert exports.startswith("export MASTER_ADDR=node-a17 ")  # first node read from the list itself
    assert option(argv, "--out") == "runs/smollm2_arith" and "--resume" not in argv
    assert option(argv, "--nproc_per_node") == "8"


def test_recipe_is_required(tmp_path):
    env = {"PATH": str(fake_bin(tmp_path, True)), "RLX_DRY_RUN": "1"}
    out = subprocess.run([shutil.which("bash"), str(SCRIPT)], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "set RECIPE" in out.stderr


def test_sbatch_headers():
    headers = [line.split()[1] for line in SCRIPT.read_text().splitlines() if line.startswith("#SBATCH")]
    for name in ("--nodes", "--ntasks-per-node=1", "--gpus-per-node", "--cpus-per-task", "--time", "--output"):
        assert any(h.startswith(name) for h in headers), name
    assert os.access(SCRIPT, os.X_OK)
