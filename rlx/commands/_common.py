"""What every command shares: user-error reporting, and small option helpers. No torch import."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import typer

from rlx.errors import UserError


@contextlib.contextmanager
def reporting(command: str, on_interrupt: str = "") -> Iterator[None]:
    """Turn UserErrors into one line on stderr and exit code 1; Ctrl-C into exit code 130."""
    finished = False
    try:
        yield
        finished = True
    except UserError as e:
        print(f"rlx {command}: error: {e}", file=sys.stderr)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        print(f"rlx {command}: interrupted{on_interrupt}", file=sys.stderr)
        raise typer.Exit(130) from None
    except BrokenPipeError:  # `rlx rollout --out - | head`: the reader went away
        sys.stderr.close()
        raise typer.Exit(0) from None
    except RuntimeError as e:
        if "timed out" in str(e).lower() or "timeout" in str(e).lower():
            print(
                f"rlx {command}: error: a collective operation timed out ({str(e).splitlines()[0][:200]}); "
                f"another process probably failed or stalled: check its log",
                file=sys.stderr,
            )
            raise typer.Exit(1) from None
        raise
    finally:
        if "torch.distributed" in sys.modules:  # only when a command used it: keeps --help free of torch
            from rlx.engine.parallel.dist import teardown

            teardown(wait_for_others=finished)


LORA_OPTIONS = {
    "metavars": {"target_modules": "NAME"},
    "help_extra": {"target_modules": " Repeat the option for several names."},
}
"""How `rlx shard` and `rlx train-step` show LoraConfig's fields as --lora-* options (`nested_config`)."""


def build_config(cls, **values):
    """Construct a config dataclass from CLI options, mapping validation errors to the option name."""
    from rlx.config import ConfigError

    try:
        return cls(**values)
    except ConfigError as e:
        raise UserError(f"--{e.key.replace('_', '-')}: {e.message}") from None
