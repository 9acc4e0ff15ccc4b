"""The Triton kernels of paged decode attention (rlx/kernels/paged_attention.py holds the host side). Imported on
first use, so importing rlx needs no triton and TRITON_INTERPRET (read when these are defined) may be set until
the first call."""

import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    ctx_ptr,
    out_ptr,
    scale_log2,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_btb,
    stride_ob,
    stride_oh,
    kn_ptr,
    vn_ptr,
    slot_ptr,
    stride_nb,
    stride_nh,
    stride_vnb,
    stride_vnh,
    cos_ptr,
    sin_ptr,
    stride_rope,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    INTERPRET_TOKENS: tl.constexpr,
    WRITE_KV: tl.constexpr,
    ROPE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PARTITION: tl.constexpr,
):
    """One program per (sequence, kv head): its GROUP query heads against the sequence's cached tokens,
    BLOCK_N tokens per step (each token finds its block through the block table), online softmax in
    base 2, float32 accumulators. Padded heads / dims load zeros and are not stored. Under the interpreter,
    the constexpr INTERPRET_TOKENS (max_blocks * block_size) bounds the loop instead of the loaded context
    length (the interpreter's loaded scalars are 1-element arrays, which NumPy >= 2.5 refuses as an index);
    the extra steps are fully masked. 0 on the GPU. With WRITE_KV the program first stores its sequence's
    new key and value (kn, vn [B, kv_heads, D]) at the sequence's slot (write_kv, fused). With ROPE the query and
    the new key are first rotated by the sequence's (cos, sin) rows [D] (rotate-half pairs d, d + D/2: Llama's
    convention), in float32, then rounded to the cache dtype. With NUM_SPLITS > 1
    (flash-decoding) program (seq, kvh, split) covers tokens [split * PARTITION, (split + 1) * PARTITION) and
    stores its unnormalised partial result for `_reduce_kernel`; the split holding the last token writes it."""
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + seq)
    lo = split * PARTITION
    hi = tl.minimum(lo + PARTITION, ctx)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, DIM_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    if ROPE:
        partner = tl.where(offs_d < HEAD_DIM // 2, offs_d + HEAD_DIM // 2, offs_d - HEAD_DIM // 2)
        sign = tl.where(offs_d < HEAD_DIM // 2, -1.0, 1.0)
        cos = tl.load(cos_ptr + seq.to(tl.int64) * stride_rope + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + seq.to(tl.int64) * stride_rope + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    if WRITE_KV:
        slot = tl.load(slot_ptr + seq).to(tl.int64)
        new_k = kn_ptr + seq.to(tl.int64) * stride_nb + kvh * stride_nh
        new_v = vn_ptr + seq.to(tl.int64) * stride_vnb + kvh * stride_vnh
        dst_k = k_ptr + (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_kt + kvh * stride_kh
        dst_v = v_ptr + (slot // BLOCK_SIZE) * stride_vb + (slot % BLOCK_SIZE) * stride_vt + kvh * stride_vh
        mine = d_mask & ((offs_d * 0 + split) == (ctx - 1) // PARTITION)  # a vector mask (interpreter)
        if ROPE:
            key = tl.load(new_k + offs_d, mask=mine).to(tl.float32) * cos
            key += sign * tl.load(new_k + partner, mask=mine).to(tl.float32) * sin
        else:
            key = tl.load(new_k + offs_d, mask=mine)
        tl.store(dst_k + offs_d, key.to(k_ptr.dtype.element_ty), mask=mine)
        tl.store(dst_v + offs_d, tl.load(new_v + offs_d, mask=mine).to(v_ptr.dtype.element_ty), mask=mine)
        tl.debug_barrier()  # the block's own writes are visible to its loads below
    heads = kvh * GROUP + offs_g
    q_rows = q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
    qd_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(q_rows + offs_d[None, :], mask=qd_mask, other=0.0)
    if ROPE:
        q = q.to(tl.float32) * cos[None, :]
        q += sign[None, :] * tl.load(q_rows + partner[None, :], mask=qd_mask, other=0.0).to(tl.float32) * sin[None, :]
    q = q.to(k_ptr.dtype.element_ty)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], dtype=tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_btb
    # (the bound stays inline: the interpreter turns every assigned value into a tensor, a constexpr too)
    for start in range(0 if INTERPRET_TOKENS > 0 else lo, INTERPRET_TOKENS if INTERPRET_TOKENS > 0 else hi, BLOCK_N):
        pos = start + offs_n
        n_mask = (pos >= lo) & (pos < hi)
        block = tl.load(bt_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        within = pos % BLOCK_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(
            k_ptr + (block * stride_kb + within * stride_kt + kvh * stride_kh)[:, None] + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            v_ptr + (block * stride_vb + within * stride_vt + kvh * stride_vh)[:, None] + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k), input_precision="ieee") if IEEE else tl.dot(q, tl.trans(k))
        s = tl.where(n_mask[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no step has seen a token yet: no NaN
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee") if IEEE else tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # context_len 0: zeros
        tl.store(
            out_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None] & d_mask[None, :],
        )
    else:
        part = (seq.to(tl.int64) * tl.num_programs(1) + kvh) * NUM_SPLITS + split
        tl.store(part_m_ptr + part * GROUP_PAD + offs_g, m_i)
        tl.store(part_l_ptr + part * GROUP_PAD + offs_g, l_i)
        tl.store(part_acc_ptr + (part * GROUP_PAD + offs_g[:, None]) * DIM_PAD + offs_d[None, :], acc)


@triton.jit
def _reduce_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, stride_ob, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    """Combine the NUM_SPLITS partial results of (sequence, kv head) (log-sum-exp rescaling, base 2)."""
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, DIM_PAD)
    first = (seq.to(tl.int64) * tl.num_programs(1) + kvh) * NUM_SPLITS
    m = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    for i in tl.static_range(NUM_SPLITS):
        m = tl.maximum(m, tl.load(part_m_ptr + (first + i) * GROUP_PAD + offs_g))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    l_sum = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], dtype=tl.float32)
    for i in tl.static_range(NUM_SPLITS):
        weight = tl.exp2(tl.load(part_m_ptr + (first + i) * GROUP_PAD + offs_g) - m_safe)
        l_sum += weight * tl.load(part_l_ptr + (first + i) * GROUP_PAD + offs_g)
        part = tl.load(part_acc_ptr + ((first + i) * GROUP_PAD + offs_g[:, None]) * DIM_PAD + offs_d[None, :])
        acc += weight[:, None] * part
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    heads = kvh * GROUP + offs_g
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=(offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :],
    )
