"""torchrun worker (CPU, gloo): several `rlx` commands one after the other in each launched process, so a test pays the
interpreter start-up and the imports (torch, transformers, megatron-core) once for all of them instead of once per
command.

argv: the commands' arguments, separated by `--then` (`train-step --checkpoint A ... --then train-step ...`). Each
command runs through rlx's own typer app, as `python -m rlx` runs it, and leaves the process group at its end. Before
each, this worker joins the launch's group under a key prefix of that command's own in the launcher's store: a second
group joined under the first one's keys would read the first group's stale gloo addresses. megatron-core's
model-parallel groups, which rlx keeps for the life of a process (a process normally runs one command), are dropped
after each command so the next may use other degrees. The first failing command ends the process with its exit
code."""

import datetime
import os
import sys

import torch
import torch.distributed as dist

from rlx.cli import app
from rlx.parallel.dist import collective_timeout_s, exit_process, group_collectives
from rlx.utils.allocator import configure_pinned_memory
from rlx.utils.cache import configure_compile_caches


def split_commands(argv: list[str]) -> list[list[str]]:
    commands = [[]]
    for arg in argv:
        if arg == "--then":
            commands.append([])
        else:
            commands[-1].append(arg)
    return commands


def join_group(index: int) -> None:
    """The default process group of command `index` over every launched process, as rlx's setup would make it."""
    timeout = datetime.timedelta(seconds=collective_timeout_s())
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    prefixed = dist.PrefixStore(f"rlx_commands/{index}", store)
    dist.init_process_group(group_collectives(torch.device("cpu")), store=prefixed, rank=rank, world_size=world,
                            timeout=timeout)  # fmt: skip


def run_command(args: list[str]) -> int:
    try:
        app(args, prog_name="rlx")
    except SystemExit as e:
        code = e.code
    else:
        code = 0
    if "megatron.core.parallel_state" in sys.modules:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        # megatron-core 0.16's destroy keeps these two rank lists, which a later initialisation sets only on the ranks
        # in an embedding group: a rank outside it (a middle pipeline stage) would take itself for one of its members
        parallel_state._EMBEDDING_GLOBAL_RANKS = None
        parallel_state._POSITION_EMBEDDING_GLOBAL_RANKS = None
    return code if isinstance(code, int) else (0 if code is None else 1)


configure_compile_caches()
configure_pinned_memory()
for index, command in enumerate(split_commands(sys.argv[1:])):
    join_group(index)
    code = run_command(command)
    if code:
        exit_process(code)
exit_process(0)
