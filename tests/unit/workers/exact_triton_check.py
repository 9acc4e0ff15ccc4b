"""Subprocess of tests/unit/test_exact_triton.py (TRITON_INTERPRET=1 must be set before triton is imported): exact
mode's Triton matmul and attention in Triton's interpreter. Each check raises on failure; prints 'ok' at the end.

- matmul: each row's result the same bits at batch 1, 3 and 17 (and at any position in the batch), close to F.linear;
  with a residual added in the kernel, the eager add's bits;
- attention: each (sequence, position)'s output the same bits from packed rows (batches of 1, 3 and 17 samples, in
  any order), padded rows, a paged cache's prefill and its decode; close to the PyTorch reference
  (`blocked_attention`);
- RMSNorm: each row's the same bits at batch 1, 3 and 17, close to the Llama-family RMSNorm, gradients too;
- log-probabilities: each row's the same bits at batch 1, 3 and 17, close to log_softmax (entropy too);
- the autograd paths: exact_linear's, exact_target_logprobs's and exact_packed_attention's gradients (recomputed by
  SDPA and by the varlen attention exact mode's models use) close to the reference's.
"""

import functools
import sys

import torch
import torch.nn.functional as F

from rlx.kernels import exact_triton
from rlx.kernels.exact import blocked_attention, key_slots
from rlx.kernels.exact_triton import (
    exact_attention,
    exact_linear,
    exact_logprobs,
    exact_matmul,
    exact_packed_attention,
    exact_rms_norm,
    exact_rms_norm_pair,
    exact_target_logprobs,
    inverse_temperature,
    split_k,
)
from rlx.kernels.sampling import draw_tokens_triton, picked_logprobs
from rlx.models.attention import varlen_attention

DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16}[sys.argv[1]]  # bfloat16: on CUDA only (see the test)
TOL = 1e-5 if sys.argv[1] == "float32" else 2e-2
g = torch.Generator().manual_seed(0)


def check_matmul() -> None:
    x = torch.randn(17, 40, generator=g).to(DTYPE)
    w, b = torch.randn(24, 40, generator=g).to(DTYPE), torch.randn(24, generator=g).to(DTYPE)
    full = exact_matmul(x, w, b)
    for size in (1, 3):
        for first in range(0, 17 - size + 1, 5):
            assert torch.equal(exact_matmul(x[first : first + size], w, b), full[first : first + size]), (size, first)
    shuffled = torch.randperm(17, generator=g)
    assert torch.equal(exact_matmul(x[shuffled], w, b), full[shuffled])
    want = F.linear(x.float(), w.float(), b.float())
    assert (full.float() - want).abs().max() < TOL * 10, (full.float() - want).abs().max()
    # a float32 residual added in the kernel (a decoder layer's o / down projection): the bits of the eager add of
    # the product (float16 here: the interpreter does not round to bfloat16 to nearest even), at any batch size
    r = torch.randn(17, 24, generator=g)
    for dtype in (torch.float16, torch.float32):
        xs, ws, bs = x.to(dtype), w.to(dtype), b.to(dtype)
        summed = exact_matmul(xs, ws, bs, residual=r)
        assert summed.dtype == torch.float32 and torch.equal(summed, r + exact_matmul(xs, ws, bs)), dtype
        assert torch.equal(exact_matmul(xs[4:7], ws, bs, residual=r[4:7]), summed[4:7]), dtype
    check_split_matmul()


def check_split_matmul() -> None:
    """K cut into chunks summed in order: a program walking every chunk (many rows) gives the bits of the chunks'
    programs, the tile's last one adding them (a decode step's few rows), with the bias and the residual alike."""
    assert (split_k(896), split_k(4864), split_k(3584), split_k(18944), split_k(1000)) == (1, 2, 2, 4, 1)
    x = torch.randn(9, 256, generator=g).to(DTYPE)
    w, b = torch.randn(24, 256, generator=g).to(DTYPE), torch.randn(24, generator=g).to(DTYPE)
    r = torch.randn(9, 24, generator=g)
    unsplit = exact_matmul(x, w, b)
    assert not all(torch.equal(exact_matmul(x, w, b, split=n), unsplit) for n in (2, 4))  # the chunks: other bits
    counts = exact_triton._COUNTS
    for split in (2, 4):
        for extra in ({}, {"residual": r}):
            walked = exact_matmul(x, w, b, split=split, grid_split=False, **extra)
            assert torch.equal(exact_matmul(x, w, b, split=split, grid_split=True, **extra), walked), (split, extra)
            part = {k: v[3:5] for k, v in extra.items()}
            assert torch.equal(exact_matmul(x[3:5], w, b, split=split, **part), walked[3:5]), (split, extra)
            assert counts and not any(c.any() for c in counts.values())  # every tile's count back to zero
            whole = F.linear(x.float(), w.float(), b.float()) + extra.get("residual", 0)
            assert (walked.float() - whole).abs().max() < TOL * 20, (walked.float() - whole).abs().max()


LENGTHS = [5, 33, 1, 2, 7, 3, 1, 2, 9, 2, 4, 1, 6, 3, 2, 1, 8]  # 17 sequences, one of 2 key blocks
HEADS, KV_HEADS, DIM = 6, 2, 24  # a group of 3 and a head_dim below a power of 2: both padded in the kernel
SCALE = DIM**-0.5
SEQS = [
    tuple(torch.randn(n, h, DIM, generator=g).to(DTYPE) for h in (HEADS, KV_HEADS, KV_HEADS)) for n in LENGTHS
]  # per sequence (q [n, H, D], k, v [n, Hkv, D])


def packed(order: list[int]) -> dict[tuple[int, int], torch.Tensor]:
    """{(sequence, position): output [H, D]} of the sequences of `order` packed into one row."""
    q, k, v = (torch.cat([SEQS[i][j] for i in order]) for j in range(3))
    cu = torch.tensor([0, *torch.tensor([LENGTHS[i] for i in order]).cumsum(0).tolist()])
    out = exact_packed_attention(q, k, v, cu, SCALE)
    starts = cu[:-1].tolist()
    return {(i, p): out[s + p] for i, s in zip(order, starts) for p in range(LENGTHS[i])}


def padded(order: list[int]) -> dict[tuple[int, int], torch.Tensor]:
    """The same from padded rows [B, T] (sample b's position 0 at row b * T; the padding never read)."""
    width = max(LENGTHS[i] for i in order)
    store = [torch.full((len(order) * width, *SEQS[0][j].shape[1:]), float("nan")).to(DTYPE) for j in range(3)]
    for b, i in enumerate(order):
        for j in range(3):
            store[j][b * width : b * width + LENGTHS[i]] = SEQS[i][j]
    keep = torch.tensor([b * width + p for b, i in enumerate(order) for p in range(LENGTHS[i])])
    starts = torch.tensor([b * width for b, i in enumerate(order) for _ in range(LENGTHS[i])])
    lengths = torch.tensor([p + 1 for i in order for p in range(LENGTHS[i])])
    out = exact_attention(store[0][keep], store[1], store[2], lengths, SCALE, starts=starts)
    return {key: out[n] for n, key in enumerate((i, p) for i in order for p in range(LENGTHS[i]))}


def paged(order: list[int], prefill: bool, block_size: int = 4) -> dict[tuple[int, int], torch.Tensor]:
    """The same from a paged cache (blocks shuffled): the prefill of every position (if `prefill`: else only the
    last ones), then the decode of each last one."""
    per_seq = [-(-LENGTHS[i] // block_size) for i in order]
    blocks = torch.randperm(sum(per_seq) + 3, generator=g)
    k_cache = torch.full((blocks.numel(), block_size, KV_HEADS, DIM), float("nan")).to(DTYPE)
    v_cache = k_cache.clone()
    tables = torch.zeros(len(order), max(per_seq), dtype=torch.int32)
    used = 0
    for b, i in enumerate(order):
        tables[b, : per_seq[b]] = blocks[used : used + per_seq[b]].int()
        used += per_seq[b]
        slots = key_slots(torch.tensor([b]), tables, block_size, LENGTHS[i])[0]
        k_cache.view(-1, KV_HEADS, DIM)[slots], v_cache.view(-1, KV_HEADS, DIM)[slots] = SEQS[i][1], SEQS[i][2]
    keys = [(b, i, p) for b, i in enumerate(order) for p in range(LENGTHS[i] if prefill else 0)]
    rows, positions = torch.tensor([b for b, _, _ in keys]), torch.tensor([p for _, _, p in keys])
    q = torch.stack([SEQS[i][0][p] for _, i, p in keys]) if keys else SEQS[0][0][:0]
    out = exact_attention(q, k_cache, v_cache, positions + 1, SCALE, rows=rows, block_tables=tables)
    found = {(i, p): out[n] for n, (_, i, p) in enumerate(keys)}
    last = torch.stack([SEQS[i][0][-1] for i in order])
    decode = exact_attention(
        last, k_cache, v_cache, torch.tensor([LENGTHS[i] for i in order]), SCALE,
        rows=torch.arange(len(order)), block_tables=tables,
    )  # fmt: skip
    for b, i in enumerate(order):
        found[(i, LENGTHS[i] - 1)] = found.get((i, LENGTHS[i] - 1), decode[b])
        assert torch.equal(decode[b], found[(i, LENGTHS[i] - 1)]), ("decode", i)
    # a decode step whose kernel writes each sequence's new key and value itself (the slots emptied first), its
    # lengths prepared in int32 once for all layers: the same outputs, the same cache
    slots = torch.stack(
        [key_slots(torch.tensor([b]), tables, block_size, LENGTHS[i])[0][-1] for b, i in enumerate(order)]
    )
    k_gap, v_gap = k_cache.clone(), v_cache.clone()
    k_gap.view(-1, KV_HEADS, DIM)[slots] = v_gap.view(-1, KV_HEADS, DIM)[slots] = float("nan")
    new_k, new_v = (torch.stack([SEQS[i][j][-1] for i in order]) for j in (1, 2))
    written = exact_attention(
        last, k_gap, v_gap, torch.tensor([LENGTHS[i] for i in order], dtype=torch.int32), SCALE,
        rows=torch.arange(len(order)), block_tables=tables, new_kv=(new_k, new_v, slots),
    )  # fmt: skip
    assert torch.equal(written, decode), "decode writing its keys"
    for gap, cache in ((k_gap, k_cache), (v_gap, v_cache)):
        assert torch.equal(gap.nan_to_num(7.0), cache.nan_to_num(7.0)), "the keys written"
    return found


def check_attention() -> None:
    everything = list(range(17))
    want = packed(everything)
    shuffled = torch.randperm(17, generator=g).tolist()
    for source in (packed([1]), packed([0, 9, 5]), packed(shuffled), padded([12, 1, 4])):
        for key, value in source.items():
            assert torch.equal(value, want[key]), key
    for order, prefill in (([1], True), ([3, 16, 7], True), (shuffled, False)):
        for key, value in paged(order, prefill).items():
            assert torch.equal(value, want[key]), ("paged", key)
    # the PyTorch reference (float32 arithmetic in another order): close
    q, k, v = (torch.cat([s[j] for s in SEQS]) for j in range(3))
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    sample = torch.bucketize(torch.arange(q.shape[0]), cu[1:], right=True)
    position = torch.arange(q.shape[0]) - cu[sample]
    slots = (cu[sample][:, None] + torch.arange(64)).clamp(max=q.shape[0] - 1)
    reference = blocked_attention(q, k, v, slots, position + 1, SCALE)
    got = torch.stack([want[(int(s), int(p))] for s, p in zip(sample, position)])
    assert (got.float() - reference.float()).abs().max() < TOL, (got.float() - reference.float()).abs().max()


def check_gradients() -> None:
    x = torch.randn(7, 40, generator=g, requires_grad=True)
    w, b = torch.randn(24, 40, generator=g, requires_grad=True), torch.randn(24, generator=g, requires_grad=True)
    weights = torch.randn(7, 24, generator=g)
    got = torch.autograd.grad((exact_linear(x, w, b) * weights).sum(), (x, w, b))
    want = torch.autograd.grad((F.linear(x, w, b) * weights).sum(), (x, w, b))
    assert all((a - e).abs().max() < 1e-4 for a, e in zip(got, want))
    r = torch.randn(7, 24, generator=g, requires_grad=True)  # with a residual: its gradient too
    got = torch.autograd.grad((exact_linear(x, w, b, residual=r) * weights).sum(), (x, w, b, r))
    want = torch.autograd.grad(((r + F.linear(x, w, b)) * weights).sum(), (x, w, b, r))
    assert all((a - e).abs().max() < 1e-4 for a, e in zip(got, want))
    q, k, v = (torch.cat([s[j] for s in SEQS[:4]]).float().requires_grad_() for j in range(3))
    cu = torch.tensor([0, *torch.tensor(LENGTHS[:4]).cumsum(0).tolist()])
    weights = torch.randn(q.shape, generator=g)
    got = torch.autograd.grad((exact_packed_attention(q, k, v, cu, SCALE) * weights).sum(), (q, k, v))
    sample = torch.bucketize(torch.arange(q.shape[0]), cu[1:], right=True)
    position = torch.arange(q.shape[0]) - cu[sample]
    slots = (cu[sample][:, None] + torch.arange(64)).clamp(max=q.shape[0] - 1)
    reference = blocked_attention(q, k, v, slots, position + 1, SCALE)
    want = torch.autograd.grad((reference * weights).sum(), (q, k, v))
    assert all((a - e).abs().max() < 1e-4 for a, e in zip(got, want)), [(a - e).abs().max() for a, e in zip(got, want)]
    # the backward exact mode's models run (rlx/models/exact.py): recomputed by the default path's varlen attention
    recompute = functools.partial(varlen_attention, cu_seqlens=cu, max_len=max(LENGTHS[:4]), scale=SCALE)
    got = torch.autograd.grad((exact_packed_attention(q, k, v, cu, SCALE, recompute) * weights).sum(), (q, k, v))
    assert all((a - e).abs().max() < 1e-4 for a, e in zip(got, want)), [(a - e).abs().max() for a, e in zip(got, want)]


def check_logprobs() -> None:
    scaled, targets = torch.randn(17, 150, generator=g) * 3, torch.randint(0, 150, (17,), generator=g)
    full, entropy = exact_logprobs(scaled, targets, with_entropy=True)
    for size, first in ((1, 0), (1, 16), (3, 7)):
        part = exact_logprobs(scaled[first : first + size], targets[first : first + size], with_entropy=True)
        assert torch.equal(part[0], full[first : first + size]) and torch.equal(part[1], entropy[first : first + size])
    log_probs = torch.log_softmax(scaled, -1)
    assert (full - log_probs.gather(-1, targets[:, None])[:, 0]).abs().max() < 1e-5
    # the native engine's sampler: its drawn tokens' logprobs from the draw kernels' log-normaliser, the trainer's bits
    logits, inverse = scaled.half(), inverse_temperature(0.7)
    tokens, _, lse, _ = draw_tokens_triton(logits, torch.rand(17, generator=g), inverse)
    drawn = picked_logprobs(logits, tokens, inverse, lse)
    assert torch.equal(drawn, exact_logprobs(logits, tokens, temperature=0.7)[0])
    assert torch.equal(drawn[5:8], exact_target_logprobs(logits[5:8], tokens[5:8], 0.7)[0])
    assert (entropy + (log_probs.exp() * log_probs).sum(-1)).abs().max() < 1e-5


def check_logprob_gradients() -> None:
    logits, targets = (
        torch.randn(2, 9, 150, generator=g, requires_grad=True),
        torch.randint(0, 150, (2, 9), generator=g),
    )
    weights = torch.randn(2, 2, 9, generator=g)
    picked, entropy = exact_target_logprobs(logits, targets, 0.7, with_entropy=True)
    got = torch.autograd.grad((picked * weights[0] + entropy * weights[1]).sum(), logits)[0]
    log_probs = torch.log_softmax(logits / 0.7, -1)
    want_picked = log_probs.gather(-1, targets[..., None])[..., 0]
    want_entropy = -(log_probs.exp() * log_probs).sum(-1)
    assert (picked - want_picked).abs().max() < 1e-5 and (entropy - want_entropy).abs().max() < 1e-5
    want = torch.autograd.grad((want_picked * weights[0] + want_entropy * weights[1]).sum(), logits)[0]
    assert (got - want).abs().max() < 1e-5, (got - want).abs().max()
    picked, _ = exact_target_logprobs(logits, targets, 0.7)  # the logprobs alone
    got = torch.autograd.grad((picked * weights[0]).sum(), logits)[0]
    want_picked = torch.log_softmax(logits / 0.7, -1).gather(-1, targets[..., None])[..., 0]
    want = torch.autograd.grad((want_picked * weights[0]).sum(), logits)[0]
    assert (got - want).abs().max() < 1e-5, (got - want).abs().max()


def check_rms_norm() -> None:
    x = torch.randn(17, 48, generator=g).to(DTYPE)
    weight = torch.randn(48, generator=g)  # float32, as a trainer holds it: the output promotes to float32
    full = exact_rms_norm(x, weight, 1e-6)
    assert full.dtype == torch.float32
    for size in (1, 3):
        for first in range(0, 17 - size + 1, 4):
            assert torch.equal(exact_rms_norm(x[first : first + size], weight, 1e-6), full[first : first + size])
    h = x.float()
    want = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    assert (full - want).abs().max() < TOL * 10, (full - want).abs().max()
    # also written in a 16-bit dtype (a decoder layer's norms feeding linears under autocast): the cast's bits
    # (float16 here: the interpreter does not round to bfloat16 to nearest even; tests/gpu/test_exact_cuda.py does)
    pair, low = exact_rms_norm_pair(x, weight, 1e-6, torch.float16)
    assert low.dtype == torch.float16 and torch.equal(low, pair.to(torch.float16))
    assert (pair - want).abs().max() < TOL * 10, (pair - want).abs().max()
    if sys.argv[1] == "float32":
        x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
        upstream = torch.randn(17, 48, generator=g)
        got = torch.autograd.grad((exact_rms_norm(x, weight, 1e-6) * upstream).sum(), (x, weight))
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        expected = torch.autograd.grad(((weight * h) * upstream).sum(), (x, weight))
        for a, b in zip(got, expected):
            assert (a - b).abs().max() < 1e-4, (a - b).abs().max()
        # the pair's 16-bit output (one stacked matmul reading it): the gradients of the cast of the first; both used:
        # their sum
        low_up = upstream.half()
        via_cast = torch.autograd.grad((exact_rms_norm_pair(x, weight, 1e-6, torch.float16)[0].half() * low_up).sum(),
                                       (x, weight))  # fmt: skip
        via_low = torch.autograd.grad(
            (exact_rms_norm_pair(x, weight, 1e-6, torch.float16)[1] * low_up).sum(), (x, weight)
        )
        assert all(torch.equal(a, b) for a, b in zip(via_low, via_cast))
        pair, low = exact_rms_norm_pair(x, weight, 1e-6, torch.float16)
        both = torch.autograd.grad((pair * upstream).sum() + (low * low_up).sum(), (x, weight))
        pair = exact_rms_norm_pair(x, weight, 1e-6, torch.float16)[0]
        want = torch.autograd.grad((pair * upstream).sum() + (pair.half() * low_up).sum(), (x, weight))
        assert all((a - b).abs().max() < 1e-5 for a, b in zip(both, want))


check_matmul()
check_rms_norm()
check_logprobs()
check_attention()
if sys.argv[1] == "float32":
    check_gradients()
    check_logprob_gradients()
print("ok")
