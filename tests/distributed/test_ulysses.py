"""Ulysses sequence parallelism: 2 and 4 gloo ranks on CPU give the logits and gradients of one rank."""

from __future__ import annotations

import textwrap

import pytest
import torch

from rlx.errors import UserError
from rlx.models.attention import pack
from rlx.parallel.ulysses import padded_length, shard_packed, slice_sequence, validate_sp
from tests.conftest import REPO, run_torchrun
from tests.unit.test_packing import tiny_config

SEQUENCE_PARALLEL = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    sys.path.insert(0, {repo!r})
    from rlx.parallel.ulysses import (enable_ulysses_attention, gather_sequence, sequence_parallel_forward,
                                             slice_sequence)
    from rlx.parallel.dist import exit_process
    from rlx.models.attention import next_token_targets, pack
    from tests.unit.test_packing import tiny_model

    dist.init_process_group("gloo")
    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    # 15 tokens: not a multiple of 2 or 4, so a padding sample rides along at the end
    packed = pack([[1, 5, 6, 7, 8], [1, 10, 11, 12], [1, 3, 4, 5, 6, 7]])
    targets = next_token_targets(packed)  # [1, T], -100 at each sample's last token
    weights = torch.randn(1, packed.total_len, 19, generator=torch.Generator().manual_seed(3))

    def grads(model):
        out = {{n: p.grad.clone() for n, p in model.named_parameters()}}
        model.zero_grad()
        return out

    def local_logprob(logits, targets):
        picked = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return picked * (targets != -100)

    def check(name, got, want):
        for key in want:
            err = (got[key] - want[key]).abs().max().item()
            assert err < 1e-5, (name, world, rank, key, err)

    for family, num_kv_heads in [("llama", 2), ("qwen2", 1), ("qwen3", 2)]:
        case = f"{{family}} kv={{num_kv_heads}}"
        model = tiny_model(family, num_kv_heads=num_kv_heads)
        enable_ulysses_attention(model)
        # SP=1: the whole row on this rank
        full = sequence_parallel_forward(model, packed)
        (full * weights).sum().backward()
        want_grads = grads(model)
        want_logprob = local_logprob(sequence_parallel_forward(model, packed), targets)
        want_logprob.sum().backward()
        want_logprob_grads = grads(model)

        # the same loss on the gathered logits on every rank; gradients summed over the SP ranks
        logits = sequence_parallel_forward(model, packed, group)
        check(case + " logits", {{"logits": logits}}, {{"logits": full}})
        (logits * weights).sum().backward()
        got = grads(model)
        for g in got.values():
            dist.all_reduce(g)
        check(case + " grads", got, want_grads)

        # the trainer's way: local logits -> local logprobs of local targets -> gather only the logprobs
        local = sequence_parallel_forward(model, packed, group, gather=False)
        logprob = local_logprob(local, slice_sequence(targets, rank, world, -100))
        gathered = gather_sequence(logprob, group)[:, : packed.total_len]
        check(case + " logprobs", {{"lp": gathered}}, {{"lp": want_logprob}})
        logprob.sum().backward()
        got = grads(model)
        for g in got.values():
            dist.all_reduce(g)
        check(case + " logprob grads", got, want_logprob_grads)
    dist.barrier()  # gloo: a rank that tears down while a peer still reads its last message aborts the peer
    dist.destroy_process_group()
    exit_process(0)  # no interpreter finalization while gloo threads release tensors
""")


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_equals_one_rank(tmp_path, world):
    script = tmp_path / "sp.py"
    script.write_text(SEQUENCE_PARALLEL.format(repo=str(REPO)))
    run_torchrun(world, script, timeout=300)


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
