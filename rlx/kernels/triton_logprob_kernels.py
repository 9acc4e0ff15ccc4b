"""The Triton kernels behind rlx/kernels/triton_logprob.py (the host side: tiling, chunking, autograd).

- `forward_stats_kernel` / `backward_dlogits_kernel`: the 'fused' variant, a tl.dot matmul of a logits
  tile with online-softmax statistics or dL/dlogits in its epilogue;
- `stats_from_logits_kernel` / `dlogits_from_logits_kernel`: the 'cublas' variant, reducing a logits
  chunk cuBLAS wrote to per-row statistics, or overwriting it with dL/dlogits.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile_logits(
    h_ptr,
    w_ptr,
    offs_n,
    offs_v,
    N,
    V,
    H: tl.constexpr,
    stride_h,
    stride_w,
    inv_temp,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    """logits tile [BLOCK_N, BLOCK_V] = hidden[offs_n] @ weight[offs_v].T * inv_temp, float32."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for k in range(0, H, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        a = tl.load(
            h_ptr + offs_n[:, None] * stride_h + offs_k[None, :],
            mask=(offs_n[:, None] < N) & (offs_k[None, :] < H),
            other=0.0,
        )
        b = tl.load(
            w_ptr + offs_v[:, None] * stride_w + offs_k[None, :],
            mask=(offs_v[:, None] < V) & (offs_k[None, :] < H),
            other=0.0,
        )
        if IEEE:
            acc += tl.dot(a, tl.trans(b), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(b))
    return acc * inv_temp


@triton.jit
def forward_stats_kernel(
    h_ptr,
    w_ptr,
    tgt_ptr,
    m_ptr,
    s_ptr,
    t_ptr,
    zt_ptr,
    N,
    V,
    H: tl.constexpr,
    stride_h,
    stride_w,
    num_groups,
    inv_temp,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TILES: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_g = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_n < N
    tgt = tl.load(tgt_ptr + offs_n, mask=row_ok, other=-1)
    m = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    t = tl.zeros((BLOCK_N,), dtype=tl.float32)
    zt = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for tile in range(TILES):
        offs_v = (pid_g * TILES + tile) * BLOCK_V + tl.arange(0, BLOCK_V)
        col_ok = offs_v[None, :] < V
        z = _tile_logits(
            h_ptr, w_ptr, offs_n, offs_v, N, V, H, stride_h, stride_w, inv_temp, BLOCK_N, BLOCK_V, BLOCK_K, IEEE
        )
        z_masked = tl.where(col_ok, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z_masked, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile past the vocabulary end
        e = tl.where(col_ok, tl.exp(z_masked - m_safe[:, None]), 0.0)
        scale = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_safe))
        s = s * scale + tl.sum(e, axis=1)
        t = t * scale + tl.sum(e * tl.where(col_ok, z, 0.0), axis=1)
        m = m_new
        zt += tl.sum(tl.where(tgt[:, None] == offs_v[None, :], z, 0.0), axis=1)
    out = offs_n * num_groups + pid_g
    tl.store(m_ptr + out, m, mask=row_ok)
    tl.store(s_ptr + out, s, mask=row_ok)
    tl.store(t_ptr + out, t, mask=row_ok)
    tl.store(zt_ptr + out, zt, mask=row_ok)


@triton.jit
def backward_dlogits_kernel(
    h_ptr,
    w_ptr,
    tgt_ptr,
    lse_ptr,
    mean_ptr,
    a_ptr,
    b_ptr,
    dz_ptr,
    N,
    V,
    H: tl.constexpr,
    v_start,
    chunk,
    stride_h,
    stride_w,
    stride_dz,
    inv_temp,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_c = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)  # column inside the chunk
    offs_v = v_start + offs_c
    row_ok = offs_n < N
    z = _tile_logits(
        h_ptr, w_ptr, offs_n, offs_v, N, V, H, stride_h, stride_w, inv_temp, BLOCK_N, BLOCK_V, BLOCK_K, IEEE
    )
    lse = tl.load(lse_ptr + offs_n, mask=row_ok, other=0.0)
    mean = tl.load(mean_ptr + offs_n, mask=row_ok, other=0.0)
    a = tl.load(a_ptr + offs_n, mask=row_ok, other=0.0)
    b = tl.load(b_ptr + offs_n, mask=row_ok, other=0.0)
    tgt = tl.load(tgt_ptr + offs_n, mask=row_ok, other=-1)
    p = tl.exp(z - lse[:, None])
    dz = -p * (a[:, None] + b[:, None] * (z - mean[:, None]))
    dz += tl.where(tgt[:, None] == offs_v[None, :], a[:, None], 0.0)
    dz = dz * inv_temp
    ok = row_ok[:, None] & (offs_c[None, :] < chunk) & (offs_v[None, :] < V)
    tl.store(dz_ptr + offs_n[:, None] * stride_dz + offs_c[None, :], dz.to(dz_ptr.dtype.element_ty), mask=ok)


@triton.jit
def stats_from_logits_kernel(
    z_ptr,
    tgt_ptr,
    part_ptr,
    N,
    width,
    v_start,
    stride_z,
    stride_part,
    group_start,
    inv_temp,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    GROUP_W: tl.constexpr,
):
    """Online statistics of a GROUP_W-column slice of one [N, width] logits chunk (cuBLAS variant).

    Grid: (row blocks, column groups). Writes (max, sum exp, sum exp * z, target logit) to
    part_ptr[k * stride_part + (group_start + group) * N + row], k = 0..3."""
    pid_n = tl.program_id(0)
    pid_g = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_n < N
    tgt = tl.load(tgt_ptr + offs_n, mask=row_ok, other=-1)
    m = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    t = tl.zeros((BLOCK_N,), dtype=tl.float32)
    zt = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for c in range(0, GROUP_W, BLOCK_V):
        offs_c = pid_g * GROUP_W + c + tl.arange(0, BLOCK_V)
        ok = row_ok[:, None] & (offs_c[None, :] < width)
        z = tl.load(z_ptr + offs_n[:, None] * stride_z + offs_c[None, :], mask=ok, other=0.0).to(tl.float32)
        z = z * inv_temp
        z_masked = tl.where(ok, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z_masked, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        e = tl.where(ok, tl.exp(z_masked - m_safe[:, None]), 0.0)
        scale = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_safe))
        s = s * scale + tl.sum(e, axis=1)
        t = t * scale + tl.sum(e * tl.where(ok, z, 0.0), axis=1)
        m = m_new
        zt += tl.sum(tl.where(tgt[:, None] == (v_start + offs_c)[None, :], z, 0.0), axis=1)
    out = part_ptr + (group_start + pid_g) * N + offs_n
    tl.store(out, m, mask=row_ok)
    tl.store(out + stride_part, s, mask=row_ok)
    tl.store(out + 2 * stride_part, t, mask=row_ok)
    tl.store(out + 3 * stride_part, zt, mask=row_ok)


@triton.jit
def dlogits_from_logits_kernel(
    z_ptr,
    tgt_ptr,
    lse_ptr,
    mean_ptr,
    a_ptr,
    b_ptr,
    N,
    width,
    v_start,
    stride_z,
    inv_temp,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Overwrite a [N, width] logits chunk with dL/dlogits (cuBLAS variant)."""
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_c = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = offs_n < N
    ok = row_ok[:, None] & (offs_c[None, :] < width)
    ptrs = z_ptr + offs_n[:, None] * stride_z + offs_c[None, :]
    z = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32) * inv_temp
    lse = tl.load(lse_ptr + offs_n, mask=row_ok, other=0.0)
    mean = tl.load(mean_ptr + offs_n, mask=row_ok, other=0.0)
    a = tl.load(a_ptr + offs_n, mask=row_ok, other=0.0)
    b = tl.load(b_ptr + offs_n, mask=row_ok, other=0.0)
    tgt = tl.load(tgt_ptr + offs_n, mask=row_ok, other=-1)
    p = tl.exp(z - lse[:, None])
    dz = -p * (a[:, None] + b[:, None] * (z - mean[:, None]))
    dz += tl.where(tgt[:, None] == (v_start + offs_c)[None, :], a[:, None], 0.0)
    tl.store(ptrs, (dz * inv_temp).to(z_ptr.dtype.element_ty), mask=ok)
