"""Subprocess of tests/stages/test_io_failures.py (argv: LIMIT_BYTES COMMANDS_JSON): each rlx command in turn, in this
one process (one interpreter start-up for all), with every file it writes limited to LIMIT_BYTES (RLIMIT_FSIZE; Python
ignores SIGXFSZ, so a write past the limit fails with EFBIG as a full disk fails with ENOSPC). Prints one JSON line per
command: its exit code and what it wrote to stderr (a traceback included, should one escape)."""

import contextlib
import io
import json
import resource
import sys
import traceback

from rlx.cli import app
from rlx.utils.allocator import configure_pinned_memory
from rlx.utils.cache import configure_compile_caches

limit, commands = int(sys.argv[1]), json.loads(sys.argv[2])
configure_compile_caches()  # as `rlx` itself does before a command
configure_pinned_memory()
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
for args in commands:
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            app(args, prog_name="rlx")
            code = 0
        except SystemExit as e:
            code = e.code
        except Exception:
            traceback.print_exc()
            code = -1
    print(json.dumps({"command": args[0], "code": code, "stderr": stderr.getvalue()}), flush=True)
