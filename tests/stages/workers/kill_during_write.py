"""Subprocess of tests/stages/test_ppo.py (argv: the rlx command line): `rlx ...` whose checkpoint writer, at step 4,
writes half of the step's files and then kills its own process with SIGKILL (from the writer thread)."""

import os
import signal
import sys

from rlx.checkpoints import single
from rlx.cli import main

write_files = single.write_files


def dying(folder, weights, aux, meta, optimizer=None):
    if meta.step == 4 and folder.name != "critic":  # half of step 4's files, then a kill -9 in the writer thread
        (folder / "config.json").write_bytes(aux["config.json"])
        os.kill(os.getpid(), signal.SIGKILL)
    write_files(folder, weights, aux, meta, optimizer)


single.write_files = dying
sys.argv = ["rlx", *sys.argv[1:]]
main()
