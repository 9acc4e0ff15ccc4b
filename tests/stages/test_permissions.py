"""Outputs honour the umask (issue 19, bug 4): atomic writes must not leave files 0600 and folders 0700.
Every command's outputs are checked under umask 022 and 077: checkpoints of each layout, rollouts, scores,
batch, merged models, a `rlx ppo` run dir (recipe.json, metrics, steps, checkpoints) and its report."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_ok, rollout_args

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")


@pytest.fixture
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def modes(root: Path) -> dict[str, tuple[bool, int]]:
    """Every file and folder under root (root included): (is_dir, permission bits)."""
    out = {".": (True, stat.S_IMODE(root.stat().st_mode))}
    for path in root.rglob("*"):
        out[str(path.relative_to(root))] = (path.is_dir(), stat.S_IMODE(path.stat().st_mode))
    return out


def assert_umask_modes(root: Path, umask: int) -> int:
    """Files are 0666 & ~umask, folders 0777 & ~umask; returns how many paths were checked."""
    wrong = {
        name: oct(mode) for name, (is_dir, mode) in modes(root).items() if mode != (0o777 if is_dir else 0o666) & ~umask
    }
    assert not wrong, f"umask {umask:03o}: {wrong}"
    return len(modes(root))


@pytest.mark.parametrize("umask", [0o022, 0o077], indirect=True, ids=["umask022", "umask077"])
def test_every_command_honours_the_umask(tmp_path, tiny_dir, prompts_file, umask):
    out = tmp_path / "out"
    out.mkdir()
    cli_ok("shard", "--model", tiny_dir, "--init", "random", "--out", out / "ckpt")
    cli_ok("shard", "--model", out / "ckpt", "--layout", "fsdp", "--out", out / "fsdp")
    cli_ok("shard", "--model", out / "ckpt", "--layout", "megatron", "--tp", "2", "--out", out / "megatron")
    cli_ok(*rollout_args(out / "ckpt", prompts_file, out / "step1" / "rollouts.jsonl"))
    cli_ok("score", "--rollouts", out / "step1" / "rollouts.jsonl", "--actor", out / "ckpt", "--reward", "arith",
           "--out", out / "step1")  # fmt: skip
    batch = out / "step1" / "batch.safetensors"
    cli_ok("train-step", "--checkpoint", out / "ckpt", "--batch", batch, "--out", out / "ckpt1",
           "--metrics", out / "metrics.jsonl")  # fmt: skip
    cli_ok("train-step", "--checkpoint", out / "fsdp", "--batch", batch, "--out", out / "fsdp1")
    cli_ok("merge", "--checkpoint", out / "megatron", "--out", out / "merged")
    sets = ["steps=2", "data.prompts_per_step=4", "rollout.sampling.n=2"]
    cli_ok("ppo", REPO / "recipes" / "quickstart.toml", "--out", out / "run", *[a for s in sets for a in ("--set", s)])
    cli_ok("report", out / "run")
    expected = ["ckpt/model.safetensors", "fsdp/dcp", "megatron/mp_rank_01_000/model.safetensors",
                "step1/scores.jsonl", "step1/batch.safetensors", "ckpt1/optimizer.safetensors", "metrics.jsonl",
                "fsdp1/rlx.json", "merged/config.json", "run/recipe.json", "run/metrics.jsonl",
                "run/step_000002/rollouts.jsonl", "run/checkpoints/step_000002/model.safetensors",
                "run/report/summary.md"]  # fmt: skip
    for name in expected:
        assert (out / name).exists(), name
    assert list((out / "run" / "report").glob("*.png"))
    assert assert_umask_modes(out, umask) > 50
