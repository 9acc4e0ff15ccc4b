"""Subprocess of tests/unit/test_paged_attention.py (TRITON_INTERPRET=1 must be set before triton is imported): the
Triton paged decode attention kernel against the PyTorch reference; prints the worst error."""

import torch

from rlx.kernels.paged_attention import paged_decode_attention_torch, paged_decode_attention_triton, write_kv
from tests.unit.test_paged_attention import make_problem, rope_error

worst = 0.0
for lens, heads, kv_heads, head_dim, block_size, block_n in [
    ([1, 4, 8, 13, 0], 4, 2, 32, 4, 16),  # context 0 gives zeros in both
    ([1, 16, 37], 14, 2, 64, 16, 32),  # Qwen2-0.5B heads, several steps per sequence
    ([3, 10], 6, 2, 24, 3, 16),  # padded head_dim, group of 3, block_size not a power of 2
]:
    q, kc, vc, tables, ctx = make_problem(lens, heads, kv_heads, head_dim, block_size)
    want = paged_decode_attention_torch(q, kc, vc, tables, ctx, head_dim**-0.5)
    got = paged_decode_attention_triton(q, kc, vc, tables, ctx, head_dim**-0.5, block_n=block_n)
    worst = max(worst, (got - want).abs().max().item())
# the kernel writes each sequence's new key and value at its last position first (new_kv), as write_kv does
q, kc, vc, tables, ctx = make_problem([5, 12, 1], 4, 2, 32, 4)
slots = torch.stack([tables[b, (n - 1) // 4].long() * 4 + (n - 1) % 4 for b, n in enumerate(ctx.tolist())])
new_k, new_v = torch.randn(2, 3, 2, 32).unbind(0)
kc2, vc2 = kc.clone(), vc.clone()
got = paged_decode_attention_triton(q, kc, vc, tables, ctx, 0.2, block_n=16, new_kv=(new_k, new_v, slots))
write_kv(kc2, vc2, slots, new_k, new_v)
want = paged_decode_attention_torch(q, kc2, vc2, tables, ctx, 0.2)
assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
worst = max(worst, (got - want).abs().max().item())
# flash-decoding: contexts split in 2 and 3 parts (a part may be empty), combined by the reduce kernel
q, kc, vc, tables, ctx = make_problem([5, 40, 1, 33, 0], 4, 2, 32, 4)
want = paged_decode_attention_torch(q, kc, vc, tables, ctx, 0.2)
for splits in (2, 3):
    got = paged_decode_attention_triton(q, kc, vc, tables, ctx, 0.2, block_n=16, num_splits=splits)
    worst = max(worst, (got - want).abs().max().item())
worst = max(worst, rope_error(paged_decode_attention_triton, block_n=16))
print(worst)
