"""Deterministic kernels for a whole run (`deterministic = true` in a recipe): two runs of the same recipe on the same
machine give the same weights bit for bit, so `--resume` can be checked against an uninterrupted run on a GPU.

By default some CUDA kernels reduce in an order that changes from run to run (the attention backward's atomic
additions, cuBLAS's split reductions across streams): two uninterrupted runs then differ in the last bits after one
step (bench/RESULTS.md, Scale, twenty-third session). This turns on torch's deterministic algorithms (an op with no
deterministic kernel raises, and `determinism_error` turns that into a message naming the setting), cuDNN's
deterministic mode without autotuning, and a fixed cuBLAS workspace (CUBLAS_WORKSPACE_CONFIG, read when cuBLAS
first starts, so before the first matmul). It costs speed; the exact mode (docs/exact.md) is a different promise:
the rollout's logprobs equal the trainer's.
"""

from __future__ import annotations

import os

from rlx.errors import UserError

CUBLAS_WORKSPACE = ":4096:8"
"""CUBLAS_WORKSPACE_CONFIG for reproducible cuBLAS results (8 buffers of 4 MiB, as the CUDA documentation gives)."""
_MARK = "does not have a deterministic implementation"


def enable_determinism() -> None:
    """Deterministic kernels from here on in this process (and cuBLAS's workspace for processes it starts)."""
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def determinism_error(error: BaseException) -> UserError | None:
    """The message for an op that has no deterministic kernel (torch's RuntimeError), else None."""
    if not isinstance(error, RuntimeError) or _MARK not in str(error):
        return None
    op = str(error).split(_MARK)[0].strip().rstrip(",")
    return UserError(
        f"deterministic = true: {op or 'an operation'} has no deterministic kernel on this device; run without "
        "deterministic = true, or change the setting that uses it"
    )
