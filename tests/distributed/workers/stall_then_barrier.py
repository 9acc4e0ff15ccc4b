"""torchrun worker of tests/unit/test_devices.py: rank 1 stalls before a barrier the other ranks wait at, so their
collective times out (after RLX_COLLECTIVE_TIMEOUT_S) and `reporting` turns it into one line and an exit code."""

import sys
import time

import typer

from rlx.commands._common import reporting
from rlx.parallel.dist import barrier, setup

try:
    with reporting("test"):
        ctx = setup("cpu")
        if ctx.rank == 1:
            time.sleep(60)
        barrier()
except typer.Exit as e:
    sys.exit(e.exit_code)
