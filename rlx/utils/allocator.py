"""Process-wide settings of torch's memory allocators, made before torch initialises CUDA (no torch import here)."""

from __future__ import annotations

import os

PINNED_REGISTER = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"
"""Pinned host memory as ordinary pages registered with CUDA by 8 threads, rather than one cudaHostAlloc call."""


def configure_pinned_memory() -> None:
    """Pin host memory with `PINNED_REGISTER` unless the user configured the allocator (PYTORCH_CUDA_ALLOC_CONF
    or PYTORCH_ALLOC_CONF set). The first checkpoint of a run pins its host buffers (rlx.utils.host_copy: 6 GB for
    a 0.5B model's parameters and AdamW state); cudaHostAlloc locks the pages on one thread, and that step waited
    6.1 s for it against 1.8 s with registration on 8 threads (bench/RESULTS.md, same device)."""
    if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and "PYTORCH_ALLOC_CONF" not in os.environ:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = PINNED_REGISTER
