"""Remote paths (fsspec URLs) through the commands: models, prompts, rollouts, batches and checkpoints
read from and written to fsspec's memory file system and file:// URLs, atomically."""

from __future__ import annotations

import fsspec
import pytest
import torch

from rlx.models.loading import read_weights
from tests.conftest import cli, cli_ok


@pytest.fixture
def memfs():
    fs = fsspec.filesystem("memory")
    fs.store.clear()
    fs.pseudo_dirs.clear()
    fs.pseudo_dirs.append("")
    yield fs
    fs.store.clear()


def test_a_whole_step_through_memory_urls(tmp_path, tiny_dir, prompts_file, memfs, monkeypatch):
    monkeypatch.setenv("RLX_CACHE", str(tmp_path / "cache"))
    memfs.pipe("/data/prompts.jsonl", prompts_file.read_bytes())
    cli_ok("shard", "--model", tiny_dir, "--init", "random", "--out", "memory://ckpt/step0")
    assert memfs.exists("/ckpt/step0/rlx.json") and memfs.exists("/ckpt/step0/model.safetensors")
    cli_ok(
        "rollout",
        "--model",
        "memory://ckpt/step0",
        "--prompts",
        "memory://data/prompts.jsonl",
        "--out",
        "memory://run/rollouts.jsonl",
        "--n",
        "2",
        "--num-prompts",
        "3",
        "--max-new-tokens",
        "3",
    )
    assert len(memfs.cat("/run/rollouts.jsonl").decode().splitlines()) == 6
    cli_ok(
        "score",
        "--rollouts",
        "memory://run/rollouts.jsonl",
        "--actor",
        "memory://ckpt/step0",
        "--reward",
        "arith",
        "--out",
        "memory://run/step1",
        "--metrics",
        "memory://run/metrics.jsonl",
    )
    cli_ok(
        "train-step",
        "--checkpoint",
        "memory://ckpt/step0",
        "--batch",
        "memory://run/step1/batch.safetensors",
        "--out",
        "memory://ckpt/step1",
        "--lr",
        "1e-2",
        "--metrics",
        "memory://run/metrics.jsonl",
    )
    assert len(memfs.cat("/run/metrics.jsonl").decode().splitlines()) == 2
    local = tmp_path / "hf"
    cli_ok("merge", "--checkpoint", "memory://ckpt/step1", "--out", f"file://{local}")
    trained = read_weights(local)
    cli_ok("merge", "--checkpoint", "memory://ckpt/step0", "--out", str(tmp_path / "hf0"))
    assert any(not torch.equal(trained[k], read_weights(tmp_path / "hf0")[k]) for k in trained)
    # a checkpoint overwritten at the same URL is not served stale from the download cache
    cli_ok(
        "train-step",
        "--checkpoint",
        "memory://ckpt/step1",
        "--batch",
        "memory://run/step1/batch.safetensors",
        "--out",
        "memory://ckpt/step1",
        "--overwrite",
        "--lr",
        "1e-2",
    )
    cli_ok("merge", "--checkpoint", "memory://ckpt/step1", "--out", str(tmp_path / "hf2"))
    assert any(not torch.equal(trained[k], read_weights(tmp_path / "hf2")[k]) for k in trained)
    downloads = tmp_path / "cache" / "remote"  # under $RLX_CACHE as the compile caches are (compile/), not at its top
    assert any(downloads.iterdir()) and {p.name for p in (tmp_path / "cache").iterdir()} <= {"remote", "compile"}


def test_remote_errors_and_no_partial_outputs(tmp_path, tiny_ckpt, memfs, monkeypatch):
    monkeypatch.setenv("RLX_CACHE", str(tmp_path / "cache"))
    memfs.pipe("/p.jsonl", b'{"prompt": "1+1="}\n')
    result = cli("rollout", "--model", "memory://nope", "--prompts", "memory://p.jsonl", "--out", "memory://r.jsonl")
    assert result.exit_code == 1 and "memory://nope" in result.stderr and not memfs.exists("/r.jsonl")
    memfs.pipe("/bad.jsonl", b'{"prompt": "1+1="}\n{oops\n')
    result = cli("rollout", "--model", tiny_ckpt, "--prompts", "memory://bad.jsonl", "--out", "memory://r.jsonl")
    assert result.exit_code == 1 and "memory://bad.jsonl:2" in result.stderr and not memfs.exists("/r.jsonl")
    cli_ok("merge", "--checkpoint", tiny_ckpt, "--out", "memory://out/hf")
    result = cli("merge", "--checkpoint", tiny_ckpt, "--out", "memory://out/hf")
    assert result.exit_code == 1 and "already exists" in result.stderr
