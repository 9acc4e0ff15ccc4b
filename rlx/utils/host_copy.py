"""Snapshots of live tensors on the host, for writing a checkpoint while training goes on.

CUDA tensors are copied into pinned host buffers that are kept and reused by the next snapshot of the same
names, on a side stream, so the copy overlaps the next step's rollout instead of stalling the step. Two waits
keep it exact: `before_update()` makes the device wait for the copies before anything updates the source
tensors in place (a train step calls it first), and `wait_copied()` blocks the writer until the bytes are on
the host. CPU tensors are cloned (they may be the live parameters themselves).

The buffers hold one snapshot per tag: take the next snapshot only after the previous one is written. They are views
into pinned chunks of one power-of-two size each (`_carve`): torch's pinned allocator rounds every allocation up to a
power of two and pins all of it, so a buffer per tensor took up to twice the host memory, and the time to pin it (7B
on 4 x H100: 43.3 GiB of host memory a rank for 22.8 GB of shards).
"""

from __future__ import annotations

import threading

import torch

_BUFFERS: dict[str, torch.Tensor] = {}
_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
_LOCK = threading.Lock()
_NOT_WAITED_ON_DEVICE: list[torch.cuda.Event] = []
_NOT_WAITED_ON_HOST: list[torch.cuda.Event] = []


def snapshot(tensors: dict[str, torch.Tensor], tag: str) -> dict[str, torch.Tensor]:
    """Host copies of `tensors` (same keys and dtypes) that later in-place updates of the sources leave alone;
    CUDA sources are still being copied when this returns (see `before_update` / `wait_copied`)."""
    out: dict[str, torch.Tensor] = {}
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for key, value in tensors.items():
        value = value.detach()
        if value.is_cuda:
            by_device.setdefault(value.device, []).append((key, value))
        else:
            out[key] = value.clone()
    _ensure(tag, {key: (value.shape, value.dtype) for items in by_device.values() for key, value in items})
    for device, items in by_device.items():
        stream = _STREAMS.get(device) or _STREAMS.setdefault(device, torch.cuda.Stream(device))
        stream.wait_stream(torch.cuda.current_stream(device))  # the copies see every update queued so far
        with torch.cuda.stream(stream):
            for key, value in items:
                buffer = _BUFFERS[f"{tag}/{key}"]
                buffer.copy_(value, non_blocking=True)
                value.record_stream(stream)  # a temporary source is not reused before the copy has read it
                out[key] = buffer
        event = torch.cuda.Event()
        event.record(stream)
        with _LOCK:
            _NOT_WAITED_ON_DEVICE.append(event)
            _NOT_WAITED_ON_HOST.append(event)
    return {key: out[key] for key in tensors}


CHUNK_MIN_BYTES = 256 << 20
"""The smallest pinned chunk buffers are carved out of (a power of two: the pinned allocator keeps it whole)."""
_ALIGN = 512


def _ensure(tag: str, shapes: dict[str, tuple[torch.Size, torch.dtype]]) -> int:
    """Buffers in `_BUFFERS` for these keys of `tag`, made where missing or of another shape or dtype; the bytes of
    those made."""
    missing = {}
    for key, (shape, dtype) in shapes.items():
        buffer = _BUFFERS.get(f"{tag}/{key}")
        if buffer is None or buffer.shape != shape or buffer.dtype != dtype:
            missing[key] = (torch.Size(shape), dtype)
    for key, buffer in _carve(missing).items():
        _BUFFERS[f"{tag}/{key}"] = buffer
    return sum(shape.numel() * dtype.itemsize for shape, dtype in missing.values())


def pinned_chunk_bytes(largest: int) -> int:
    """The size of the pinned chunks a snapshot whose largest tensor is `largest` bytes is carved out of: a power of
    two, at least CHUNK_MIN_BYTES (the memory plan counts whole chunks: rlx/ppo/plan.py)."""
    return max(CHUNK_MIN_BYTES, 1 << max(0, largest - 1).bit_length())


def _carve(shapes: dict[str, tuple[torch.Size, torch.dtype]]) -> dict[str, torch.Tensor]:
    """Host tensors of these shapes and dtypes, packed largest first into pinned chunks of one power-of-two size (at
    least CHUNK_MIN_BYTES, at least the largest tensor), each tensor a view of one chunk at a 512-byte offset. (DCP's
    writer copies a view out of its chunk before it serializes it: give it `exact_storage` aliases; safetensors
    writes views that do not overlap as they are.)"""
    sizes = {key: shape.numel() * dtype.itemsize for key, (shape, dtype) in shapes.items()}
    if not sizes:
        return {}
    chunk_bytes = pinned_chunk_bytes(max(sizes.values()))
    chunks: list[list] = []  # [chunk, bytes used]
    out = {}
    for key in sorted(sizes, key=lambda k: -sizes[k]):
        need = -(-sizes[key] // _ALIGN) * _ALIGN
        spot = next((c for c in chunks if c[1] + need <= chunk_bytes), None)
        if spot is None:
            spot = [_new_chunk(chunk_bytes), 0]
            chunks.append(spot)
        shape, dtype = shapes[key]
        out[key] = spot[0][spot[1] : spot[1] + sizes[key]].view(dtype).view(shape)
        spot[1] += need
    return out


def exact_storage(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (contiguous) over a storage of exactly its bytes: a carved buffer's memory, aliased. DCP's writer
    copies out every tensor whose storage is larger than it before it serializes it (torch.save writes whole
    storages): with views of 256 MiB+ chunks the 7B final save's files (22.8 GB a rank) took 42 s to write, 25 s with
    buffers of their own; on the write alone (4 ranks x 4 GB, an H100 host: bench/checkpoint_write.py --buffers),
    views 2.3-3.4 s, these aliases 1.2-1.3 s. The CUDA copies keep writing into the view; the writer reads the
    alias."""
    nbytes = tensor.numel() * tensor.element_size()
    if not tensor.is_contiguous() or tensor.untyped_storage().nbytes() == nbytes:
        return tensor
    start = tensor.storage_offset() * tensor.element_size()
    alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return alias.set_(tensor.untyped_storage()[start : start + nbytes], 0, tensor.shape)


def _new_chunk(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def layout(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """(shape, dtype) of each CUDA tensor of `tensors`: what `reserve` needs to pin their snapshot's buffers."""
    return {key: (value.shape, value.dtype) for key, value in tensors.items() if value.is_cuda}


def reserve(shapes: dict[str, tuple[torch.Size, torch.dtype]], tag: str) -> int:
    """Pin the host buffers a later `snapshot(tensors, tag)` of tensors of these shapes will copy into, now (the
    first snapshot need not pin them itself: 6 GB took 1.8-4 s on an H100's host); the bytes pinned. Meant for a
    background thread, before the first snapshot of `tag` (buffers are not locked against a snapshot running)."""
    return _ensure(tag, shapes)


def before_update() -> None:
    """Make the current streams wait for pending snapshot copies (no host wait): call before updating in place."""
    with _LOCK:
        events, _NOT_WAITED_ON_DEVICE[:] = list(_NOT_WAITED_ON_DEVICE), []
    for event in events:
        torch.cuda.current_stream().wait_event(event)


def wait_copied() -> None:
    """Block until every snapshot taken so far is on the host."""
    with _LOCK:
        events, _NOT_WAITED_ON_HOST[:] = list(_NOT_WAITED_ON_HOST), []
    for event in events:
        event.synchronize()
