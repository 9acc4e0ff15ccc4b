"""safetensors files written straight from host tensors, optionally at a bounded rate.

A checkpoint written by the background writer while the next step computes should cost that step nothing. Measured
on an H100 (bench/results/archive.md, issue 15), writing a 0.5B model's 6 GB checkpoint with safetensors' `save_file` as
fast as the disk takes it made the step after every checkpoint 1 s slower (its score and train phases); a writer that
paces itself leaves it alone. This module writes the same format (an 8-byte little-endian header length, the JSON
header with `__metadata__` and each tensor's dtype, shape and byte offsets, padded with spaces to 8 bytes, then the
tensors' bytes in header order) from each tensor's memory in chunks, with no copy of the whole file in memory, and
sleeps between chunks to hold a `Pace`, until someone waits for the write (then full speed). Files are read back by
any safetensors reader. Outside `paced`, `save_tensors` is safetensors' own `save_file`.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}  # fmt: skip
CHUNK_BYTES = 64 << 20
_LOCAL = threading.local()


@dataclass
class Pace:
    """A write rate for this thread's safetensors files (`paced`), and an event that lifts it: set when someone waits
    for the writes to finish, so the rest is written at full speed."""

    bytes_per_s: float
    hurry: threading.Event = field(default_factory=threading.Event)


@contextlib.contextmanager
def paced(pace: Pace | None) -> Iterator[None]:
    """Within the block, this thread's `save_tensors` calls hold `pace` (None or a rate <= 0: full speed)."""
    before = getattr(_LOCAL, "pace", None)
    _LOCAL.pace = pace if pace is not None and pace.bytes_per_s > 0 else None
    try:
        yield
    finally:
        _LOCAL.pace = before


def save_tensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' `save_file`, or within `paced` (and for tensors `can_write` takes) `write_safetensors` at the
    block's pace."""
    pace = getattr(_LOCAL, "pace", None)
    if pace is None or not can_write(tensors):
        from safetensors.torch import save_file

        save_file(tensors, str(path), metadata=metadata)
        return
    write_safetensors(path, tensors, metadata, pace)


def can_write(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether `write_safetensors` takes these tensors (common dtypes, CPU, a little-endian host)."""
    return sys.byteorder == "little" and all(t.dtype in _DTYPES and t.device.type == "cpu" for t in tensors.values())


def header_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> bytes:
    """The length-prefixed, space-padded JSON header of a file holding `tensors` in their dict order."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return len(blob).to_bytes(8, "little") + blob


def write_safetensors(
    path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None,
    pace: Pace | None = None,
) -> None:  # fmt: skip
    """Write `tensors` (CPU, contiguous or made so; see `can_write`) to `path` as one safetensors file; with a `pace`
    no faster than its rate on average (sleeping between chunks of CHUNK_BYTES) until its `hurry` is set."""
    start, written = time.perf_counter(), 0
    with open(path, "wb", buffering=0) as f:
        f.write(header_bytes(tensors, metadata))
        for tensor in tensors.values():
            data = memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
            for begin in range(0, len(data), CHUNK_BYTES):
                written += _write_all(f, data[begin : begin + CHUNK_BYTES])
                if pace is not None and not pace.hurry.is_set():
                    ahead = written / pace.bytes_per_s - (time.perf_counter() - start)
                    if ahead > 0:
                        pace.hurry.wait(ahead)  # a sleep that ends early when someone starts waiting


def _write_all(f, data: memoryview) -> int:
    """Write every byte of `data` (a raw file may write fewer per call)."""
    done = 0
    while done < len(data):
        done += f.write(data[done:])
    return done
