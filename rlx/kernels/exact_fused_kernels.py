"""The elementwise Triton kernels of exact mode on CUDA (rlx/kernels/exact_fused.py holds the host side): the MLP's
SiLU-and-multiply and rotary position embedding, each one kernel forward and one backward. Imported on first use, as
rlx/kernels/exact_triton_kernels.py.

No kernel here reduces across elements: each output element is computed from its own inputs alone, with tile shapes
that are constexprs fixed per call site (never by the number of rows or tokens), so an element's bits do not depend
on the tensor it sits in. Products that meet a sum are written as explicit `tl.fma` calls, so the compiler has no
contraction left to choose.
"""

import triton
import triton.language as tl


@triton.jit
def silu_mul_kernel(gate_ptr, up_ptr, out_ptr, N, stride_g, stride_u, stride_o, BLOCK: tl.constexpr):
    """out [R, N] = silu(gate) * up, one program per (row, BLOCK columns): silu(g) = g / (1 + exp(-g)) in float32,
    rounded to out's dtype (as `F.silu` returns it), then times up in float32, rounded again."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def silu_mul_backward_kernel(
    grad_ptr, gate_ptr, up_ptr, d_gate_ptr, d_up_ptr, N, stride_grad, stride_g, stride_u, stride_d,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """The gradients of `silu_mul_kernel` for upstream grad [R, N], in float32 from the saved inputs: with
    s = sigmoid(gate), d_gate = grad * up * s * (1 + gate * (1 - s)) and d_up = grad * silu(gate) (the silu rounded to
    the inputs' dtype, as the forward multiplied it), each written in its pointer's dtype (d_gate and d_up share
    stride_d)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    grad = tl.load(grad_ptr + row * stride_grad + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-gate))
    silu = (gate * s).to(gate_ptr.dtype.element_ty).to(tl.float32)
    d_gate = grad * up * s * tl.fma(gate, 1.0 - s, 1.0)
    tl.store(d_gate_ptr + row * stride_d + cols, d_gate.to(d_gate_ptr.dtype.element_ty), mask=mask)
    tl.store(d_up_ptr + row * stride_d + cols, (grad * silu).to(d_up_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, token_x, token_out, stride_h, heads, cos1, cos2, sin_a, sin_b,
    HALF: tl.constexpr, HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
):  # fmt: skip
    """One token's heads [heads, 2 * HALF] at x_ptr + token_x (head h at h * stride_h) rotated into out's [heads,
    2 * HALF] rows at out_ptr + token_out: out1 = x1 * cos1 + x2 * sin_a, out2 = x2 * cos2 + x1 * sin_b, each
    product with the sine rounded once and the other taken into one fused multiply-add, in float32."""
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < heads) & (d < HALF)
    first = x_ptr + token_x + h.to(tl.int64) * stride_h + d
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    out1 = tl.fma(x1, cos1, x2 * sin_a)
    out2 = tl.fma(x2, cos2, x1 * sin_b)
    target = out_ptr + token_out + h.to(tl.int64) * (2 * HALF) + d
    tl.store(target, out1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(target + HALF, out2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rotary_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, T, heads, kv_heads,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_cb, stride_ct,
    HALF: tl.constexpr, HEADS_PAD: tl.constexpr, KV_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
    BACKWARD: tl.constexpr,
):  # fmt: skip
    """Rotary position embedding of one token (b, t) per program (grid (T, B)): its query heads q [B, H, T, 2 * HALF]
    and key heads k [B, Hkv, T, 2 * HALF] (any strides, the last 1) with cos/sin [B, T, 2 * HALF] (the last stride 1),
    written to q_out [B, T, H, 2 * HALF] and k_out [B, T, Hkv, 2 * HALF] (contiguous). Forward (rotate_half(x) =
    cat(-x2, x1)): out1 = x1 * cos1 - x2 * sin1, out2 = x2 * cos2 + x1 * sin2; BACKWARD, its transpose for
    upstream gradients x: out1 = x1 * cos1 + x2 * sin2, out2 = x2 * cos2 - x1 * sin1."""
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, HALF_PAD)
    mask = d < HALF
    angle = b * stride_cb + t * stride_ct + d
    cos1 = tl.load(cos_ptr + angle, mask=mask, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptr + angle + HALF, mask=mask, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptr + angle, mask=mask, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptr + angle + HALF, mask=mask, other=0.0).to(tl.float32)[None, :]
    if BACKWARD:
        sin_a, sin_b = sin2, -sin1
    else:
        sin_a, sin_b = -sin1, sin2
    token = b * T + t
    _rotate_heads(
        q_ptr, q_out_ptr, b * stride_qb + t * stride_qt, token * heads * (2 * HALF), stride_qh, heads,
        cos1, cos2, sin_a, sin_b, HALF, HEADS_PAD, HALF_PAD,
    )  # fmt: skip
    _rotate_heads(
        k_ptr, k_out_ptr, b * stride_kb + t * stride_kt, token * kv_heads * (2 * HALF), stride_kh, kv_heads,
        cos1, cos2, sin_a, sin_b, HALF, KV_PAD, HALF_PAD,
    )  # fmt: skip
