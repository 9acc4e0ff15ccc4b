"""Time and memory of one phase of a step (rollout, score, train): wall seconds, device peak, host RSS.

    with measure_phase("rollout", device) as phase:
        ...                                   # the work
    metrics.update(phase)                     # timing/rollout_s, memory/rollout_device_peak_gb, ...

Device peak memory is torch's `max_memory_allocated` since the phase began (the peak counter is
reset on entry) for cuda and npu devices, less the bytes torch counts that hold no device memory
through the phase (`unmapped_bytes`: a sleeping vLLM's pool, see `allocated_in_segments`), and 0 on
the CPU. Host RSS is the process's resident set
at the end of the phase (psutil when installed, else /proc/self/status VmRSS, else the lifetime
peak from getrusage). Sizes are GiB (2**30 bytes). torch is imported only for cuda/npu devices.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlx.observe.tracking import heartbeat

GIB = float(2**30)


def phase_metrics(name: str, seconds: float, device_peak_bytes: int, host_rss_bytes: int) -> dict[str, float]:
    """The metric names of a phase: timing/{name}_s, memory/{name}_device_peak_gb, memory/{name}_host_rss_gb."""
    return {
        f"timing/{name}_s": float(seconds),
        f"memory/{name}_device_peak_gb": device_peak_bytes / GIB,
        f"memory/{name}_host_rss_gb": host_rss_bytes / GIB,
    }


def device_type(device: Any) -> str:
    """'cuda', 'npu', 'cpu', ... from a torch.device or a string like 'cuda:1'."""
    return getattr(device, "type", None) or str(device).split(":", 1)[0]


def _accelerator(device: Any):
    """The torch.cuda / torch.npu module for a device, or None for the CPU (and devices without stats)."""
    kind = device_type(device)
    if kind not in ("cuda", "npu"):
        return None
    import torch

    return getattr(torch, kind, None)


def reset_device_peak(device: Any) -> None:
    """Start a new peak-memory window on cuda/npu (a no-op on the CPU)."""
    module = _accelerator(device)
    if module is not None:
        module.init()  # the peak counters refuse a device that is not initialised yet
        module.reset_peak_memory_stats(device)


def device_peak_bytes(device: Any) -> int:
    """Peak bytes allocated by torch on the device since the last reset; 0 on the CPU.

    Synchronizes first, so the kernels of the phase have run (and their time is counted)."""
    module = _accelerator(device)
    if module is None:
        return 0
    module.synchronize(device)
    return int(module.max_memory_allocated(device))


def allocated_in_segments(segments: list[dict], addresses: set[int]) -> int:
    """Bytes torch's allocator counts as allocated in the segments that start at `addresses`.

    `segments`: torch.cuda.memory_snapshot()'s entries ({"address", "allocated_size", ...}). vLLM's sleep mode
    allocates its weights and KV cache through a pluggable allocator (its CuMemAllocator), whose segments torch
    counts as its own; vLLM's sleep unmaps their memory but the tensors stay alive, so torch's allocated bytes (and
    every peak after) still hold them. This many bytes of a phase's peak are then not on the device."""
    return sum(int(s["allocated_size"]) for s in segments if s["address"] in addresses)


def phase_peak_bytes(torch_peak: int, unmapped: int) -> int:
    """A phase's device peak: torch's peak less the `unmapped` bytes it counted all through the phase."""
    return max(torch_peak - unmapped, 0)


def host_rss_bytes() -> int:
    """Resident set size of this process now (psutil, else /proc/self/status; else getrusage's peak)."""
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        pass
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024  # kB
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, kB on Linux


@contextlib.contextmanager
def measure_phase(
    name: str, device: Any = "cpu", unmapped_bytes: int = 0, progress: str | None = None
) -> Iterator[dict[str, float]]:
    """Measure the block as phase `name` on `device` (torch.device or 'cpu' / 'cuda:0' / 'npu:0').
    `unmapped_bytes`: bytes torch counts as allocated all through the block that hold no device memory (a sleeping
    rollout engine's, RolloutEngine.unmapped_bytes), left out of the peak. `progress`: e.g. 'step 1/3', to say
    '<progress>: <name>: still running (N s)' while a long block runs (rlx.observe.tracking.heartbeat).

    Yields a dict that is filled when the block ends (also when it raises) with
    {"timing/{name}_s", "memory/{name}_device_peak_gb", "memory/{name}_host_rss_gb"} (floats, GiB).
    Resets the device's peak-memory counter on entry, so phases measured one after the other each
    report their own peak.
    """
    metrics: dict[str, float] = {}
    reset_device_peak(device)
    before = churn_counters(device)
    start = time.perf_counter()
    try:
        with heartbeat(f"{progress}: {name}" if progress else None):
            yield metrics
    finally:
        peak = phase_peak_bytes(device_peak_bytes(device), unmapped_bytes)
        seconds = time.perf_counter() - start
        metrics.update(phase_metrics(name, seconds, peak, host_rss_bytes()))
        after = churn_counters(device)
        for (kind, key), count in after.items():
            metrics[f"{kind}/{name}_{key}"] = float(count - before.get((kind, key), 0))


def churn_counters(device: Any) -> dict[tuple[str, str], int]:
    """What makes a phase slower than its last run, counted since the process started: on cuda the caching
    allocator's device allocations ('memory', 'device_mallocs') and its free-all-and-retry events
    ('alloc_retries'); graphs torch.compile has built ('compile', 'graphs') once torch._dynamo is loaded, and of
    the graphs Inductor compiled, those it found in its cache ('compile', 'cache_hits') and those it did not
    ('compile', 'cache_misses')."""
    out: dict[tuple[str, str], int] = {}
    if device_type(device) == "cuda":
        import torch

        stats = torch.cuda.memory_stats(device)
        out["memory", "device_mallocs"] = int(stats.get("num_device_alloc", 0))
        out["memory", "alloc_retries"] = int(stats.get("num_alloc_retries", 0))
    dynamo = sys.modules.get("torch._dynamo.utils")
    if dynamo is not None:
        out["compile", "graphs"] = int(dynamo.counters["stats"]["unique_graphs"])
        inductor = dynamo.counters["inductor"]
        out["compile", "cache_hits"] = int(inductor["fxgraph_cache_hit"])
        out["compile", "cache_misses"] = int(inductor["fxgraph_cache_miss"])
    return out


def process_age_s() -> float:
    """Seconds since this process started (psutil, else /proc/self/stat; 0.0 where neither is available)."""
    try:
        import psutil

        return time.time() - psutil.Process().create_time()
    except ImportError:
        pass
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))  # fmt: skip
        return time.time() - (boot + ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, StopIteration):
        return 0.0


class GcPauses:
    """Python's cyclic garbage collector in a step loop: timed by generation (`take()` returns the seconds since
    the last call, for the metrics line), and, after `freeze()`, run only between steps.

    An automatic collection fires wherever the allocation count crosses a threshold, often inside a train step;
    on a CUDA run a full one there made that step's train phase 0.35-0.4 s slower, though it took 20 ms itself
    (2026-11-23, bench/results/archive.md). So after the first step the heap alive is frozen, automatic collection is
    off, and `between_steps(step)` collects what the steps left: the young generations every step, everything
    every `FULL_EVERY` steps. `close` restores the collector as it was."""

    FULL_EVERY = 10

    def __init__(self) -> None:
        self._started: float | None = None
        self._seconds = [0.0, 0.0, 0.0]
        self._frozen = False
        self._was_enabled = gc.isenabled()
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self._seconds[info.get("generation", 2)] += time.perf_counter() - self._started
            self._started = None

    def take(self) -> dict[str, float]:
        out = {"timing/gc_s": sum(self._seconds), "timing/gc_full_s": self._seconds[2]}
        self._seconds = [0.0, 0.0, 0.0]
        return out

    def freeze(self) -> None:
        """Exempt every object alive now (modules, compiled graphs, the models' Python objects) from later
        collections, so they scan only what the run allocated since, and stop automatic collections (see
        `between_steps`). No collection first (0.6 s on a compiled 0.5B run): garbage alive now stays until
        `close`."""
        gc.freeze()
        gc.disable()
        self._frozen = True

    def between_steps(self, step: int) -> None:
        """After `freeze`: collect the garbage of the steps since the last call (generations 0-1; all three every
        `FULL_EVERY` steps). Before it, nothing."""
        if self._frozen:
            gc.collect(2 if step % self.FULL_EVERY == 0 else 1)

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
        if self._frozen:
            gc.unfreeze()  # what the run leaves behind is collectable again (e.g. in a test process)
            if self._was_enabled:
                gc.enable()
            self._frozen = False
