"""measure_phase: metric names, wall time, host RSS that sees an allocation, CPU needs no torch; a GPU
test (skipped without CUDA) checks the device peak of each phase."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlx.observe import memory
from rlx.observe.memory import allocated_in_segments, host_rss_bytes, measure_phase, phase_peak_bytes
from tests.conftest import run_script

MIB = 2**20


def test_phase_metrics_are_named_after_the_phase():
    with measure_phase("rollout", "cpu") as phase:
        time.sleep(0.05)
    names = {"memory/rollout_device_peak_gb", "memory/rollout_host_rss_gb", "timing/rollout_s"}
    compiled = {"compile/rollout_graphs", "compile/rollout_cache_hits", "compile/rollout_cache_misses"}
    assert names <= set(phase) <= names | compiled  # the counts once torch._dynamo is loaded
    assert 0.05 <= phase["timing/rollout_s"] < 5
    assert phase["memory/rollout_device_peak_gb"] == 0.0
    assert 0.001 < phase["memory/rollout_host_rss_gb"] < 1024


def test_graphs_compiled_in_a_phase_are_counted():
    def double(x):
        return x * 2

    compiled = torch.compile(double, backend="eager", dynamic=False)
    compiled(torch.ones(3))  # warm: later calls with this shape build nothing
    with measure_phase("warm") as warm:
        compiled(torch.ones(3))
    with measure_phase("new_shape") as new_shape:
        compiled(torch.ones(5))  # a static shape not seen before: one more graph
    assert warm["compile/warm_graphs"] == 0
    assert new_shape["compile/new_shape_graphs"] == 1


def test_inductor_cache_hits_and_misses_are_counted(tmp_path):
    """A graph Inductor compiles on a cold cache is a miss; the same graph compiled again (dynamo reset, as in a
    new process) is found in the cache: a hit."""
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    out = run_script(Path(__file__).parent / "workers" / "inductor_cache_counts.py", env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert [float(v) for v in out.stdout.split()] == [1, 0, 1, 0]


def test_host_rss_sees_an_allocation():
    """RSS is the whole process's: the block is a fresh anonymous mapping, written, so it adds resident pages (a
    malloc'd block may reuse pages an earlier test freed, and the growth then read 0); in a test worker other threads
    may free memory in the same moment, so the allocation gets three tries to show."""
    import mmap

    grown = []
    for _ in range(3):
        before = host_rss_bytes()
        with measure_phase("score") as phase:
            block = mmap.mmap(-1, 128 * MIB)
            block.write(b"\x01" * (128 * MIB))
        grown.append(phase["memory/score_host_rss_gb"] * 2**30 - before)
        block.close()
        if grown[-1] > 100 * MIB:
            break
    assert max(grown) > 100 * MIB, grown


def test_rss_fallback_without_psutil_agrees(monkeypatch):
    pytest.importorskip("psutil")
    with_psutil = host_rss_bytes()
    monkeypatch.setitem(sys.modules, "psutil", None)  # import now raises: /proc/self/status is read
    without = host_rss_bytes()
    assert abs(without - with_psutil) < 32 * MIB


def test_a_failing_phase_is_still_measured():
    with pytest.raises(RuntimeError), measure_phase("train") as phase:
        raise RuntimeError("boom")
    assert phase["timing/train_s"] >= 0 and "memory/train_host_rss_gb" in phase


def test_cpu_phases_do_not_import_torch():
    code = (
        "import sys; from rlx.observe.memory import measure_phase\n"
        "with measure_phase('x', 'cpu') as m: pass\n"
        "print('torch' in sys.modules, sorted(m))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("False ['memory/x_device_peak_gb'")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run with RLX_TEST_GPU=1)")
def test_cuda_peak_is_per_phase():
    device = torch.device("cuda:0")
    with measure_phase("big", device) as big:
        x = torch.ones(256 * MIB // 4, device=device)  # 256 MiB of float32
        del x
    with measure_phase("small", device) as small:
        y = torch.ones(16 * MIB // 4, device=device)
        del y
    assert 0.25 <= big["memory/big_device_peak_gb"] < 0.3
    assert 16 / 1024 <= small["memory/small_device_peak_gb"] < 0.05
    assert big["memory/big_device_mallocs"] >= 1 and big["memory/big_alloc_retries"] == 0


def test_a_sleeping_vllm_pool_is_left_out_of_the_phase_peak(monkeypatch):
    """vLLM asleep: torch's allocator still counts the segments of its pool (unmapped by the sleep) as allocated, so
    torch's peak over a train phase read 99.8 GiB on 80 GB cards; the phase's peak leaves those bytes out."""
    gib = 2**30
    segments = [
        {"address": 0x1000, "total_size": 30 * gib, "allocated_size": 30 * gib},  # vLLM's weights
        {"address": 0x9000, "total_size": 4 * gib, "allocated_size": 2 * gib},  # its KV cache, half the segment used
        {"address": 0x5000, "total_size": 70 * gib, "allocated_size": 60 * gib},  # the trainer's
    ]
    pool = allocated_in_segments(segments, {0x1000, 0x9000, 0x7777})  # an address of no segment counts nothing
    assert pool == 32 * gib
    monkeypatch.setattr(memory, "device_peak_bytes", lambda device: int(99.8 * gib))
    with measure_phase("train", "cpu", unmapped_bytes=pool) as train:
        pass
    assert train["memory/train_device_peak_gb"] == pytest.approx(67.8)
    with measure_phase("rollout", "cpu") as rollout:  # awake: nothing unmapped
        pass
    assert rollout["memory/rollout_device_peak_gb"] == pytest.approx(99.8)
    assert phase_peak_bytes(gib, 2 * gib) == 0


def test_gc_pauses_are_timed_run_between_steps_after_the_freeze_and_restored_on_close():
    import gc

    from rlx.observe.memory import GcPauses

    pauses = GcPauses()
    try:
        for _ in range(2000):
            a: list = []
            a.append(a)  # cyclic garbage only the collector frees
        gc.collect()
        taken = pauses.take()
        assert taken["timing/gc_full_s"] > 0 and taken["timing/gc_s"] >= taken["timing/gc_full_s"]
        assert pauses.take() == {"timing/gc_s": 0.0, "timing/gc_full_s": 0.0}
        pauses.between_steps(1)  # before the freeze: the collector is automatic, nothing here
        assert pauses.take()["timing/gc_s"] == 0.0
        pauses.freeze()
        assert gc.get_freeze_count() > 0 and not gc.isenabled()  # after it: only between steps
        pauses.between_steps(3)
        young = pauses.take()
        assert young["timing/gc_s"] > 0 and young["timing/gc_full_s"] == 0
        pauses.between_steps(GcPauses.FULL_EVERY)
        assert pauses.take()["timing/gc_full_s"] > 0
    finally:
        pauses.close()
    assert gc.get_freeze_count() == 0 and pauses._callback not in gc.callbacks and gc.isenabled()
