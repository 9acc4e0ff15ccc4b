"""How samples are split: across data-parallel ranks by work, and into micro-batches by token budget.

- `balanced_partition`: a Karmarkar-Karp (largest differencing) split of sample lengths into k parts
  of near-equal total work; with `equal_size` every part gets the same number of samples (the batch
  size must divide). Deterministic for the same inputs.
- `token_budget_micro_batches`: consecutive groups of samples whose token count stays within a budget
  (a sample longer than the budget gets a micro-batch of its own), in the order given.
- `even_token_micro_batches`: exactly `count` groups of near-equal token totals within the budget: every
  data-parallel rank then runs the same number of micro-batches (the collectives stay in step) without a rank
  running a whole micro-batch for nothing, and no micro-batch is a sliver left over by the consecutive packing.
- Callers keep the index lists, so per-sample results are put back in the original order.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass(order=True)
class _State:
    """k partial sets, kept sorted by decreasing sum; the heap pops the largest spread first."""

    sort_key: tuple
    sums: list[float] = field(compare=False)
    items: list[list[int]] = field(compare=False)


def _state(sums: list[float], items: list[list[int]], tiebreak: int) -> _State:
    order = sorted(range(len(sums)), key=lambda i: (-sums[i], min(items[i], default=-1)))
    sums = [sums[i] for i in order]
    items = [items[i] for i in order]
    return _State((-(sums[0] - sums[-1]), tiebreak), sums, items)


def balanced_partition(weights: list[float], k: int, equal_size: bool = False) -> list[list[int]]:
    """Indices of `weights` split into k parts with near-equal sums (Karmarkar-Karp).

    Each part's indices come back sorted; parts are ordered by their smallest index. With
    `equal_size`, len(weights) must be a multiple of k and every part gets len // k indices.
    """
    n = len(weights)
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    if equal_size and n % k:
        raise ValueError(f"{n} samples cannot be split into {k} equal parts")
    order = sorted(range(n), key=lambda i: (-weights[i], i))
    heap: list[_State] = []
    if equal_size:  # start from groups of k items, one per set, so every merge keeps the sizes equal
        for start in range(0, n, k):
            group = order[start : start + k]
            heap.append(_state([weights[i] for i in group], [[i] for i in group], start))
    else:
        for rank, i in enumerate(order):
            heap.append(_state([weights[i]] + [0.0] * (k - 1), [[i]] + [[] for _ in range(k - 1)], rank))
    heapq.heapify(heap)
    tiebreak = n
    while len(heap) > 1:
        a, b = heapq.heappop(heap), heapq.heappop(heap)
        # pair a's largest set with b's smallest: the spreads cancel
        sums = [a.sums[j] + b.sums[k - 1 - j] for j in range(k)]
        items = [a.items[j] + b.items[k - 1 - j] for j in range(k)]
        heapq.heappush(heap, _state(sums, items, tiebreak))
        tiebreak += 1
    parts = [sorted(p) for p in heap[0].items] if heap else [[] for _ in range(k)]
    return sorted(parts, key=lambda p: (p[0] if p else n, len(p)))


def token_budget_micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Consecutive index groups of at most `max_tokens` tokens each (one oversized sample alone)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    batches: list[list[int]] = []
    current, used = [], 0
    for i, length in enumerate(lengths):
        if current and used + length > max_tokens:
            batches.append(current)
            current, used = [], 0
        current.append(i)
        used += length
    if current:
        batches.append(current)
    return batches


def even_token_micro_batches(lengths: list[int], max_tokens: int, count: int) -> list[list[int]] | None:
    """`count` index groups of near-equal token totals (`balanced_partition`), each within `max_tokens` and none
    empty; None where there are fewer samples than groups or a group would pass the budget (a caller then keeps
    `token_budget_micro_batches`' groups)."""
    if count < 1 or len(lengths) < count:
        return None
    parts = balanced_partition(lengths, count)
    if any(sum(lengths[i] for i in part) > max_tokens for part in parts):
        return None
    return parts


def count_micro_batches(size: int, micro_batch_size: int) -> list[list[int]]:
    """Consecutive index groups of `micro_batch_size` samples (the last may be smaller)."""
    return [list(range(lo, min(lo + micro_batch_size, size))) for lo in range(0, size, micro_batch_size)]
