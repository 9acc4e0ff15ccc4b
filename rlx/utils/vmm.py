"""Device memory at a fixed virtual address whose physical memory can be handed back and taken again.

The native rollout engine's decode CUDA graphs have the addresses of its KV cache and weight replica baked in. To
give that memory to the trainer between rollouts without capturing the graphs again, it lives in a
`VirtualBuffer`: a range of virtual addresses reserved once (CUDA's virtual memory management, the driver API's
`cuMemAddressReserve`), backed by physical memory that `release` unmaps and frees and `restore` creates and maps
again at the same addresses (as vLLM's sleep mode does). Contents do not survive a release. Tensors are views of
the buffer (`tensor`), made through `__cuda_array_interface__`, and keep it alive.

The driver is called through ctypes (libcuda, already loaded by torch): no extension to build. `supported()` says
whether this process can use it (a CUDA device with virtual memory management).
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch

_DEVICE_ATTRIBUTE_VMM_SUPPORTED = 102  # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
_ALLOCATION_PINNED, _LOCATION_DEVICE, _ACCESS_READWRITE, _GRANULARITY_MINIMUM = 1, 1, 3, 0
_OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY
ALIGN = 256
"""Byte alignment of each tensor carved from a buffer."""


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]  # fmt: skip


class _AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]  # fmt: skip


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


@functools.lru_cache(maxsize=1)
def _driver():
    """libcuda with the prototypes used here (None where it cannot be loaded)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    u64, size, p = ctypes.c_uint64, ctypes.c_size_t, ctypes.POINTER
    prototypes = {
        "cuDeviceGetAttribute": (p(ctypes.c_int), ctypes.c_int, ctypes.c_int),
        "cuMemGetAllocationGranularity": (p(size), p(_AllocationProp), ctypes.c_int),
        "cuMemAddressReserve": (p(u64), size, size, u64, ctypes.c_ulonglong),
        "cuMemAddressFree": (u64, size),
        "cuMemCreate": (p(u64), size, p(_AllocationProp), ctypes.c_ulonglong),
        "cuMemRelease": (u64,),
        "cuMemMap": (u64, size, size, u64, ctypes.c_ulonglong),
        "cuMemUnmap": (u64, size),
        "cuMemSetAccess": (u64, size, p(_AccessDesc), size),
        "cuGetErrorString": (ctypes.c_int, p(ctypes.c_char_p)),
    }
    for name, args in prototypes.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = list(args), ctypes.c_int
    return lib


def _check(result: int, what: str) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        _driver().cuGetErrorString(result, ctypes.byref(text))
        raise RuntimeError(f"CUDA driver {what} failed: {(text.value or b'error').decode()} ({result})")


def supported(device: torch.device) -> bool:
    """Whether buffers can be made on `device` (a CUDA device whose driver has virtual memory management)."""
    if device.type != "cuda" or not torch.cuda.is_available() or _driver() is None:
        return False
    torch.cuda.init()
    value = ctypes.c_int(0)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _driver().cuDeviceGetAttribute(ctypes.byref(value), _DEVICE_ATTRIBUTE_VMM_SUPPORTED, index) != 0:
        return False
    return bool(value.value)


class _Range:
    """Reserved addresses and their physical memory; freed when nothing refers to it (the tensors viewing it hold it
    through a `_Part`, so it never refers to them)."""

    def __init__(self, nbytes: int, device: torch.device):
        self.device, self.address, self.handle = device, 0, None
        lib = _driver()
        self.prop = _AllocationProp(type=_ALLOCATION_PINNED, location=_Location(_LOCATION_DEVICE, device.index))
        granularity = ctypes.c_size_t(0)
        with torch.cuda.device(device):
            _check(lib.cuMemGetAllocationGranularity(ctypes.byref(granularity), ctypes.byref(self.prop),
                                                     _GRANULARITY_MINIMUM), "granularity")  # fmt: skip
            self.nbytes = max(1, math.ceil(nbytes / granularity.value)) * granularity.value
            address = ctypes.c_uint64(0)
            _check(lib.cuMemAddressReserve(ctypes.byref(address), self.nbytes, 0, 0, 0), "address reserve")
        self.address = address.value

    def map(self) -> None:
        lib = _driver()
        handle = ctypes.c_uint64(0)
        with torch.cuda.device(self.device):
            _check(lib.cuMemCreate(ctypes.byref(handle), self.nbytes, ctypes.byref(self.prop), 0), "create")
            try:
                _check(lib.cuMemMap(self.address, self.nbytes, 0, handle.value, 0), "map")
                access = _AccessDesc(location=_Location(_LOCATION_DEVICE, self.device.index), flags=_ACCESS_READWRITE)
                _check(lib.cuMemSetAccess(self.address, self.nbytes, ctypes.byref(access), 1), "set access")
            except RuntimeError:
                lib.cuMemRelease(handle.value)
                raise
        self.handle = handle.value

    def unmap(self) -> None:
        lib = _driver()
        with torch.cuda.device(self.device):
            _check(lib.cuMemUnmap(self.address, self.nbytes), "unmap")
            _check(lib.cuMemRelease(self.handle), "release")
        self.handle = None

    def __del__(self):
        if _driver() is None or not self.address:
            return
        try:
            if self.handle is not None:
                torch.cuda.synchronize(self.device)
                self.unmap()
            _driver().cuMemAddressFree(self.address, self.nbytes)
        except Exception:  # noqa: BLE001 (interpreter shutdown: the driver may be gone)
            pass


class _Part:
    """`nbytes` at `offset` of a range, as `__cuda_array_interface__` (keeps the range alive)."""

    def __init__(self, memory: _Range, offset: int, nbytes: int):
        self.memory = memory
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (memory.address + offset, False), "version": 3,
            "strides": None,
        }  # fmt: skip


class VirtualBuffer:
    """`nbytes` of device memory at a fixed address, mapped on creation; see the module docstring."""

    def __init__(self, nbytes: int, device: torch.device):
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        self.device = device
        self._range = _Range(nbytes, device)
        self.nbytes = self._range.nbytes
        self._range.map()
        self._bytes = torch.as_tensor(_Part(self._range, 0, self.nbytes), device=device)  # for zero_

    @property
    def mapped(self) -> bool:
        return self._range.handle is not None

    def tensor(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of `shape` and `dtype` at byte `offset` (a multiple of ALIGN) of the buffer, with a storage of
        its own: tensors carved from one buffer do not alias (torch.compile would otherwise merge the inputs of a
        graph that mutates them into one base and rebuild them from it)."""
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if offset % ALIGN or offset + size > self.nbytes:
            raise ValueError(f"{size} bytes at {offset} do not fit a {self.nbytes}-byte buffer aligned to {ALIGN}")
        part = torch.as_tensor(_Part(self._range, offset, max(size, 1)), device=self.device)
        return part[:size].view(dtype).view(shape)

    def zero_(self) -> None:
        """Write zeros over the whole buffer."""
        self._bytes.zero_()

    def release(self) -> int:
        """Unmap and free the physical memory (the addresses stay reserved); returns the bytes freed."""
        if not self.mapped:
            return 0
        torch.cuda.synchronize(self.device)  # no queued kernel may still touch it
        self._range.unmap()
        return self.nbytes

    def restore(self) -> None:
        """New physical memory mapped at the same addresses (its contents undefined). Where the device has too
        little free memory, torch's caching allocator first returns its unused blocks (the trainer's, typically)."""
        if self.mapped:
            return
        try:
            self._range.map()
        except RuntimeError as e:
            if f"({_OUT_OF_MEMORY})" not in str(e):
                raise
            torch.cuda.empty_cache()
            self._range.map()


def carve(shapes: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device):
    """One buffer holding a tensor of each (shape, dtype), each at an ALIGN-ed offset: (buffer, tensors)."""
    offsets, end = [], 0
    for shape, dtype in shapes:
        offsets.append(end)
        end += math.ceil(math.prod(shape) * torch.empty((), dtype=dtype).element_size() / ALIGN) * ALIGN
    buffer = VirtualBuffer(end, device)
    return buffer, [buffer.tensor(o, shape, dtype) for o, (shape, dtype) in zip(offsets, shapes)]
