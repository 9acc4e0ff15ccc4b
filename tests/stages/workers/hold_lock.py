"""Subprocess of tests/stages/test_run_safety.py (argv: RUN_DIR): takes the run folder's lock, says "locked" and holds
it for two minutes (the test kills it sooner)."""

import sys
import time
from pathlib import Path

from rlx.parallel.dist import DistContext
from rlx.ppo.start import RunLock

lock = RunLock.take(Path(sys.argv[1]), DistContext())
print("locked", flush=True)
time.sleep(120)
