"""Exact mode's fused elementwise work on CUDA: the MLP's SiLU-and-multiply and rotary position embedding, one
Triton kernel each way (exact_fused_kernels.py).

Exact mode cannot run torch.compile, which fuses this work on the default path; eagerly it is about 5 kernels for the
MLP's `act_fn(gate) * up` and 20 for rotary per decoder layer, forward and backward. rlx/models/exact.py plugs
these in where exact mode runs its Triton kernels (`use_triton`), on the trainer's and the native engine's side
alike:

- `silu_mul(gate, up)`: silu(gate) * up in the inputs' dtype, differentiable (the backward one kernel giving both
  gradients, in float32 from the saved inputs);
- `rotary(q, k, cos, sin)`: transformers' `apply_rotary_pos_emb` of the Llama family (cos and sin [B, T, D]
  broadcast over the heads of q [B, H, T, D] and k [B, Hkv, T, D]), one program per token for its query and key
  heads; differentiable in q and k (the backward the transposed rotation, one kernel).

Each element is computed from its own inputs alone (no reduction), so a token's bits do not depend on the batch.
The results are close to the PyTorch formulas (`silu_mul_reference`, `rotary_reference`), not bit-equal: they round
once where eager PyTorch rounds after each op. Both also run on the CPU under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

SILU_BLOCK, _INTERPRETER_SILU_BLOCK = 1024, 64
"""Columns per program of the SiLU kernels on CUDA (under the interpreter: fewer). Fixed, whatever the shape."""


@functools.cache
def _kernels():
    from rlx.kernels.exact_fused_kernels import rotary_kernel, silu_mul_backward_kernel, silu_mul_kernel

    return silu_mul_kernel, silu_mul_backward_kernel, rotary_kernel


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., N] as rows [R, N] whose last stride is 1 (a view where it can be: the stacked gate/up projections'
    columns of one matmul are strided views)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _silu_grid(rows: torch.Tensor) -> tuple[tuple[int, int], int]:
    block = SILU_BLOCK if rows.device.type == "cuda" else _INTERPRETER_SILU_BLOCK
    return (rows.shape[0], -(-rows.shape[1] // block)), block


def _silu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    gates, ups = _rows(gate), _rows(up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if out.numel():
        grid, block = _silu_grid(gates)
        flat = out.view(-1, out.shape[-1])
        _kernels()[0][grid](
            gates, ups, flat, gates.shape[1], gates.stride(0), ups.stride(0), flat.stride(0), BLOCK=block
        )
    return out


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return _silu_forward(gate, up)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        gates, ups, grads = _rows(gate), _rows(up), _rows(grad)
        d_gate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        d_up = torch.empty(up.shape, dtype=up.dtype, device=up.device)
        if d_gate.numel():
            grid, block = _silu_grid(gates)
            flat_gate, flat_up = d_gate.view(-1, gate.shape[-1]), d_up.view(-1, up.shape[-1])
            _kernels()[1][grid](
                grads, gates, ups, flat_gate, flat_up, gates.shape[1], grads.stride(0), gates.stride(0),
                ups.stride(0), flat_gate.stride(0), BLOCK=block,
            )  # fmt: skip
        return d_gate, d_up


class _SiluMulHalves(torch.autograd.Function):
    """`_SiluMul` of the two halves of rows [R, 2N] (gate, then up), the gradient written as one [R, 2N] tensor."""

    @staticmethod
    def forward(ctx, rows):
        ctx.save_for_backward(rows)
        half = rows.shape[1] // 2
        return _silu_forward(rows[:, :half], rows[:, half:])

    @staticmethod
    def backward(ctx, grad):
        (rows,) = ctx.saved_tensors
        half, grads = rows.shape[1] // 2, _rows(grad)
        d_rows = torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)
        if d_rows.numel():
            grid, block = _silu_grid(grads)
            _kernels()[1][grid](
                grads, rows, rows[:, half:], d_rows, d_rows[:, half:], half, grads.stride(0), rows.stride(0),
                rows.stride(0), d_rows.stride(0), BLOCK=block,
            )  # fmt: skip
        return d_rows


def _halves_of(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """The rows [R, 2N] whose two halves gate and up [..., N] are (a stacked gate/up projection's output split),
    else None."""
    base, half = gate._base, gate.shape[-1]
    if base is None or up._base is not base or base.dim() != 2 or base.shape[1] != 2 * half:
        return None
    if not base.is_contiguous() or base.shape[0] * half != gate.numel():
        return None
    halves = base[:, :half].view(gate.shape), base[:, half:].view(up.shape)
    same = all(t.data_ptr() == h.data_ptr() and t.stride() == h.stride() for t, h in zip((gate, up), halves))
    return base if same else None


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate and up [..., N] of one dtype and shape (any row strides), in that dtype: per element
    silu in float32 rounded to the dtype, the product in float32 rounded again (as eager `F.silu(gate) * up`).
    Differentiable. Where gate and up are the two halves of one stacked projection's output (rlx/models/exact.py),
    the backward writes their gradients as that output's (no concatenation of the two)."""
    if gate.dtype != up.dtype or gate.shape != up.shape:
        raise ValueError(f"silu_mul: gate {gate.dtype} {tuple(gate.shape)}, up {up.dtype} {tuple(up.shape)}")
    rows = _halves_of(gate, up)
    if rows is not None:
        return _SiluMulHalves.apply(rows).view(gate.shape)
    return _SiluMul.apply(gate, up)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The Llama-family MLP's `act_fn(gate) * up` in PyTorch (what `silu_mul` computes, rounded op by op)."""
    return F.silu(gate) * up


def _rotate(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtypes: tuple[torch.dtype, torch.dtype],
    backward: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`rotary_kernel` over q [B, H, T, D] and k [B, Hkv, T, D] with cos/sin [B or 1, T, D] -> ([B, H, T, D],
    [B, Hkv, T, D]) in `dtypes`, each a transposed view of a contiguous [B, T, heads, D] (the layout the attention
    reads: the transformers layers reshape it back without a copy)."""
    q, k = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k))
    batch, heads, length, dim = q.shape
    cos, sin = cos.expand(batch, length, dim), sin.expand(batch, length, dim)
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    kv_heads = k.shape[1]
    q_out = torch.empty(batch, length, heads, dim, dtype=dtypes[0], device=q.device).transpose(1, 2)
    k_out = torch.empty(batch, length, kv_heads, dim, dtype=dtypes[1], device=k.device).transpose(1, 2)
    if q_out.numel() or k_out.numel():
        _kernels()[2][(length, batch)](
            q, k, cos, sin, q_out, k_out, length, heads, kv_heads, q.stride(0), q.stride(1), q.stride(2), k.stride(0),
            k.stride(1), k.stride(2), cos.stride(0), cos.stride(1), HALF=dim // 2, HEADS_PAD=_pow2(heads),
            KV_PAD=_pow2(kv_heads), HALF_PAD=_pow2(dim // 2), BACKWARD=backward, num_warps=4,
        )  # fmt: skip
    return q_out, k_out


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.dtypes = q.dtype, k.dtype
        angles = torch.promote_types(cos.dtype, sin.dtype)
        dtypes = torch.promote_types(q.dtype, angles), torch.promote_types(k.dtype, angles)
        return _rotate(q, k, cos, sin, dtypes, backward=False)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        cos, sin = ctx.saved_tensors
        return *_rotate(grad_q, grad_k, cos, sin, ctx.dtypes, backward=True), None, None


def rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_embed, k_embed) of transformers' `apply_rotary_pos_emb(q, k, cos, sin)` for q [B, H, T, D], k [B, Hkv, T,
    D] (any strides) and cos/sin [B or 1, T, D]: x * cos + rotate_half(x) * sin per element in float32, one rounding
    of each sine product and one fused multiply-add, in torch's promotion of x's and cos's dtypes (as eager).
    Differentiable in q and k (cos and sin come from positions: no gradient). `out_dtype` (no autograd: generation):
    the results rounded to it in the kernel, the bits of the eager result's `.to(out_dtype)` without that copy."""
    if not fits_rotary(q, k, cos, sin):
        raise ValueError(f"rotary: q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)} do not fit")
    if out_dtype is not None:
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
            raise ValueError("rotary: out_dtype is for generation (no autograd)")
        return _rotate(q, k, cos, sin, (out_dtype, out_dtype), backward=False)
    return _Rotary.apply(q, k, cos, sin)


def fits_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether `rotary` takes these shapes: q [B, H, T, D] and k [B, Hkv, T, D] with D even, cos and sin [B or 1, T,
    D] (the rotation over the whole head: no partial rotary)."""
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
        return False
    batch, _, length, dim = q.shape
    return (
        dim % 2 == 0 and k.shape[0] == batch and k.shape[2:] == q.shape[2:] and cos.shape[0] in (1, batch)
        and tuple(cos.shape[1:]) == (length, dim)
    )  # fmt: skip


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """cat(-x2, x1) of x's two halves along the last dimension (transformers' `rotate_half`)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' `apply_rotary_pos_emb(q, k, cos, sin)` (unsqueeze_dim 1) in PyTorch, op by op (cast to
    `out_dtype` if given, as `rotary`'s)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    out = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    return out if out_dtype is None else tuple(t.to(out_dtype) for t in out)
