"""A torch.profiler record of one `rlx ppo` step on every rank, asked for through the environment (no recipe key:
a diagnosis, not a setting of the run):

    RLX_PROFILE_STEP=3 RLX_PROFILE_DIR=prof torchrun --nproc_per_node 4 -m rlx ppo recipe.toml --out RUN

Each rank writes `prof/rank{R}.txt`: the step's wall seconds, the device's busy seconds (the sum of its kernels'
own times: what the GPU computed or waited in collectives; kernels on concurrent streams can add up to more than the
wall), the host operators' seconds, and the operators with the
largest device time and the largest host time; with RLX_PROFILE_TRACE=1 also `prof/rank{R}.json` (a Chrome trace);
RLX_PROFILE_STACKS=1 records each operator's input shapes and Python stack too (slower: for finding which line a
long host operator or a device idle comes from).
A step whose wall time is far above its device time is bound by the host (Python, launches, synchronisations)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch

STEP_VARIABLE = "RLX_PROFILE_STEP"
DIR_VARIABLE = "RLX_PROFILE_DIR"


def profiled_step() -> int:
    """The step RLX_PROFILE_STEP names (0: none); a value that is not a positive integer is an error."""
    from rlx.errors import UserError

    value = os.environ.get(STEP_VARIABLE, "").strip()
    if not value:
        return 0
    if not value.isdigit() or int(value) < 1:
        raise UserError(f"{STEP_VARIABLE}={value!r}: expected a step number (1, 2, ...)")
    return int(value)


@contextlib.contextmanager
def profile_step(step: int, rank: int, device: torch.device, rows: int = 30) -> Iterator[None]:
    """Profile the block when `step` is the one RLX_PROFILE_STEP names, and write this rank's summary."""
    if step != profiled_step():
        yield
        return
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    out = Path(os.environ.get(DIR_VARIABLE) or "rlx-profile")
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    stacks = os.environ.get("RLX_PROFILE_STACKS") == "1"
    with profile(activities=activities, record_shapes=stacks, with_stack=stacks) as prof:
        yield
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    wall = time.perf_counter() - start
    events = prof.key_averages()
    # the kernels alone: operators and annotations on the host also carry their kernels' time, counted once here
    device_us = sum(e.self_device_time_total for e in events if e.device_type != DeviceType.CPU and
                    not getattr(e, "is_user_annotation", False))  # fmt: skip
    host_us = sum(e.self_cpu_time_total for e in events)
    lines = [
        f"rank {rank}, step {step}: wall {wall:.3f} s, device busy {device_us / 1e6:.3f} s "
        f"({device_us / 1e6 / max(wall, 1e-9):.0%} of the wall), host operators {host_us / 1e6:.3f} s",
        "",
    ]
    if device.type == "cuda":
        lines += ["by device time", events.table(sort_by="self_device_time_total", row_limit=rows), ""]
    lines += ["by host time", events.table(sort_by="self_cpu_time_total", row_limit=rows)]
    (out / f"rank{rank}.txt").write_text("\n".join(lines) + "\n")
    if os.environ.get("RLX_PROFILE_TRACE") == "1":
        prof.export_chrome_trace(str(out / f"rank{rank}.json"))
