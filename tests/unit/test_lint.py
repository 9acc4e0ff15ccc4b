"""The code stays within the style checks (ruff, with the complexity check) that pyproject configures."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff not installed")
def test_ruff_passes():
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "rlx", "tests"], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout
