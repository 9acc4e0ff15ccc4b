"""torchrun worker of tests/distributed/test_ulysses.py: Ulysses sequence parallelism over the world gives one rank's
logits, logprobs and (summed) gradients for tiny Llama, Qwen2 and Qwen3."""

import torch
import torch.distributed as dist

from rlx.models.attention import next_token_targets, pack
from rlx.parallel.dist import exit_process
from rlx.parallel.ulysses import enable_ulysses_attention, gather_sequence, sequence_parallel_forward, slice_sequence
from tests.unit.test_packing import tiny_model

dist.init_process_group("gloo")
group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
# 15 tokens: not a multiple of 2 or 4, so a padding sample rides along at the end
packed = pack([[1, 5, 6, 7, 8], [1, 10, 11, 12], [1, 3, 4, 5, 6, 7]])
targets = next_token_targets(packed)  # [1, T], -100 at each sample's last token
weights = torch.randn(1, packed.total_len, 19, generator=torch.Generator().manual_seed(3))


def grads(model):
    out = {n: p.grad.clone() for n, p in model.named_parameters()}
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
    case = f"{family} kv={num_kv_heads}"
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
    check(case + " logits", {"logits": logits}, {"logits": full})
    (logits * weights).sum().backward()
    got = grads(model)
    for g in got.values():
        dist.all_reduce(g)
    check(case + " grads", got, want_grads)

    # the trainer's way: local logits -> local logprobs of local targets -> gather only the logprobs
    local = sequence_parallel_forward(model, packed, group, gather=False)
    logprob = local_logprob(local, slice_sequence(targets, rank, world, -100))
    gathered = gather_sequence(logprob, group)[:, : packed.total_len]
    check(case + " logprobs", {"lp": gathered}, {"lp": want_logprob})
    logprob.sum().backward()
    got = grads(model)
    for g in got.values():
        dist.all_reduce(g)
    check(case + " logprob grads", got, want_logprob_grads)
dist.barrier()  # gloo: a rank that tears down while a peer still reads its last message aborts the peer
dist.destroy_process_group()
exit_process(0)  # no interpreter finalization while gloo threads release tensors
