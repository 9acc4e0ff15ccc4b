"""Device and precision selection (cpu / cuda / npu) and per-sample seeding.

torch-npu is imported only when an NPU is asked for, because importing it breaks `import torch`
on machines without Ascend libraries.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator

import torch

from rlx.errors import UserError


def _npu_available() -> bool:
    import importlib.util

    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        import torch_npu  # noqa: F401
    except Exception:  # installed without the Ascend libraries
        return False
    return bool(getattr(torch, "npu", None) and torch.npu.is_available())


def resolve_device(name: str = "auto") -> torch.device:
    """'auto' picks cuda, then npu, then cpu; an explicit device that is missing is a UserError."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if _npu_available():
            return torch.device("npu", torch.npu.current_device())
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available")
    if name == "npu" and not _npu_available():
        raise UserError("--device npu: torch_npu is not installed or no NPU is available")
    if name not in ("cpu", "cuda", "npu"):
        raise UserError(f"unknown device {name!r} (expected auto, cpu, cuda or npu)")
    return torch.device(name)


def resolve_precision(precision: str, device: torch.device) -> torch.dtype:
    """Compute dtype: 'auto' is bfloat16 on accelerators and float32 on CPU."""
    if precision == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[precision]


@contextlib.contextmanager
def autocast(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """Mixed-precision context for forward passes; a no-op for float32."""
    if dtype == torch.float32:
        yield
    else:
        with torch.autocast(device_type=device.type, dtype=dtype):
            yield


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from any parts (e.g. seed, prompt id, sample index): stable across runs and machines."""
    digest = hashlib.blake2b("\x1f".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def host_cpus_per_process() -> int:
    """This process's share of the CPUs it may run on: the usable cores over the processes the launcher started on
    this machine (LOCAL_WORLD_SIZE, 1 without a launcher), at least 1. For CPU work that runs in threads of its own
    (random init), where torch's intra-op count is held at 1 on accelerators (rlx.parallel.dist.limit_cpu_threads)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
