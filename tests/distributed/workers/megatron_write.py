"""torchrun worker of tests/stages/test_megatron_convert.py (argv: SOURCE OUT): 4 ranks (tp 2 x dp 2) write one megatron
checkpoint together; data-parallel replicas write nothing twice."""

import sys

import torch
import torch.distributed as dist

from rlx.checkpoints.files import aux_files
from rlx.checkpoints.megatron import read_rank_state, save_megatron_rank_checkpoint
from rlx.checkpoints.meta import CheckpointMeta
from rlx.parallel.dist import exit_process, setup

SOURCE, OUT = sys.argv[1], sys.argv[2]
ctx = setup("cpu")
tp_rank, dp_rank = ctx.rank % 2, ctx.rank // 2  # tp 2 x dp 2, tensor-parallel neighbours adjacent
state = read_rank_state(SOURCE, tp_rank, 0)
optimizer = {f"{n}::exp_avg": torch.full_like(v, float(dp_rank)) for n, v in state.items()}
meta = CheckpointMeta(layout="megatron", tp_degree=2, pp_degree=1, step=1)
save_megatron_rank_checkpoint(OUT, state, optimizer, aux_files(SOURCE), meta, ctx, tp_rank, 0, dp_rank)
dist.barrier()
dist.destroy_process_group()
exit_process(0)
