"""Splitting work: Karmarkar-Karp balancing across ranks and token-budget micro-batches."""

from __future__ import annotations

import random

import pytest

from rlx.parallel.batching import (
    balanced_partition,
    count_micro_batches,
    even_token_micro_batches,
    token_budget_micro_batches,
)
from rlx.parallel.dist import shard_range


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("equal_size", [False, True])
def test_partition_balances_skewed_lengths(k, equal_size):
    rng = random.Random(k)
    lengths = [rng.choice([8, 16, 32, 1024]) for _ in range(48)]  # a few very long samples
    parts = balanced_partition(lengths, k, equal_size)
    assert sorted(i for p in parts for i in p) == list(range(48))
    totals = [sum(lengths[i] for i in p) for p in parts]
    naive = [sum(lengths[i] for i in range(start, 48, k)) for start in range(k)]  # round-robin split
    assert max(totals) - min(totals) <= max(naive) - min(naive)
    lower_bound = max(sum(lengths) / k, max(lengths))  # no split can beat this
    if not equal_size:
        assert max(totals) <= 4 / 3 * lower_bound
    if equal_size:
        assert {len(p) for p in parts} == {48 // k}
    assert balanced_partition(lengths, k, equal_size) == parts  # deterministic


def test_partition_edge_cases():
    assert balanced_partition([5], 1) == [[0]]
    assert [sum(p and [1]) for p in balanced_partition([1, 1], 3)].count(0) == 1  # an empty part is allowed
    with pytest.raises(ValueError, match="equal parts"):
        balanced_partition([1, 2, 3], 2, equal_size=True)


def test_token_budget_micro_batches():
    assert token_budget_micro_batches([3, 4, 5, 10, 1, 1], 8) == [[0, 1], [2], [3], [4, 5]]
    batches = token_budget_micro_batches([7] * 10, 21)
    assert batches == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert count_micro_batches(7, 3) == [[0, 1, 2], [3, 4, 5], [6]]


def test_even_token_micro_batches_split_the_work_evenly_within_the_budget():
    lengths = [384] * 256  # the consecutive packing leaves a one-sample sliver: 85, 85, 85, 1
    assert [len(p) for p in token_budget_micro_batches(lengths, 32768)] == [85, 85, 85, 1]
    parts = even_token_micro_batches(lengths, 32768, 4)
    assert sorted(i for p in parts for i in p) == list(range(256)) and [len(p) for p in parts] == [64] * 4
    # another rank's 3 parts' worth, asked for the busiest rank's 4: four near-equal parts, no idle micro-batch
    parts = even_token_micro_batches([300, 100, 250, 384, 384, 200, 150], 800, 4)
    sums = [sum([300, 100, 250, 384, 384, 200, 150][i] for i in p) for p in parts]
    assert len(parts) == 4 and all(p for p in parts) and max(sums) <= 800 and max(sums) - min(sums) <= 200
    assert even_token_micro_batches([10, 10], 100, 3) is None  # fewer samples than micro-batches
    assert even_token_micro_batches([900, 10, 10], 500, 2) is None  # a sample over the budget: keep the packing


def test_shard_range_covers_everything_once():
    for count in range(0, 11):
        for world in (1, 2, 3, 4):
            ranges = [shard_range(count, r, world) for r in range(world)]
            assert [i for r in ranges for i in r] == list(range(count))
            assert max(len(r) for r in ranges) - min(len(r) for r in ranges) <= 1
