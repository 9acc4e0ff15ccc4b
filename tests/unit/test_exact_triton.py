"""Exact mode's Triton kernels (rlx/kernels/exact_triton.py), run by Triton's interpreter on the CPU: per-row
results bit-identical at batch 1, 3 and 17, from packed rows, padded rows and a paged cache (prefill and decode),
close to the PyTorch reference; gradients close to the reference's; and the attention kernel compiled for an H100
(no GPU needed): its paged and contiguous variants the same floating-point instructions. The interpreter runs
float32 only (its bfloat16 dots are wrong); tests/gpu/test_exact_cuda.py checks bfloat16 and the engine against
the trainer on CUDA."""

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


@pytest.mark.skipif(
    not HAS_TRITON or importlib.util.find_spec("triton.backends.nvidia") is None, reason="triton's CUDA backend absent"
)
def test_paged_and_contiguous_attention_compile_to_the_same_arithmetic():
    """Compiled for an H100 on the CPU: the engine's (paged) and the trainer's (contiguous) attention kernels run the
    same floating-point instruction sequence, in bfloat16 and float32."""
    out = run_script(Path(__file__).parent / "workers" / "exact_triton_ptx.py")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line.split() for line in out.stdout.strip().splitlines()]
    assert [(dtype, verdict) for dtype, _, verdict in lines] == [("bf16", "same"), ("fp32", "same")], out.stdout
    assert all(int(count) > 50 for _, count, _ in lines)  # the dots, exponentials and reductions were found


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_exact_mode_end_to_end_through_the_triton_kernels_in_the_interpreter():
    """The CUDA wiring on the CPU (`use_triton` patched on, the interpreter running the kernels): the native engine's
    logprobs equal the trainer's padded and packed forwards bit for bit, and training gradients follow the default
    forward's."""
    out = run_script(Path(__file__).parent / "workers" / "exact_triton_wiring.py", {"TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "ok"
