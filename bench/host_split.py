"""Where the host's time goes in the native engine's decode loop (bench/rollout.py --host-split).

Wraps the loop's parts (NativeStream's planning, the model step's launch, the sampling's launch, the read-back of a
step, and within it the wait for the device) with wall-clock counters for one `generate` call, and reports each
part's time per loop iteration. When the wait is near zero the host sets the loop's pace; when it is most of the
iteration the device does. The counters add ~1 us a call; nothing here is used outside benchmarks.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from rlx.rollout import sampling
from rlx.rollout.native import cohort, inputs, sampler
from rlx.rollout.native import engine as native_engine
from rlx.rollout.native.sampler import StepSampler

_PARTS = (
    (native_engine.NativeStream, "_plan_ahead", "plan"),
    (native_engine.NativeStream, "_launch", "launch (forward + sampling)"),
    (native_engine.ModelRunner, "forward", "  the model step"),
    (inputs.DecodeStaging, "fill_ahead", "    its inputs staged"),
    (torch.cuda.CUDAGraph, "replay", "    the graph's replay"),
    (sampler, "sample_next", "  the draw (sample_next)"),
    (sampling, "draw_tokens_triton", "    its Triton kernels"),
    (torch.Tensor, "copy_", "  (any tensor copy_)"),
    (torch.Tensor, "__setitem__", "  (any tensor __setitem__)"),
    (torch.Tensor, "__getitem__", "  (any tensor __getitem__)"),
    (native_engine.NativeStream, "_finish", "read back"),
    (cohort.Cohort, "read_back", "  the tokens appended"),
)


@contextmanager
def host_split(totals: dict[str, float]):
    """Within the block, add each part's seconds to `totals` (and `iterations`, `wait`, `step`)."""
    saved = []

    def timed(owner, name, label):
        original = getattr(owner, name)
        saved.append((owner, name, original))

        if isinstance(owner.__dict__.get(name), staticmethod):
            original = staticmethod(original)
            saved[-1] = (owner, name, original)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                totals[label] = totals.get(label, 0.0) + time.perf_counter() - start

        setattr(owner, name, wrapper)

    for owner, name, label in _PARTS:
        timed(owner, name, label)
    timed(native_engine.NativeStream, "step", "step")
    original_wait = StepSampler.collect_arrays

    def collect_arrays(step):
        start = time.perf_counter()
        if step.ready is not None:
            step.ready.synchronize()
        totals["  of it the wait for the device"] = totals.get("  of it the wait for the device", 0.0) + (
            time.perf_counter() - start
        )
        totals["iterations"] = totals.get("iterations", 0) + 1
        return original_wait(step)

    StepSampler.collect_arrays = staticmethod(collect_arrays)
    try:
        yield totals
    finally:
        StepSampler.collect_arrays = staticmethod(original_wait)
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def report(totals: dict[str, float], seconds: float) -> str:
    """A line a part: its microseconds per iteration and share of the call."""
    n = max(int(totals.get("iterations", 0)), 1)
    lines = [f"host split: {n} read-backs in {seconds * 1e3:.1f} ms ({seconds / n * 1e6:.0f} us an iteration)"]
    order = ["step", *dict.fromkeys(label for _, _, label in _PARTS), "  of it the wait for the device"]
    for label in order:
        value = totals.get(label, 0.0)
        lines.append(f"  {label:<34} {value / n * 1e6:8.1f} us  {value / seconds:6.1%}")
    return "\n".join(lines)
