"""How fast each rank writes its checkpoint shards with torch.distributed.checkpoint (the 'fsdp' layout's write),
by writer threads per rank and fsync: every rank of a torchrun launch holds --gb GB of float32 tensors in pinned
host memory (the snapshot the background writer takes) and writes them to its own folder under --dir, all ranks at
once, one configuration after another.

    torchrun --nproc_per_node 4 bench/checkpoint_write.py --gb 8 --dir /tmp/ckw
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=8.0, help="GB per rank")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/ckw"))
    parser.add_argument("--threads", default="1,4,16")
    parser.add_argument("--sync", default="1,0", help="fsync the files: 1, 0 or both")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    chunk = 50_000_000  # 200 MB float32 tensors, like a 7B model's larger shards
    count = max(1, int(args.gb * 1e9 / 4 / chunk))
    state = {f"t{i}": torch.full((chunk,), float(i), pin_memory=torch.cuda.is_available()) for i in range(count)}
    gb = count * chunk * 4 / 1e9
    for sync in map(int, args.sync.split(",")):
        for threads in map(int, args.threads.split(",")):
            folder = args.dir / f"t{threads}-s{sync}" / f"rank{rank}"
            folder.mkdir(parents=True, exist_ok=True)
            dist.barrier()
            start = time.perf_counter()
            writer = dcp.FileSystemWriter(folder, thread_count=threads, sync_files=bool(sync))
            dcp.save({"model": state}, storage_writer=writer, no_dist=True)
            mine = time.perf_counter() - start
            dist.barrier()
            everyone = time.perf_counter() - start
            slowest = [0.0] * dist.get_world_size()
            dist.all_gather_object(slowest, mine)
            if rank == 0:
                world = dist.get_world_size()
                print(f"threads {threads:>2} fsync {sync}: {gb:.1f} GB per rank x {world}: done in {everyone:.1f} s "
                      f"({gb * world / everyone:.2f} GB/s in all; ranks {min(slowest):.1f}-{max(slowest):.1f} s)",
                      flush=True)  # fmt: skip
            dist.barrier()
            shutil.rmtree(folder, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
