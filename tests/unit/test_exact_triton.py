"""Exact mode's Triton kernels (rlx/kernels/exact_triton.py), run by Triton's interpreter on the CPU: per-row
results bit-identical at batch 1, 3 and 17, from packed rows, padded rows and a paged cache (prefill and decode),
close to the PyTorch reference; gradients close to the reference's. float32 only (the interpreter's bfloat16 dots
are wrong); tests/gpu/test_exact_triton.py checks bfloat16 and the engine against the trainer on CUDA."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.conftest import run_script

HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_exact_triton_kernels_in_the_interpreter():
    out = run_script(Path(__file__).parent / "workers" / "exact_triton_check.py", {"TRITON_INTERPRET": "1"}, "float32")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "ok"


def test_exact_mode_uses_triton_on_cuda_only():
    import torch

    from rlx.kernels.exact_triton import use_triton

    assert not use_triton(torch.zeros(1))
    assert use_triton(torch.empty(1, device="meta")) is False
