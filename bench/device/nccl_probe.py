"""How fast the GPUs of a host exchange data through NCCL: all-gather and reduce-scatter bus bandwidth at the sizes
FSDP moves for the 0.5B and 7B shapes (one decoder layer's bf16 parameters, its float32 gradients), and the
transport NCCL chose (P2P over NVLink or PCIe, or SHM through host memory), so a scaling figure can be read against
the link it ran on. One process a GPU:

    NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT torchrun --nproc_per_node 4 bench/device/nccl_probe.py 2>&1 \
        | grep -E "probe|via (P2P|SHM|NET)" | sort -u

Bus bandwidth as nccl-tests counts it: the gathered bytes x (ranks - 1) / ranks / seconds.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

# 30 MB: a 0.5B layer in bf16, 128-512 MB: a 7B layer and its float32 gradients
SIZES_MB = (1, 8, 30, 128, 512) if torch.cuda.is_available() else (1, 8)
# torch 2.13 renamed both (the GPU image's 2.11 has only the old names)
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats: int = 10) -> float:
    for _ in range(3):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    cuda = torch.cuda.is_available()  # without a GPU: gloo on the CPU (a check of the script)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    for mb in SIZES_MB:
        numel = mb * 2**20 // 2 // world * world  # bf16 elements of the gathered tensor
        whole = torch.empty(numel, dtype=torch.bfloat16, device=device)
        part = torch.ones(numel // world, dtype=torch.bfloat16, device=device)
        gather = timed(lambda w=whole, p=part: ALL_GATHER(w, p))
        scatter = timed(lambda w=whole, p=part: REDUCE_SCATTER(p, w))
        if rank == 0:
            bus = whole.numel() * 2 * (world - 1) / world / 1e9
            print(f"probe {world} ranks, {mb:>4} MB: all-gather {gather * 1e3:7.3f} ms ({bus / gather:6.1f} GB/s bus), "
                  f"reduce-scatter {scatter * 1e3:7.3f} ms ({bus / scatter:6.1f} GB/s bus)", flush=True)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
