"""bench/resume_check.py drives `rlx ppo` whole, stopped and resumed, and compares the final checkpoints (CPU)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_resume_check_finds_the_resumed_run_equal_to_the_whole_one(tmp_path):
    """In two phases (two device calls at 7B), each run's checkpoints removed once digested."""
    out = tmp_path / "resume.json"
    command = [sys.executable, str(REPO / "bench" / "resume_check.py"), "--shape", "small", "--cpu", "--gpus", "1",
               "--steps", "2", "--split", "1", "--num-prompts", "4", "--num-generations", "2", "--prompt-len", "16",
               "--response-len", "8", "--work", str(tmp_path / "work"), "--json", str(out)]  # fmt: skip
    for phase in ("full", "split"):
        done = subprocess.run([*command, "--phase", phase], capture_output=True, text=True, timeout=600, cwd=REPO)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert not (tmp_path / "work" / phase / "checkpoints").exists()  # digested, then removed
    result = json.loads(out.read_text())["resumed_vs_full"]
    assert result["checkpoint"] == "step_000002" and result["tensors"] > 10  # weights and AdamW moments
    assert result["differ"] == 0 and result["rewards_equal"], result
    metrics = (tmp_path / "work" / "split" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in metrics] == [1, 2]  # the second step came from --resume
    assert "resumed_vs_full: 0 of" in done.stdout
