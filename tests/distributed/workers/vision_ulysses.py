"""torchrun worker of tests/unit/test_vision.py: Ulysses sequence parallelism with an image straddling the ranks equals
one rank for every tiny VLM family, and MLA's narrower values pass the all-to-alls."""

import torch
import torch.distributed as dist

from rlx.logprobs import PackedRows, packed_response_logprobs
from rlx.models.attention import pack
from rlx.models.vision.packing import VisionRow, vision_forward
from rlx.models.vision.tiny import build_tiny_vision_model
from rlx.parallel.dist import exit_process
from rlx.parallel.ulysses import enable_ulysses_attention, sequence_parallel_forward
from tests.unit.test_vision import FAMILY_NAMES, straddling_micro_batch, tiny_mla_model

dist.init_process_group("gloo")
group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()


def run(model, batch, sp_group):
    t = batch["tensors"]
    row = VisionRow.from_padded(**t, vision=batch["vision"], config=model.config)
    sp_rank, sp_degree = (rank, world) if sp_group is not None else (0, 1)
    rows = PackedRows.build(
        t["prompt_ids"], t["prompt_mask"], t["response_ids"], t["response_mask"], sp_rank, sp_degree
    )
    with vision_forward(model, row, sp_rank, sp_degree):
        logprob, entropy = packed_response_logprobs(
            model, **t, temperature=1.0, dtype=torch.float32, with_entropy=True, sp_group=sp_group, rows=rows
        )
    ((logprob + 0.1 * entropy) * t["response_mask"]).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logprob, entropy, grads, row


for name in FAMILY_NAMES:
    model, processor = build_tiny_vision_model(name)
    enable_ulysses_attention(model)
    batch = straddling_micro_batch(processor, world)  # an image's tokens straddle the ranks' boundary
    want_logprob, want_entropy, want_grads, row = run(model, batch, None)
    logprob, entropy, grads, _ = run(model, batch, group)
    torch.testing.assert_close(logprob, want_logprob, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, want_entropy, atol=1e-5, rtol=0)
    assert grads.keys() == want_grads.keys() and any(k.startswith("model.visual") for k in grads)
    for key, grad in grads.items():
        dist.all_reduce(grad)  # each rank's gradient covers its own tokens: the sum is the one-rank gradient
        where = f"{name} {key}"
        torch.testing.assert_close(
            grad, want_grads[key], atol=1e-5, rtol=1e-4, msg=lambda m, where=where: f"{where}: {m}"
        )

# MLA (Kimi's decoder): Ulysses all-to-alls carry values narrower than queries and keys

model = tiny_mla_model()
enable_ulysses_attention(model)
packed = pack([[1, 2, 3, 4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 14, 15]])
want = sequence_parallel_forward(model, packed)
got = sequence_parallel_forward(model, packed, group)
torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
dist.barrier()
dist.destroy_process_group()
exit_process(0)
