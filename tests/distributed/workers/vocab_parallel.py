"""torchrun worker of tests/unit/test_kernels.py (argv: one or more of chunked, triton; for triton the test sets
TRITON_INTERPRET=1): vocab-parallel logprob + entropy over 2 or 4 vocabulary shards equals the naive formula on the
full vocabulary, values and gradients, for each implementation in turn (one process start-up for all)."""

import sys

import torch.distributed as dist

from rlx.kernels.logprob_entropy import naive_logprob_entropy, vocab_parallel_logprob_entropy
from rlx.parallel.dist import exit_process
from tests.unit.test_kernels import problem, run

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
hidden, weight, targets, up = problem(n=21, h=16, v=103)
want = run(lambda h, w, t: naive_logprob_entropy(h, w, t, 0.8), hidden, weight, targets, up)
bounds = [0, 40, 103] if world == 2 else [0, 30, 55, 80, 103]
lo, hi = bounds[rank], bounds[rank + 1]
for impl in sys.argv[1:]:
    shard = weight.detach()[lo:hi].clone().requires_grad_()
    h = hidden.detach().clone().requires_grad_()
    got = run(
        lambda h_, w_, t, impl=impl: vocab_parallel_logprob_entropy(
            h_, w_, t, lo, temperature=0.8, chunk=17, impl=impl
        ),
        h,
        shard,
        targets,
        up,
    )
    err = max((got[i] - want[i]).abs().max().item() for i in range(3))
    err = max(err, (got[3] - want[3][lo:hi]).abs().max().item())
    assert err < 1e-5, (impl, rank, err)
    print(f"rank {rank}: {impl} ok", flush=True)
dist.barrier()
dist.destroy_process_group()
exit_process(0)
