"""Writing .safetensors files without holding the interpreter lock for the bulk of the bytes.

`safetensors.torch.save_file` turns every tensor into a Python bytes object first (under the lock, a full
extra copy): a checkpoint written by a background thread then stalls the training thread for seconds. Here
the header is built in Python and each tensor's memory goes to `file.write` as a buffer, which releases the
lock while the kernel copies. The files are byte-for-byte the safetensors format (any reader loads them).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None):
    """Write `tensors` (CPU or device; copied to the CPU when needed) to `path` in the safetensors format."""
    host = {name: value.detach().cpu().contiguous() for name, value in tensors.items()}
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    # largest alignment first, as safetensors orders them, so every tensor starts aligned to its element size
    order = sorted(host, key=lambda name: (-host[name].element_size(), name))
    for name in order:
        value = host[name]
        if value.dtype not in _DTYPES:
            raise TypeError(f"{name}: safetensors has no dtype for {value.dtype}")
        size = value.numel() * value.element_size()
        header[name] = {"dtype": _DTYPES[value.dtype], "shape": list(value.shape)}
        header[name]["data_offsets"] = [offset, offset + size]
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for name in order:
            value = host[name]
            if value.numel():
                f.write(memoryview(value.reshape(-1).view(torch.uint8).numpy()))
