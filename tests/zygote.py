"""Launching the ranks of a test's `torchrun` run from processes that imported rlx's dependencies once.

A rank of a CPU test spends ~8 s of CPU starting (torch 2-3 s, transformers and its model registry 3-5 s, rlx
~1 s) before its first step, and the suite launched ~150 runs of 2-4 ranks plus their torchrun agents: about half of
its CPU time on two cores. Here each pytest worker starts two zygotes, processes that import those modules and then
only fork. A test's run asks them for its ranks: each rank is a fresh child of a zygote (the state right after the
imports, nothing run), with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, LOCAL_WORLD_SIZE,
TORCHELASTIC_*; the store the ranks meet at held by the test's process, as torchrun's agent holds it), the test's
environment and working folder, and the target run as `python -m MODULE` or `python
SCRIPT` runs it. As under torchrun, the run fails when a rank fails, and the other ranks get SIGTERM after it (30 s,
then SIGKILL); the run's stdout and stderr are the ranks', rank after rank.

The two zygotes have different str hash seeds and take the ranks in turn, so ranks 0 and 1 differ in set and dict
orders of strings as separate interpreters do (code whose collectives follow such an order would still hang here).

`run_torchrun` (conftest.py) uses this for plain `torchrun --nproc_per_node N TARGET ARGS` runs whose environment
keeps the variables read at import time (TRITON_*, OMP_*, ...) as the zygotes had them; others, and every run with
RLX_TEST_ZYGOTE=0, go through torchrun itself.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import random
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch.distributed

IMPORT_TIME_VARIABLES = ("TRITON_", "OMP_", "MKL_", "TORCH", "PYTORCH_", "TRANSFORMERS_", "HF_", "CUDA_", "PYTHON")
"""Prefixes of environment variables that modules read when imported: a run that changes one runs under torchrun."""

_GRACE_S = 30.0  # torchrun's: after the first failure, the other ranks' time to stop on SIGTERM
_POLL_S = 0.1  # torchrun's monitor interval


def _preload() -> None:
    """What a rank of the suite's runs imports anyway: torch, its distributed packages, transformers' model classes
    (their registry), and rlx's commands."""
    import importlib
    import pkgutil

    import torch  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM  # noqa: F401

    import rlx.cli  # noqa: F401

    for package in ("rlx.commands", "rlx.stages", "rlx.ppo"):
        module = importlib.import_module(package)
        for info in pkgutil.iter_modules(module.__path__):
            importlib.import_module(f"{package}.{info.name}")


def serve(path: str) -> None:
    """The zygote: import, then fork a group leader for each request on the UNIX socket at `path`, until the process
    that started it is gone."""
    parent = os.getppid()
    _preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # the socket appears once it accepts
    listener.listen(16)
    listener.settimeout(1.0)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # leaders are reaped by the kernel
    while os.getppid() == parent:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        kind, fds, _, _ = socket.recv_fds(conn, 1, 3)  # b"R": ranks of a run; b"P": a plain command, its stdio
        request = json.loads(conn.makefile("r").readline())
        if kind == b"P" and not _same_imports(request["env"], os.environ):
            conn.sendall(b"no\n")  # the shim runs the command itself
        elif os.fork() == 0:
            listener.close()
            _lead(conn, request, fds)  # never returns
        for fd in fds:
            os.close(fd)
        conn.close()


def _same_imports(env: dict[str, str], own) -> bool:
    """Whether a process in `env` would import what this one did: the same values of the variables read at import time
    (PYTHONPATH: the same, or unset)."""
    keys = {k for k in (*env, *own) if k.startswith(IMPORT_TIME_VARIABLES)} - {"PYTHONPATH", "PYTHONHASHSEED"}
    same_path = env.get("PYTHONPATH") in (None, "", own.get("PYTHONPATH"))
    return same_path and all(env.get(k) == own.get(k) for k in keys)


def _lead(conn: socket.socket, request: dict, fds: list[int]) -> None:
    """A group leader: its own process group, one child a rank it was given (or the plain command, on the caller's
    stdio `fds`); reports its pgid, then the first failing rank's exit code (0 when all succeed)."""
    code = 1
    try:
        os.setpgid(0, 0)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        conn.sendall(f"{os.getpgid(0)}\n".encode())
        ranks = {}
        for rank in request.get("ranks") or [None]:
            pid = os.fork()
            if pid == 0:
                conn.close()
                _rank(request, rank, fds)  # never returns
            ranks[pid] = rank
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a SIGTERM to the group stops the ranks; this one reports
        code = _wait_ranks(ranks)
    finally:
        try:
            conn.sendall(f"{code}\n".encode())
        finally:
            os._exit(0)


def _wait_ranks(ranks: dict[int, int]) -> int:
    """Wait for the ranks; after the first one that fails, SIGTERM the others (SIGKILL after the grace period)."""
    code, deadline = 0, None
    while ranks:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if deadline is not None and time.monotonic() > deadline:
                for other in ranks:
                    os.kill(other, signal.SIGKILL)
            time.sleep(_POLL_S)
            continue
        ranks.pop(pid, None)
        exit_code = os.waitstatus_to_exitcode(status)
        if exit_code != 0 and code == 0:
            code = exit_code if exit_code > 0 else 128 - exit_code
            for other in ranks:
                os.kill(other, signal.SIGTERM)
            deadline = time.monotonic() + _GRACE_S
    return code


def _rank(request: dict, rank: int | None, fds: list[int]) -> None:
    """Become rank `rank` of the request's run (its environment, folder, output files and target), or with rank None
    the plain command on the stdio `fds`."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.chdir(request["cwd"])
        if rank is None:
            for fd, given in enumerate(fds):
                os.dup2(given, fd)
                os.close(given)
        else:
            written = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
            files = ((0, os.devnull, os.O_RDONLY), (1, f"{request['out']}.{rank}.out", written),
                     (2, f"{request['out']}.{rank}.err", written))  # fmt: skip
            for fd, name, flags in files:
                opened = os.open(name, flags, 0o644)
                os.dup2(opened, fd)
                os.close(opened)
        os.environ.clear()
        os.environ.update(request["env"])
        if rank is not None:
            os.environ.update(_rank_env(request, rank))
        random.seed()  # a fresh interpreter's own draws, not the zygote's
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        code = _run(request["target"], request["args"])
    except BaseException:  # noqa: BLE001 (reported as the interpreter would, then the rank fails)
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _rank_env(request: dict, rank: int) -> dict[str, str]:
    world = str(request["world"])
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_NAME": "default",
        "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world, "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": world,
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(request["port"]), "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": request["run_id"],
        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }  # fmt: skip


def _run(target: list[str], args: list[str]) -> int:
    """`python -m MODULE ARGS` or `python SCRIPT ARGS` in this process; its exit code, after what the interpreter does
    on exit (joining threads, atexit functions, flushing)."""
    import runpy
    import threading

    code = 0
    try:
        if target[0] == "-m":
            sys.argv = [target[1], *args]
            sys.path[0] = os.getcwd()
            runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target[0], *args]
            sys.path[0] = str(Path(target[0]).resolve().parent)
            runpy.run_path(target[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        code = 1
    threading._shutdown()  # the interpreter's exit: non-daemon threads first, then atexit
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    return code


class Zygotes:
    """The pair of zygotes of one pytest process, started on first use."""

    def __init__(self, env: dict[str, str], cwd: Path):
        self.env = dict(env)
        self.folder = Path(tempfile.mkdtemp(prefix="rlx-zygote-"))
        self.procs: list[subprocess.Popen] = []
        self.paths: list[str] = []
        for i, seed in enumerate(random.sample(range(1, 2**31), 2)):
            path = str(self.folder / f"z{i}.sock")
            env = {**self.env, "PYTHONHASHSEED": str(seed)}
            command = [sys.executable, "-c", f"from tests.zygote import serve; serve({path!r})"]
            self.procs.append(
                subprocess.Popen(command, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
            )
            self.paths.append(path)

    def usable_for(self, env: dict[str, str]) -> bool:
        """Whether a run in `env` sees the zygotes' values of the variables read at import time."""
        return _same_imports(env, self.env)

    def shim_env(self, env: dict[str, str]) -> dict[str, str]:
        """`env` with an `rlx` first on PATH that runs each command as a child of a zygote (on its caller's stdin,
        stdout and stderr, with its exit code), or as `python -m rlx` where the environment differs."""
        shim = self.folder / "bin" / "rlx"
        if not shim.exists():
            shim.parent.mkdir(exist_ok=True)
            shim.write_text(_SHIM.replace("PYTHON", sys.executable))
            shim.chmod(0o755)
        path = f"{shim.parent}{os.pathsep}{env.get('PATH', '')}"
        return {**env, "PATH": path, "RLX_TEST_ZYGOTE_SOCKET": self.paths[0]}

    def _connect(self, path: str, deadline: float) -> socket.socket:
        while not os.path.exists(path):
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError("a test zygote exited while importing (run with RLX_TEST_ZYGOTE=0 to see why)")
            if time.monotonic() > deadline:
                raise TimeoutError("the test zygotes did not start")
            time.sleep(0.05)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
        return conn

    def run(self, n: int, target: list[str], args: list[str], env: dict[str, str], cwd: Path, timeout: float):
        """Ranks 0..n-1 of `target ARGS` (rank r from zygote r % 2); a CompletedProcess of the run, as
        `subprocess.run(torchrun ..., capture_output=True, text=True)` gives (exit code 1 when a rank failed)."""
        out = self.folder / f"run-{uuid.uuid4().hex}"  # rank r writes OUT.r.out and OUT.r.err
        # the launcher's store, as torchrun's agent holds it for its ranks (TORCHELASTIC_USE_AGENT_STORE)
        store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                           timeout=datetime.timedelta(seconds=timeout))  # fmt: skip
        port = store.port
        start = time.monotonic()
        base = {"target": target, "args": args, "env": env, "cwd": str(cwd), "out": str(out), "world": n, "port": port,
                "run_id": uuid.uuid4().hex}  # fmt: skip
        groups = []
        for z, path in enumerate(self.paths):
            ranks = list(range(z, n, len(self.paths)))
            if ranks:
                conn = self._connect(path, start + 120)
                socket.send_fds(conn, [b"R"], [])
                conn.sendall((json.dumps({**base, "ranks": ranks}) + "\n").encode())
                groups.append(_Group(conn))
        try:
            failed = _wait(groups, start + timeout)
        except subprocess.TimeoutExpired:
            raise subprocess.TimeoutExpired(["torchrun", *target, *args], timeout) from None
        finally:
            for group in groups:
                group.conn.close()
            del store
        streams = []
        for suffix in ("out", "err"):  # the ranks' output one after the other (lines never interleaved)
            files = [Path(f"{out}.{rank}.{suffix}") for rank in range(n)]
            streams.append("".join(f.read_text(errors="replace") for f in files if f.exists()))
            for f in files:
                f.unlink(missing_ok=True)
        return subprocess.CompletedProcess(["torchrun", *target, *args], int(failed), *streams)

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


_SHIM = """#!PYTHON -S
# rlx, run as a child of a test zygote (tests/zygote.py): this process passes it its stdio and waits for the exit code
import json, os, signal, socket, sys

command = ["PYTHON", "-m", "rlx", *sys.argv[1:]]
try:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(os.environ["RLX_TEST_ZYGOTE_SOCKET"])
    socket.send_fds(conn, [b"P"], [0, 1, 2])
    request = {"target": ["-m", "rlx"], "args": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()}
    conn.sendall((json.dumps(request) + "\\n").encode())
    data = b""
    while b"\\n" not in data:
        chunk = conn.recv(64)
        if not chunk:
            break
        data += chunk
except OSError:
    os.execv(command[0], command)
first, _, rest = data.partition(b"\\n")
if first != b"" and first != b"no":
    group = int(first)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, _: os.killpg(group, s))
    while True:
        chunk = conn.recv(64)
        if not chunk:
            break
        rest += chunk
    sys.exit(int(rest) if rest.strip() else 1)
os.execv(command[0], command)
"""


class _Group:
    """A group leader's connection: the first line its process group, the second (then end of file) its result."""

    def __init__(self, conn: socket.socket):
        self.conn, self.data = conn, b""
        while b"\n" not in self.data:
            chunk = conn.recv(64)
            if not chunk:
                raise RuntimeError("a test zygote closed a run's connection before starting it")
            self.data += chunk
        first, self.data = self.data.split(b"\n", 1)
        self.pgid = int(first)

    def read(self) -> bool:
        """Take what arrived; whether the leader is done (end of file)."""
        chunk = self.conn.recv(64)
        self.data += chunk
        return not chunk

    @property
    def failed(self) -> bool:
        text = self.data.strip()
        return not text or int(text) != 0  # no result: the leader was killed

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, sig)


def _wait(groups: list[_Group], deadline: float) -> bool:
    """Whether a group failed, once all are done; after the first failure the other groups get SIGTERM (SIGKILL after
    the grace period), as torchrun's agent treats the other ranks. Past `deadline`: all killed, TimeoutExpired."""
    failed, pending, stop_at = False, list(groups), None
    while pending:
        ready, _, _ = select.select([g.conn for g in pending], [], [], _POLL_S)
        for group in [g for g in pending if g.conn in ready]:
            if group.read():
                pending.remove(group)
                if group.failed and not failed:
                    failed, stop_at = True, time.monotonic() + _GRACE_S
                    for other in pending:
                        other.signal(signal.SIGTERM)
        now = time.monotonic()
        if pending and ((stop_at is not None and now > stop_at) or now > deadline):
            for other in pending:
                other.signal(signal.SIGKILL)
            if now > deadline:
                raise subprocess.TimeoutExpired("torchrun", 0)
            stop_at = None
    return failed
