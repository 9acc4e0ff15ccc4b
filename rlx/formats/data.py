"""Which prompts a step uses: a cyclic walk over prompts.jsonl, optionally reshuffled every epoch.

`rlx ppo` and `rlx rollout --data-position/--num-prompts/--shuffle-seed` share this, so a shell
pipeline picks exactly the prompts the driver picks.

No prompt appears twice in one window of `count` consecutive positions: a window never holds more prompts
than the file (`check_window`), and a reshuffled epoch keeps each of the previous epoch's last `count - 1`
prompts far enough from its start (see `_epoch_order`), so a step that crosses an epoch boundary takes every
prompt at most once. Where the plain permutation already satisfies that, it is used unchanged.
"""

from __future__ import annotations

import heapq

import torch

from rlx.errors import UserError
from rlx.formats.records import PromptRecord
from rlx.utils.device import derive_seed


def check_window(count: int, num_records: int, where: str, key: str) -> None:
    """A step of `count` prompts from a file of `num_records` would repeat prompts: refuse, naming the setting."""
    if count > num_records:
        raise UserError(
            f"{key} = {count} but {where} holds {num_records} prompts: a step would take some prompt twice "
            f"(its samples would form one group of mixed copies); use at most {num_records} prompts per step"
        )


def take_prompts(
    records: list[PromptRecord], position: int, count: int, shuffle_seed: int | None = None
) -> list[PromptRecord]:
    """`count` prompts starting at absolute `position` of the endless epoch sequence.

    Epoch e visits every record once, in file order or (with `shuffle_seed`) in a permutation
    seeded by (shuffle_seed, e), adjusted so that no window of `count` positions repeats a record.
    """
    n = len(records)
    check_window(count, n, "the prompts file", "the number of prompts")
    out = []
    for pos in range(position, position + count):
        epoch, offset = divmod(pos, n)
        if shuffle_seed is None:
            out.append(records[offset])
        else:
            out.append(records[_epoch_order(n, shuffle_seed, count, epoch)[offset]])
    return out


_ORDERS: dict[tuple[int, int, int], dict[int, tuple[int, ...]]] = {}  # (n, seed, count) -> a few epochs' orders


def _epoch_order(n: int, seed: int, count: int, epoch: int) -> tuple[int, ...]:
    """Epoch `epoch`'s order of n records (each epoch depends on the one before: walked forward from the
    newest cached epoch at or before it, keeping the last few)."""
    cached = _ORDERS.setdefault((n, seed, count), {})
    if epoch in cached:
        return cached[epoch]
    start = max((e for e in cached if e < epoch), default=-1)
    order = cached.get(start)
    for e in range(start + 1, epoch + 1):
        order = _next_order(n, seed, count, e, order)
        cached[e] = order
        for old in sorted(cached)[:-4]:
            del cached[old]
    return order


def _next_order(n: int, seed: int, count: int, epoch: int, previous: tuple[int, ...] | None) -> tuple[int, ...]:
    """Epoch `epoch`'s seeded permutation, with each of the previous epoch's last count - 1 records (previous
    position i > n - count) held back to position i - (n - count) or later, which keeps any two visits of a
    record at least `count` positions apart. Greedy by permutation rank among the records allowed at each
    position; the previous epoch's own order is always a valid answer, so it never runs out (at position j,
    j + 1 + n - count >= j + 1 records are allowed)."""
    gen = torch.Generator().manual_seed(derive_seed("data", seed, epoch))
    order = torch.randperm(n, generator=gen).tolist()
    if previous is None or count <= 1:
        return tuple(order)
    slack = n - count
    earliest = {record: i - slack for i, record in enumerate(previous) if i - slack > 0}
    if all(earliest.get(record, 0) <= j for j, record in enumerate(order)):
        return tuple(order)
    rank = {record: r for r, record in enumerate(order)}
    waiting = sorted((at, rank[record], record) for record, at in earliest.items())
    ready = [(rank[record], record) for record in order if record not in earliest]
    heapq.heapify(ready)
    out, next_waiting = [], 0
    for j in range(n):
        while next_waiting < len(waiting) and waiting[next_waiting][0] <= j:
            heapq.heappush(ready, waiting[next_waiting][1:])
            next_waiting += 1
        out.append(heapq.heappop(ready)[1])
    return tuple(out)
