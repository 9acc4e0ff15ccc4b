"""Print what a process is given to compute with: OMP_NUM_THREADS, CPU affinity, torch's intra-/inter-op threads
(compare a plain process with one under `torchrun --nproc_per_node 1`)."""

import os

import torch

print(
    f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} cpus={len(os.sched_getaffinity(0))} "
    f"intra={torch.get_num_threads()} interop={torch.get_num_interop_threads()} world={os.environ.get('WORLD_SIZE')}"
)
