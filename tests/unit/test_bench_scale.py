"""bench/scale.py's step summary: the steady step leaves out the early steps and the final save."""

from __future__ import annotations

import importlib.util

from tests.conftest import REPO


def _scale():
    spec = importlib.util.spec_from_file_location("bench_scale", REPO / "bench" / "scale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_steady_step_is_the_later_half_without_the_final_save():
    # the 7B run of 2026-11-27 (bench/RESULTS.md, Scale, eleventh session): steps 2-4 pin the checkpoint buffers
    steps = [46.09, 6.75, 9.72, 8.69, 4.61, 4.80]
    metrics = [{"timing/step_s": s, "timing/save_s": 0.01} for s in steps]
    metrics[-1]["timing/save_s"] = 0.46
    scale = _scale()
    assert scale.steady_step_s(metrics) == 4.61  # median of 8.69, 4.61 and 4.80 - 0.46
    summary = scale.summarize(metrics, [95.0 + i for i in range(6)], gpus=4)
    assert summary["median_s"] == 6.75 and summary["steady_s"] == 4.61
    assert scale.steady_step_s(metrics[:1]) == 46.09
