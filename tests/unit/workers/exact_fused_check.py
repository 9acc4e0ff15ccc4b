"""Subprocess of tests/unit/test_exact_fused.py (TRITON_INTERPRET=1 must be set before triton is imported): exact
mode's fused elementwise kernels (rlx/kernels/exact_fused.py) in Triton's interpreter. Each check raises on failure;
prints 'ok' at the end.

- silu_mul and rotary close to the PyTorch formulas in float32 and bfloat16 (the interpreter truncates float32 to
  bfloat16 where a GPU rounds to nearest: bfloat16 is compared within two of its steps), in the dtypes and layouts
  eager PyTorch gives, gradients close to autograd's through the formulas;
- each row's (each token's) results the same bits in tensors of 1, 3 and 17 rows, at any position, from strided views
  (the engine's stacked projections) and, for rotary, from one packed row of every token as from padded samples.
"""

import torch

from rlx.kernels.exact_fused import rotary, rotary_reference, silu_mul, silu_mul_reference

g = torch.Generator().manual_seed(0)
HEADS, KV_HEADS, DIM = 6, 2, 24  # heads and half the head_dim below powers of 2: both padded in the kernel


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape, want.shape)
    step = 2.0 ** (-6 if dtype == torch.bfloat16 else -21)  # two steps of the dtype at magnitude 1
    error = ((got.float() - want.float()).abs() / want.float().abs().clamp(min=1.0)).max()
    assert error <= step, (what, dtype, error)


def check_silu_mul(dtype: torch.dtype) -> None:
    both = (torch.randn(17, 2, 150, generator=g) * 3).to(dtype)
    gate, up = both[:, 0], both[:, 1]  # strided rows, as the stacked gate/up matmul's columns
    full = silu_mul(gate, up)
    close(full, silu_mul_reference(gate.float(), up.float()).to(dtype), dtype, "silu_mul")
    assert torch.equal(silu_mul(gate.contiguous(), up.contiguous()), full)
    for size in (1, 3):
        for first in range(0, 17 - size + 1, 5):
            part = silu_mul(gate[first : first + size].contiguous(), up[first : first + size].contiguous())
            assert torch.equal(part, full[first : first + size]), ("silu_mul rows", size, first)
    assert torch.equal(silu_mul(gate[None, 2:9], up[None, 2:9])[0], full[2:9])  # [B, T, N] as the MLP calls it
    leaves = [t.clone().requires_grad_() for t in (gate, up)]
    upstream = torch.randn(17, 150, generator=g).to(dtype)
    got = torch.autograd.grad(silu_mul(*leaves), leaves, upstream)
    floats = [t.float().requires_grad_() for t in (gate, up)]
    want = torch.autograd.grad(silu_mul_reference(*floats), floats, upstream.float())
    for name, a, b in zip(("d_gate", "d_up"), got, want):
        close(a, b.to(dtype), dtype, name)
    # the halves of a stacked projection's output rows [R, 2N], split and viewed [B, T, N] as the MLP gets them: the
    # same bits, the gradient one [R, 2N] tensor (no split's backward concatenating the two)
    stacked = torch.cat([gate, up], dim=-1).requires_grad_()
    halves = stacked.view(1, 17, 300).split((150, 150), dim=-1)
    out = silu_mul(*halves)
    kernel = out.grad_fn.next_functions[0][0]  # under the [B, T, N] view
    assert torch.equal(out[0], full) and kernel.name().startswith("_SiluMulHalves"), kernel
    (grad,) = torch.autograd.grad(out, stacked, upstream[None])
    assert torch.equal(grad[:, :150], got[0]) and torch.equal(grad[:, 150:], got[1])


def padded_tokens(dtype: torch.dtype, angle_dtype: torch.dtype, batch: int, length: int):
    """q [B, H, T, D] and k [B, Hkv, T, D] as transformers makes them (transposed views of [B, T, heads, D]) and
    cos/sin [B, T, D] of positions 0..T-1 of each sample."""
    q = torch.randn(batch, length, HEADS, DIM, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(batch, length, KV_HEADS, DIM, generator=g).to(dtype).transpose(1, 2)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, DIM, 2).float() / DIM))
    freqs = torch.arange(length).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    angles = (
        emb.cos().to(angle_dtype)[None].expand(batch, -1, -1),
        emb.sin().to(angle_dtype)[None].expand(batch, -1, -1),
    )
    return q, k, *(a.contiguous() for a in angles)


def check_rotary(dtype: torch.dtype, angle_dtype: torch.dtype) -> None:
    q, k, cos, sin = padded_tokens(dtype, angle_dtype, 17, 5)
    full_q, full_k = rotary(q, k, cos, sin)
    want_q, want_k = rotary_reference(q.float(), k.float(), cos.float(), sin.float())
    want_dtype = torch.promote_types(dtype, angle_dtype)
    close(full_q, want_q.to(want_dtype), want_dtype, "rotary q")
    close(full_k, want_k.to(want_dtype), want_dtype, "rotary k")
    assert full_q.stride() == rotary_reference(q, k, cos, sin)[0].stride()  # the layout eager gives
    for size in (1, 3):
        for first in range(0, 17 - size + 1, 6):
            rows = slice(first, first + size)
            got_q, got_k = rotary(q[rows], k[rows], cos[rows], sin[rows])
            assert torch.equal(got_q, full_q[rows]) and torch.equal(got_k, full_k[rows]), ("rotary rows", size, first)
    got_q, got_k = rotary(q[:3], k[:3], cos[:1], sin[:1])  # cos/sin [1, T, D] broadcast (no position_ids)
    assert torch.equal(got_q, full_q[:3]) and torch.equal(got_k, full_k[:3])
    # the engine's layout: every token of samples 4, 0, 9 packed into one row [1, heads, N, D], from one qkv matmul
    order = [4, 0, 9]
    qkv = torch.cat([t.transpose(1, 2)[order].flatten(2) for t in (q, k, k)], dim=-1).flatten(0, 1)[None]
    packed_q = qkv[..., : HEADS * DIM].unflatten(-1, (HEADS, DIM)).transpose(1, 2)
    packed_k = qkv[..., HEADS * DIM : (HEADS + KV_HEADS) * DIM].unflatten(-1, (KV_HEADS, DIM)).transpose(1, 2)
    got_q, got_k = rotary(packed_q, packed_k, cos[order].flatten(0, 1)[None], sin[order].flatten(0, 1)[None])
    assert torch.equal(got_q, full_q[order].transpose(1, 2).flatten(0, 1)[None].transpose(1, 2))
    assert torch.equal(got_k, full_k[order].transpose(1, 2).flatten(0, 1)[None].transpose(1, 2))
    check_rotary_gradients(q[:4], k[:4], cos[:4], sin[:4], dtype)


def check_rotary_written_low() -> None:
    """Generation's rotary (no autograd, float32 angles under a 16-bit autocast): written in the 16-bit dtype by the
    kernel, the bits of the float32 result cast (float16 here: the interpreter rounds it as torch does)."""
    q, k, cos, sin = padded_tokens(torch.float16, torch.float32, 5, 7)
    full_q, full_k = rotary(q, k, cos, sin)
    with torch.no_grad():
        low_q, low_k = rotary(q, k, cos, sin, out_dtype=torch.float16)
    assert low_q.dtype == low_k.dtype == torch.float16 and low_q.stride() == full_q.stride()
    assert torch.equal(low_q, full_q.to(torch.float16)) and torch.equal(low_k, full_k.to(torch.float16))
    try:
        rotary(q.clone().requires_grad_(), k, cos, sin, out_dtype=torch.float16)
    except ValueError:
        pass
    else:
        raise AssertionError("rotary: out_dtype under autograd was accepted")


def check_rotary_gradients(q, k, cos, sin, dtype: torch.dtype) -> None:
    leaves = [t.clone().requires_grad_() for t in (q, k)]
    out_q, out_k = rotary(*leaves, cos, sin)
    upstream = [torch.randn(t.shape, generator=g).to(t.dtype) for t in (out_q, out_k)]
    got = torch.autograd.grad((out_q, out_k), leaves, upstream)
    floats = [t.float().requires_grad_() for t in (q, k)]
    want = torch.autograd.grad(
        rotary_reference(*floats, cos.float(), sin.float()), floats, [u.float() for u in upstream]
    )
    for name, a, b in zip(("dq", "dk"), got, want):
        close(a, b.to(dtype), dtype, name)


for dtype in (torch.float32, torch.bfloat16):
    check_silu_mul(dtype)
check_rotary(torch.float32, torch.float32)
check_rotary(torch.bfloat16, torch.float32)  # autocast: bfloat16 projections, float32 angles -> float32 (as eager)
check_rotary(torch.bfloat16, torch.bfloat16)
check_rotary_written_low()
print("ok")
