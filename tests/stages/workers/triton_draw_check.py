"""Subprocess of tests/stages/test_rollout.py (TRITON_INTERPRET=1 must be set before triton is imported): the GPU's draw
kernels against the float64 reference, with the factor as an argument and read from memory; prints ok."""

import torch

from rlx.kernels.sampling import SLICE, draw_tokens_triton
from rlx.rollout.sampling import draw_tokens_torch

g = torch.Generator().manual_seed(0)
vocab = 2 * SLICE + 1000  # two full slices and a partial one
x = torch.randn(8, vocab, generator=g) * 3
x[1, SLICE:] = float("-inf")  # filtered tokens (top-k / top-p): whole slices without probability
x[2, :] = float("-inf")
x[2, 5] = 0.0  # one token left
x[3, 7] = x[3, SLICE + 9] = 40.0  # the max twice, in two slices: the first one is the argmax
x[4, SLICE - 1] = 30.0
x[4, SLICE] = 30.0  # two tokens hold (almost) all the mass, across a slice boundary
u = torch.tensor([0.0, 0.3, 0.7, 0.999999, 0.49999, 0.5, 0.9, 0.12], dtype=torch.float64)
scale = float(torch.tensor(1.0) / torch.tensor(0.7))
tokens, argmax, lse, entropy = draw_tokens_triton(x.bfloat16(), u, scale)
scaled = x.bfloat16().float() * scale
assert tokens.tolist() == draw_tokens_torch(scaled, u).tolist(), (tokens, draw_tokens_torch(scaled, u))
assert argmax.tolist() == scaled.argmax(-1).tolist() and argmax[3] == 7
assert torch.allclose(lse, torch.logsumexp(scaled, -1), rtol=1e-5)
log_p = torch.log_softmax(scaled, -1)
want = -(log_p.exp() * torch.where(log_p.isinf(), 0.0, log_p)).sum(-1)  # filtered tokens: 0 * log 0 = 0
assert torch.allclose(entropy, want, rtol=1e-4, atol=1e-5), (entropy, want)
assert tokens[4] in (SLICE - 1, SLICE) and tokens[2] == 5
# the factor read from memory (the native engine's captured draw) gives the same bits as the argument
from_memory = draw_tokens_triton(x.bfloat16(), u, torch.tensor([scale], dtype=torch.float32))
assert all(torch.equal(a, b) for a, b in zip(from_memory, (tokens, argmax, lse, entropy)))
print("ok")
