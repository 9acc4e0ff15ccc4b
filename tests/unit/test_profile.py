"""RLX_PROFILE_STEP: one step's torch.profiler summary per rank (rlx/observe/profile.py)."""

from __future__ import annotations

import pytest
import torch

from rlx.errors import UserError
from rlx.observe.profile import profile_step, profiled_step


def test_the_named_step_writes_its_summary_and_the_others_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("RLX_PROFILE_STEP", "2")
    monkeypatch.setenv("RLX_PROFILE_DIR", str(tmp_path / "prof"))
    for step in (1, 2, 3):
        with profile_step(step, rank=1, device=torch.device("cpu")):
            torch.randn(64, 64) @ torch.randn(64, 64)
    assert [p.name for p in (tmp_path / "prof").iterdir()] == ["rank1.txt"]
    text = (tmp_path / "prof" / "rank1.txt").read_text()
    assert text.startswith("rank 1, step 2: wall ") and "aten::mm" in text and "by host time" in text
    assert "device busy 0.000 s" in text  # no kernels on the CPU: operators' own fields are not counted as such


def test_no_variable_no_profile_and_a_bad_value_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("RLX_PROFILE_STEP", raising=False)
    monkeypatch.chdir(tmp_path)
    assert profiled_step() == 0
    with profile_step(1, rank=0, device=torch.device("cpu")):
        pass
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv("RLX_PROFILE_STEP", "three")
    with pytest.raises(UserError, match="RLX_PROFILE_STEP='three': expected a step number"):
        profiled_step()


def test_stacks_put_shapes_and_the_python_line_in_the_trace(tmp_path, monkeypatch):
    import json

    monkeypatch.setenv("RLX_PROFILE_STEP", "1")
    monkeypatch.setenv("RLX_PROFILE_DIR", str(tmp_path))
    monkeypatch.setenv("RLX_PROFILE_TRACE", "1")
    monkeypatch.setenv("RLX_PROFILE_STACKS", "1")
    with profile_step(1, rank=0, device=torch.device("cpu")):
        torch.randn(48, 40) @ torch.randn(40, 24)
    events = json.loads((tmp_path / "rank0.json").read_text())["traceEvents"]
    mm = next(e for e in events if e.get("name") == "aten::mm")
    assert mm["args"]["Input Dims"] == [[48, 40], [40, 24]]
    assert any(e.get("cat") == "python_function" and "test_profile.py" in e["name"] for e in events)
