"""Ulysses sequence parallelism: 2 and 4 gloo ranks on CPU give the logits and gradients of one rank."""

from __future__ import annotations

import pytest
import torch

from rlx.errors import UserError
from rlx.models.attention import pack
from rlx.parallel.ulysses import padded_length, shard_packed, slice_sequence, validate_sp
from tests.conftest import WORKERS, run_torchrun
from tests.unit.test_packing import tiny_config


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_equals_one_rank(world):
    run_torchrun(world, WORKERS / "ulysses.py", timeout=300)


def test_validate_sp_names_the_head_counts():
    with pytest.raises(UserError, match=r"3 attention heads .*sp_degree=2"):
        validate_sp(tiny_config("llama", num_attention_heads=3, num_kv_heads=3, hidden_size=48), 2)
    with pytest.raises(UserError, match=r"3 key/value heads .*sp_degree=2"):
        validate_sp(tiny_config("llama", num_attention_heads=6, num_kv_heads=3, hidden_size=96), 2)
    for sp_degree in (1, 2, 4):  # 4 query heads; 2 kv heads are scattered (2) or repeated (4)
        validate_sp(tiny_config("llama"), sp_degree)
    with pytest.raises(UserError, match="sp_degree=8"):
        validate_sp(tiny_config("llama"), 8)


def test_shard_packed_pads_with_a_sample_of_its_own():
    packed = pack([[4, 5, 6], [7, 8]])
    shards = [shard_packed(packed, rank, 4, pad_id=0) for rank in range(4)]
    assert padded_length(5, 4) == 8 and all(s.total_len == 8 for s in shards)
    assert torch.cat([s.input_ids for s in shards], 1).tolist() == [[4, 5, 6, 7, 8, 0, 0, 0]]
    assert torch.cat([s.position_ids for s in shards], 1).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert shards[0].cu_seqlens.tolist() == [0, 3, 5, 8]
    assert slice_sequence(torch.arange(5).view(1, 5), 2, 4, pad_value=-1).tolist() == [[4, -1]]
    assert shard_packed(pack([[4, 5], [6, 7]]), 1, 2).cu_seqlens.tolist() == [0, 2, 4]  # no padding needed
