"""Helpers every logprob/entropy implementation shares (PyTorch and Triton alike): accumulation dtype and the
per-row upstream gradients of the backward (see rlx/kernels/logprob_entropy.py for the math)."""

from __future__ import annotations

import torch


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: float64 for float64 inputs (exact tests), else float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def row_grads(grad_logprob, grad_entropy, targets, ignore_index, like):
    """(a, b) = the upstream gradients dL/dlogprob and dL/dentropy per row in `like`'s dtype, zero on ignored rows."""
    valid = (targets != ignore_index).to(like.dtype)
    a = (grad_logprob.to(like.dtype) if grad_logprob is not None else torch.zeros_like(like)) * valid
    b = (grad_entropy.to(like.dtype) if grad_entropy is not None else torch.zeros_like(like)) * valid
    return a, b
