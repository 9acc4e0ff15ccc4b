"""Snapshots of live tensors on the host, for writing a checkpoint while training goes on.

CUDA tensors are copied into pinned host buffers that are kept and reused by the next snapshot of the same
names, on a side stream, so the copy overlaps the next step's rollout instead of stalling the step. Two waits
keep it exact: `before_update()` makes the device wait for the copies before anything updates the source
tensors in place (a train step calls it first), and `wait_copied()` blocks the writer until the bytes are on
the host. CPU tensors are cloned (they may be the live parameters themselves).

The buffers hold one snapshot per tag: take the next snapshot only after the previous one is written.
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
    for device, items in by_device.items():
        stream = _STREAMS.get(device) or _STREAMS.setdefault(device, torch.cuda.Stream(device))
        stream.wait_stream(torch.cuda.current_stream(device))  # the copies see every update queued so far
        with torch.cuda.stream(stream):
            for key, value in items:
                buffer = _pinned(f"{tag}/{key}", value.shape, value.dtype)
                buffer.copy_(value, non_blocking=True)
                value.record_stream(stream)  # a temporary source is not reused before the copy has read it
                out[key] = buffer
        event = torch.cuda.Event()
        event.record(stream)
        with _LOCK:
            _NOT_WAITED_ON_DEVICE.append(event)
            _NOT_WAITED_ON_HOST.append(event)
    return {key: out[key] for key in tensors}


def _pinned(name: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    buffer = _BUFFERS.get(name)
    if buffer is None or buffer.shape != shape or buffer.dtype != dtype:
        buffer = torch.empty(shape, dtype=dtype, pin_memory=True)
        _BUFFERS[name] = buffer
    return buffer


def layout(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """(shape, dtype) of each CUDA tensor of `tensors`: what `reserve` needs to pin their snapshot's buffers."""
    return {key: (value.shape, value.dtype) for key, value in tensors.items() if value.is_cuda}


def reserve(shapes: dict[str, tuple[torch.Size, torch.dtype]], tag: str) -> int:
    """Pin the host buffers a later `snapshot(tensors, tag)` of tensors of these shapes will copy into, now (the
    first snapshot need not pin them itself: 6 GB took 1.8-4 s on an H100's host); the bytes pinned. Meant for a
    background thread, before the first snapshot of `tag` (buffers are not locked against a snapshot running)."""
    pinned = 0
    for key, (shape, dtype) in shapes.items():
        before = _BUFFERS.get(f"{tag}/{key}")
        buffer = _pinned(f"{tag}/{key}", shape, dtype)
        pinned += 0 if buffer is before else buffer.numel() * buffer.element_size()
    return pinned


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
