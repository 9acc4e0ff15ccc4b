"""bench/device/pin_contention.py runs its modes each in a process of its own and reports them (CPU check mode)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO


def test_pin_contention_reports_each_mode(tmp_path):
    out = tmp_path / "pin.json"
    command = [sys.executable, str(REPO / "bench" / "device" / "pin_contention.py"), "--cpu", "--gib", "0.02",
               "--piece-mib", "4", "--none-s", "0.3", "--json", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [r["mode"] for r in rows] == ["none", "pageable"]  # no pinning without CUDA
    none, pageable = rows
    assert none["iterations"] > 5 and none["median_ms"] > 0 and none["prepared_gb"] == 0
    assert abs(pageable["prepared_gb"] - 5 * 4 * 2**20 / 1e9) < 1e-9 and pageable["gb_per_s"] > 0
    assert "x none" in done.stdout
