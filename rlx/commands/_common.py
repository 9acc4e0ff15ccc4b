"""What every command shares: user-error reporting, and small option helpers. No torch import."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

import typer

from rlx.errors import Terminated, UserError
from rlx.utils.files import describe_io_error


@contextlib.contextmanager
def reporting(command: str, on_interrupt: str | Callable[[], str] = "", beats: bool = False) -> Iterator[None]:
    """Turn UserErrors and I/O failures (full disk, read-only folder...) into one line on stderr and exit code 1;
    Ctrl-C into exit code 130 and SIGTERM into 143, after the outputs' temporaries are removed (`on_interrupt`, or
    what it returns then, ends that line: e.g. how to continue). `beats`: a command that may work for long says
    'rlx COMMAND: still running (N s)' after 30 s and then every minute (the first process of a launcher only)."""
    finished = False
    try:
        with terminate_as_exception(), _heartbeat(command if beats else None):
            yield
        finished = True
    except UserError as e:
        _say(f"rlx {command}: error: {e}")
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        _say(f"rlx {command}: interrupted{_hint(on_interrupt)}")
        raise typer.Exit(130) from None
    except Terminated as e:
        _say(f"rlx {command}: {e}{_hint(on_interrupt)}")
        raise typer.Exit(143) from None
    except BrokenPipeError:  # `rlx rollout --out - | head`: the reader went away
        sys.stderr.close()
        raise typer.Exit(0) from None
    except Exception as e:  # OSError, and writers' own errors (safetensors' SafetensorError) carrying the OS one
        message = _one_line(e)
        if message is None:
            raise
        _say(f"rlx {command}: error: {message}")
        raise typer.Exit(1) from None
    finally:
        if "torch.distributed" in sys.modules:  # only when a command used it: keeps --help free of torch
            from rlx.parallel.dist import teardown

            teardown(wait_for_others=finished)


@contextlib.contextmanager
def _heartbeat(command: str | None) -> Iterator[None]:
    if command is None or os.environ.get("RANK", "0") != "0":
        yield
        return
    from rlx.observe.tracking import heartbeat  # no torch

    with heartbeat(f"rlx {command}"):
        yield


def _hint(on_interrupt: str | Callable[[], str]) -> str:
    return on_interrupt() if callable(on_interrupt) else on_interrupt


def _say(line: str) -> None:
    """One line on stderr in one write: ranks sharing a terminal or pipe do not interleave mid-line (print writes the
    text and its newline separately)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _one_line(e: BaseException) -> str | None:
    """The one line for an I/O failure or a collective time-out, else None (a bug: its traceback is shown)."""
    described = describe_io_error(e)
    if described is not None:
        return described
    text = str(e)
    if isinstance(e, RuntimeError) and ("timed out" in text.lower() or "timeout" in text.lower()):
        return (
            f"a collective operation timed out ({text.splitlines()[0][:200]}); "
            f"another process probably failed or stalled: check its log"
        )
    return None


@contextlib.contextmanager
def terminate_as_exception() -> Iterator[None]:
    """While the block runs, SIGTERM (SLURM preemption, `kill`) raises Terminated in the main thread, so the
    outputs' temporaries are removed on the way out; a handler someone else installed is left alone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum, frame):
        raise Terminated("terminated by SIGTERM")

    previous = signal.getsignal(signal.SIGTERM)
    if previous not in (signal.SIG_DFL, None):
        yield
        return
    signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


LORA_OPTIONS = {
    "metavars": {"target_modules": "NAME", "target_parameters": "NAME"},
    "help_extra": {
        "target_modules": " Repeat the option for several names.",
        "target_parameters": " Repeat the option for several names.",
    },
}
"""How `rlx shard` and `rlx train-step` show LoraConfig's fields as --lora-* options (`nested_config`)."""


def build_config(cls, **values):
    """Construct a config dataclass from CLI options, mapping validation errors to the option name."""
    from rlx.config import ConfigError

    try:
        return cls(**values)
    except ConfigError as e:
        raise UserError(f"--{e.key.replace('_', '-')}: {e.message}") from None
