"""How fast each rank writes its checkpoint shards with torch.distributed.checkpoint (the 'fsdp' layout's write),
by writer threads per rank and fsync: every rank of a torchrun launch holds --gb GB of float32 tensors in pinned
host memory (the snapshot the background writer takes) and writes them to its own folder under --dir, all ranks at
once, one configuration after another.

    torchrun --nproc_per_node 4 bench/checkpoint_write.py --gb 8 --dir /tmp/ckw
    torchrun --nproc_per_node 4 bench/checkpoint_write.py --gb 6 --threads 8 --sync 0 --buffers own,views,aliases

--buffers: 'own' pins each tensor by itself; 'views' carves them out of pinned chunks as rlx's checkpoint buffers
(rlx/utils/host_copy.py), which DCP copies out before writing; 'aliases' gives DCP those views over storages of their
own size (`exact_storage`, what rlx's fsdp layout writes).
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
    parser.add_argument("--buffers", default="own", help="comma-separated: own, views, aliases")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    chunk = 50_000_000  # 200 MB float32 tensors, like a 7B model's larger shards
    count = max(1, int(args.gb * 1e9 / 4 / chunk))
    gb = count * chunk * 4 / 1e9
    for kind in args.buffers.split(","):
        state = buffers(kind, count, chunk)
        for sync in map(int, args.sync.split(",")):
            for threads in map(int, args.threads.split(",")):
                write(state, args.dir / f"{kind}-t{threads}-s{sync}" / f"rank{rank}", threads, sync, gb, kind)
        del state
    dist.destroy_process_group()


def buffers(kind: str, count: int, chunk: int) -> dict[str, torch.Tensor]:
    """`count` float32 tensors of `chunk` elements in pinned host memory, held as `kind` says (see the doc)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from rlx.utils import host_copy

    pinned = torch.cuda.is_available()
    if kind == "own":
        return {f"t{i}": torch.full((chunk,), float(i), pin_memory=pinned) for i in range(count)}
    if not pinned:
        host_copy._new_chunk = lambda n: torch.empty(n, dtype=torch.uint8)
    views = host_copy._carve({f"t{i}": (torch.Size([chunk]), torch.float32) for i in range(count)})
    for i, view in enumerate(views.values()):
        view.fill_(float(i))
    return views if kind == "views" else {k: host_copy.exact_storage(v) for k, v in views.items()}


def write(state: dict, folder: Path, threads: int, sync: int, gb: float, kind: str) -> None:
    """Every rank writes `state` into its `folder` at once; rank 0 prints the time."""
    rank = dist.get_rank()
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
        print(f"{kind}: threads {threads:>2} fsync {sync}: {gb:.1f} GB per rank x {world}: done in "
              f"{everyone:.1f} s ({gb * world / everyone:.2f} GB/s in all; ranks {min(slowest):.1f}-{max(slowest):.1f} "
              "s)", flush=True)  # fmt: skip
    dist.barrier()
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
