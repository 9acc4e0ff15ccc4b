"""Device and backend selection (cpu/gloo, npu/hccl through a fake torch_npu), and collective timeouts."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

FAKE_NPU = Path(__file__).parent / "workers" / "fake_npu"  # a stand-in torch_npu package


def run_python(code: str, tmp_path: Path, env: dict | None = None, fake_npu: bool = False, timeout: int = 120):
    path = [str(REPO)]
    if fake_npu:
        path.insert(0, str(FAKE_NPU))
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": "1", **(env or {})}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_NTASKS", "SLURM_PROCID"):
        if env is None or key not in env:
            full_env.pop(key, None)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full_env, timeout=timeout
    )


def test_npu_is_found_lazily_and_gets_hccl(tmp_path):
    """With torch_npu present (faked), 'auto' and 'npu' pick the NPU, each rank sets its local device,
    and the process group uses hccl; torch_npu is not imported before a device is resolved."""
    code = """
        import sys
        import torch.distributed as dist
        import rlx.cli, rlx.parallel.dist as rd
        from rlx.utils.device import resolve_device
        assert "torch_npu" not in sys.modules
        seen = {}
        dist.init_process_group = lambda backend, **kw: seen.update(backend=backend, **kw)
        dist.is_initialized = lambda: "backend" in seen
        dist.new_group = lambda ranks: tuple(ranks)
        assert resolve_device("auto").type == "npu"
        ctx = rd.setup("npu")
        import torch_npu
        print(seen["backend"], ctx.collectives, ctx.device, ctx.rank, ctx.world, torch_npu.calls, seen["device_id"])
    """
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": "1"}
    out = run_python(code, tmp_path, env=env, fake_npu=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["hccl", "hccl", "npu:1", "3", "4", "[('set_device',", "1)]", "None"]


def test_without_torch_npu_npu_is_a_clear_error_and_cpu_gets_gloo():
    """In this process (no torch_npu installed, the GPUs hidden by tests/conftest.py)."""
    from rlx.errors import UserError
    from rlx.parallel.dist import COLLECTIVES
    from rlx.utils.device import resolve_device

    assert resolve_device("auto").type == "cpu" and COLLECTIVES["cpu"] == "gloo" and COLLECTIVES["cuda"] == "nccl"
    with pytest.raises(UserError, match="torch_npu is not installed or no NPU is available"):
        resolve_device("npu")


def test_collective_timeout_is_a_one_line_error(tmp_path):
    """A rank that stalls makes the others fail after $RLX_COLLECTIVE_TIMEOUT_S with a clear message."""
    script = REPO / "tests" / "distributed" / "workers" / "stall_then_barrier.py"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "RLX_COLLECTIVE_TIMEOUT_S": "3",
        "OMP_NUM_THREADS": "1",
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv-endpoint=localhost:0"]
    command += ["--rdzv-backend=c10d", str(script)]
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode != 0
    assert "rlx test: error: a collective operation timed out" in out.stderr, out.stderr[-3000:]


@pytest.mark.parametrize("value", ["0", "soon"])
def test_bad_timeout_setting_is_named(monkeypatch, value):
    """In this process, as a launched rank 0 of 1: the setting is read (and refused) before any process group."""
    from rlx.errors import UserError
    from rlx.parallel.dist import setup

    for key, setting in {"RANK": "0", "WORLD_SIZE": "1", "RLX_COLLECTIVE_TIMEOUT_S": value}.items():
        monkeypatch.setenv(key, setting)
    with pytest.raises(UserError, match=f"RLX_COLLECTIVE_TIMEOUT_S={value!r}: expected a positive number of seconds"):
        setup("cpu")


def test_launched_processes_exit_with_the_commands_code_and_run_atexit(tmp_path):
    """Under a launcher, `rlx` ends through exit_process (no interpreter finalization racing gloo's worker
    threads): the command's exit code and its output survive, atexit handlers still run."""
    code = f"""
        import atexit, sys
        import torch.distributed
        from pathlib import Path
        atexit.register(lambda: Path({str(tmp_path / "atexit")!r}).write_text("ran"))
        class Finalized:  # a module global is released only when the interpreter finalizes
            def __del__(self, write=Path({str(tmp_path / "finalized")!r}).write_text):
                write("yes")
        marker = Finalized()
        sys.argv = ["rlx", "merge", "--checkpoint", {str(tmp_path / "missing")!r}, "--out", {str(tmp_path / "o")!r}]
        from rlx.cli import main
        print("before", end="")
        main()
        print("never printed")
    """
    out = run_python(code, tmp_path, env={"WORLD_SIZE": "1", "RANK": "0"})
    assert out.returncode == 1, out
    assert out.stdout == "before", out.stdout
    assert "rlx merge: error:" in out.stderr and "missing" in out.stderr, out.stderr
    assert (tmp_path / "atexit").read_text() == "ran"
    assert not (tmp_path / "finalized").exists()


def test_accelerator_process_gets_one_cpu_thread_unless_omp_is_set(monkeypatch):
    import torch

    from rlx.parallel.dist import group_collectives, limit_cpu_threads

    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    limit_cpu_threads(torch.device("cuda", 0))
    assert calls == []  # the user's setting wins
    monkeypatch.delenv("OMP_NUM_THREADS")
    limit_cpu_threads(torch.device("cpu"))
    assert calls == []  # CPU compute keeps its threads
    limit_cpu_threads(torch.device("cuda", 0))
    assert calls == [1]
    # CPU-offloaded shards (train.param_offload) reduce over gloo beside nccl on CUDA
    assert group_collectives(torch.device("cuda", 0)) == "cpu:gloo,cuda:nccl"
    assert group_collectives(torch.device("cpu")) == "gloo"


def test_a_launched_accelerator_process_gets_one_cpu_thread_too(tmp_path):
    """Under a launcher that leaves OMP_NUM_THREADS unset (torchrun with one process, srun) the rank's intra-op
    threads are limited as a plain process's are."""
    code = """
        import os
        os.environ.pop("OMP_NUM_THREADS")
        import torch
        import torch.distributed as dist
        import rlx.parallel.dist as rd
        torch.set_num_threads(4)
        dist.init_process_group = lambda backend, **kw: None
        dist.is_initialized = lambda: True
        dist.new_group = lambda ranks: tuple(ranks)
        rd.setup("npu")
        print(torch.get_num_threads())
    """
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "localhost", "MASTER_PORT": "1"}
    out = run_python(code, tmp_path, env=env, fake_npu=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1"]


def test_host_cpus_are_shared_by_the_launchers_processes(monkeypatch):
    """Random init draws in threads of its own: this process's share of the usable cores (torch's intra-op count
    is 1 on accelerators), never below one."""
    from rlx.utils.device import host_cpus_per_process

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert host_cpus_per_process() == 64
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert host_cpus_per_process() == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "128")
    assert host_cpus_per_process() == 1
