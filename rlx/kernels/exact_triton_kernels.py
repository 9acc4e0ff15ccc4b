"""The Triton kernels of exact mode on CUDA (rlx/kernels/exact_triton.py holds the host side). Imported on first use,
so importing rlx needs no triton and TRITON_INTERPRET (read when these are defined) may be set until the first call.

The kernels are batch-invariant by construction: every program runs the same instruction sequence (the tile shapes
and the loop orders are constexprs that never depend on how many rows or tokens a call holds), and a row's or a
token's result depends only on its own inputs, so it is the same bits in a call of 1 row or 10,000.
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M"])
def exact_matmul_kernel(
    x_ptr, w_ptr, b_ptr, r_ptr, out_ptr, p_ptr, c_ptr, M, N, K, chunk_k, stride_xm, stride_wn, stride_rm, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    SPLIT: tl.constexpr, GRID_SPLIT: tl.constexpr,
):  # fmt: skip
    """out [M, N] = x [M, K] @ w[N, K].T (+ b [N]): one BLOCK_M x BLOCK_N tile per program. K is cut into SPLIT
    chunks of chunk_k (SPLIT fixed by the weight's K alone, never by M); each chunk's K slices are taken in order
    into a float32 accumulator starting at zero, and the chunks' sums are added in order, chunk 0 first. Either the
    program walks all the chunks (SPLIT 1: the whole K in order, no split) or (GRID_SPLIT: few rows, more programs
    than the tiles alone) program (tile, c) writes chunk c's sum to the float32 partials p [SPLIT, M, N] and counts
    itself done in c [tiles] (int32 zeros); the tile's last program adds the partials in the same order (the same
    float32 additions, the same bits) and zeroes the count. Then the bias added in float32, one rounding to out's
    dtype (`_matmul_epilogue`). x in w's dtype, or float32 for a lower-precision w (each element rounded to w's dtype
    as it is loaded). M is not specialised on (a call of 1 row and one of 4,096 compile the same code); tiles grouped
    GROUP_M along M so the programs sharing a weight tile run together (the order of programs changes no value).
    EVEN_K: chunk_k is a multiple of BLOCK_K, so the loads need no mask along K (the values are the same either way).
    HAS_RESIDUAL: out = r [M, N] + the product rounded to w's dtype, added in float32 and rounded once to out's dtype
    (the bits of eager `residual + F.linear(...)` under autocast: a decoder layer's residual add folded into its o /
    down projection)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    if GRID_SPLIT:
        part = tl.program_id(1)
        acc = _k_chunk(x_ptr, w_ptr, offs_m, offs_n, m_mask, n_mask, part * chunk_k, part * chunk_k + chunk_k, K,
                       stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, EVEN_K)  # fmt: skip
        mask = m_mask[:, None] & n_mask[None, :]
        tl.store(p_ptr + (part * M + offs_m)[:, None] * N + offs_n[None, :], acc, mask=mask)
        # the tile's last chunk to finish sums them all (in chunk order, whichever came last)
        tl.debug_barrier()  # every thread's partial stored before the count
        done = tl.atomic_add(c_ptr + pid, 1, sem="acq_rel")
        if done == SPLIT - 1:
            acc = tl.load(p_ptr + offs_m[:, None] * N + offs_n[None, :], mask=mask, other=0.0, cache_modifier=".cg")
            for other in tl.static_range(1, SPLIT):
                acc += tl.load(p_ptr + (other * M + offs_m)[:, None] * N + offs_n[None, :], mask=mask, other=0.0,
                               cache_modifier=".cg")  # fmt: skip
            _matmul_epilogue(acc, w_ptr, b_ptr, r_ptr, out_ptr, offs_m, offs_n, m_mask, n_mask, stride_rm, stride_om,
                             HAS_BIAS, HAS_RESIDUAL)  # fmt: skip
            tl.atomic_xchg(c_ptr + pid, 0)  # the counter back to zero for the next call
    else:
        acc = _k_chunk(x_ptr, w_ptr, offs_m, offs_n, m_mask, n_mask, 0, chunk_k, K, stride_xm, stride_wn, BLOCK_M,
                       BLOCK_N, BLOCK_K, IEEE, EVEN_K)  # fmt: skip
        for part in tl.static_range(1, SPLIT):
            acc += _k_chunk(x_ptr, w_ptr, offs_m, offs_n, m_mask, n_mask, part * chunk_k, part * chunk_k + chunk_k,
                            K, stride_xm, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, EVEN_K)  # fmt: skip
        _matmul_epilogue(acc, w_ptr, b_ptr, r_ptr, out_ptr, offs_m, offs_n, m_mask, n_mask, stride_rm, stride_om,
                         HAS_BIAS, HAS_RESIDUAL)  # fmt: skip


@triton.jit
def _k_chunk(
    x_ptr, w_ptr, offs_m, offs_n, m_mask, n_mask, k_first, k_last, K, stride_xm, stride_wn, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """The float32 sum over K columns k_first..k_last - 1 of a tile's products, from zero, BLOCK_K columns at a time
    in order (`tl.dot` chains the accumulator 16 columns an MMA step, whatever the tile)."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_first, k_last, BLOCK_K):
        if EVEN_K:
            a_mask, b_mask = m_mask[:, None], n_mask[None, :]
        else:
            k_mask = (k + offs_k) < K
            a_mask, b_mask = m_mask[:, None] & k_mask[None, :], k_mask[:, None] & n_mask[None, :]
        a_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k + offs_k)[None, :]
        # float32 x for bf16 weights: rounded to nearest even, as `x.to(bfloat16)`
        a = tl.load(a_ptrs, mask=a_mask, other=0.0).to(w_ptr.dtype.element_ty)
        b = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + (k + offs_k)[:, None], mask=b_mask, other=0.0)
        acc = tl.dot(a, b, acc, input_precision="ieee") if IEEE else tl.dot(a, b, acc)
    return acc


@triton.jit
def _matmul_epilogue(
    acc, w_ptr, b_ptr, r_ptr, out_ptr, offs_m, offs_n, m_mask, n_mask, stride_rm, stride_om, HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """The bias (float32), the residual (added to the product rounded to w's dtype) and the one rounding to out's
    dtype, stored: the same instructions after a walked K and after a grid split's sum."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    mn_mask = m_mask[:, None] & n_mask[None, :]
    if HAS_RESIDUAL:
        residual = tl.load(r_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mn_mask, other=0.0)
        acc = residual.to(tl.float32) + acc.to(w_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mn_mask)


@triton.jit
def _copy_row(src, dst, offs, mask):
    """One head's row of a new key or value into its cache slot (no arithmetic: the bits as given)."""
    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit
def exact_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, len_ptr, row_ptr, start_ptr, bt_ptr, kn_ptr, vn_ptr, slot_ptr, scale_log2,
    stride_qn, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_on, stride_oh,
    stride_btb, stride_knn, stride_knh, stride_vnn, stride_vnh,
    PAGED: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    GROUP_PAD: tl.constexpr, DIM_PAD: tl.constexpr, KEY_BLOCK: tl.constexpr, IEEE: tl.constexpr,
    INTERPRET_KEYS: tl.constexpr, WRITE_KV: tl.constexpr,
):  # fmt: skip
    """One program per (query token, kv head): the token's GROUP query heads against its keys 0..length-1, taken in
    blocks of KEY_BLOCK from position 0 in order, merged with an online softmax (base 2, float32 statistics).

    Keys come from a paged cache (PAGED: position p of the token's sequence at block bt[row, p // BLOCK_SIZE], offset
    p % BLOCK_SIZE) or from contiguous rows (position p at row start + p); the arithmetic per (query, key) is the
    same either way. Scores: tl.dot of the [GROUP_PAD, DIM_PAD] queries with the [KEY_BLOCK, DIM_PAD] keys (input
    dtype, float32 accumulation; IEEE float32 dots for float32 inputs); P @ V: float32 IEEE dots, or (16-bit
    values) the probabilities split into a 16-bit head and tail, two dots summed (about 16 bits of the
    probabilities kept). Under the interpreter the constexpr INTERPRET_KEYS bounds the loop instead of the loaded
    length (NumPy refuses a 1-element array as a bound); the extra blocks are fully masked and change no bit.
    WRITE_KV (paged decode: each query its sequence's last token): the program first stores its token's new key and
    value (kn, vn [N, Hkv, D], in the cache's dtype) at the token's slot, then reads them back with the others."""
    token = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    length = tl.load(len_ptr + token)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, DIM_PAD)
    offs_n = tl.arange(0, KEY_BLOCK)
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    qd_mask = (offs_g < GROUP)[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + token * stride_qn + heads[:, None] * stride_qh + offs_d[None, :], mask=qd_mask, other=0.0)
    if IEEE:
        q = q.to(tl.float32)
    if PAGED:
        table = bt_ptr + tl.load(row_ptr + token).to(tl.int64) * stride_btb
        if WRITE_KV:
            slot = tl.load(slot_ptr + token).to(tl.int64)
            _copy_row(kn_ptr + token * stride_knn + kvh * stride_knh, k_ptr + (slot // BLOCK_SIZE) * stride_kb
                      + (slot % BLOCK_SIZE) * stride_kt + kvh * stride_kh, offs_d, d_mask)  # fmt: skip
            _copy_row(vn_ptr + token * stride_vnn + kvh * stride_vnh, v_ptr + (slot // BLOCK_SIZE) * stride_vb
                      + (slot % BLOCK_SIZE) * stride_vt + kvh * stride_vh, offs_d, d_mask)  # fmt: skip
            tl.debug_barrier()  # the program's own writes are visible to its loads below
    else:
        start = tl.load(start_ptr + token).to(tl.int64)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], dtype=tl.float32)
    for first in range(0, INTERPRET_KEYS if INTERPRET_KEYS > 0 else length, KEY_BLOCK):
        pos = first + offs_n
        n_mask = pos < length
        if PAGED:
            block = tl.load(table + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
            k_rows = block * stride_kb + (pos % BLOCK_SIZE) * stride_kt
            v_rows = block * stride_vb + (pos % BLOCK_SIZE) * stride_vt
        else:
            k_rows = (start + pos) * stride_kt
            v_rows = (start + pos) * stride_vt
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + (k_rows + kvh * stride_kh)[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + (v_rows + kvh * stride_vh)[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        s = tl.where(n_mask[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: position 0 is in every query's first block
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            p_head = p.to(v.dtype)
            p_tail = (p - p_head.to(tl.float32)).to(v.dtype)
            pv = tl.dot(p_head, v) + tl.dot(p_tail, v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + token * stride_on + heads[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=qd_mask,
    )


@triton.jit
def exact_rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, low_ptr, stride_x, stride_o, stride_l, N, eps, BLOCK: tl.constexpr, LOW: tl.constexpr
):  # fmt: skip
    """One program per row of x [R, N]: the Llama-family RMSNorm. The float32 mean of the row's squares is one
    tl.sum over BLOCK >= N lanes (the padding lanes zero), h = x * rsqrt(mean + eps) is rounded to x's dtype, then
    multiplied by the weight in out's dtype (torch's promotion of the weight's and x's dtypes), the product computed
    in float32. A row's arithmetic does not depend on the other rows. LOW: the result is also written rounded to
    low's dtype (to nearest even: the bits of `out.to(low dtype)`) from the same registers. The compiler may lay the
    reduction out differently for other stores, so a caller that needs low's bits equal across calls runs this
    variant in every one of them (rlx/models/exact.py)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x * x, 0) / N
    h = (x * tl.math.rsqrt(mean + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = (w * h.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + offs, out, mask=mask)
    if LOW:
        tl.store(low_ptr + row * stride_l + offs, out.to(low_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["R", "rows_per_program"])
def exact_rms_norm_backward_kernel(
    x_ptr, w_ptr, g_ptr, dx_ptr, dw_ptr, stride_x, stride_g, stride_dx, R, N, rows_per_program, eps,
    BLOCK: tl.constexpr, WANT_DX: tl.constexpr, WANT_DW: tl.constexpr,
):  # fmt: skip
    """The gradients of `exact_rms_norm_kernel`'s out = w * round(h), h = x * rstd, rstd = rsqrt(mean(x^2) + eps),
    for the upstream gradient g [R, N] (out's dtype), all in float32 (the rounding to x's dtype taken as the
    identity, as autograd takes `.to`). Program p walks rows p * rows_per_program onwards, in order:

    - WANT_DX: dx = rstd * (gh - h * mean(gh * h)) with gh = g * w, written per row in dx's dtype (x's);
    - WANT_DW: the sum over its rows of g * round(h), written to row p of the float32 partials dw [programs, N]
      (the host sums them: a fixed order, no atomics, so the same bits run to run).

    The rows past R are masked (x and g read as 0, nothing written); gradients need no batch invariance."""
    pid = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, rows_per_program):
        row = pid * rows_per_program + i
        row_mask = offs < tl.where(row < R, N, 0)  # (not mask & (row < R): the interpreter refuses that mask)
        x = tl.load(x_ptr + row * stride_x + offs, mask=row_mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row * stride_g + offs, mask=row_mask, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(x * x, 0) / N + eps)
        h = x * rstd
        if WANT_DW:
            dw += g * h.to(x_ptr.dtype.element_ty).to(tl.float32)
        if WANT_DX:
            gh = g * w
            dx = rstd * (gh - h * (tl.sum(gh * h, 0) / N))
            tl.store(dx_ptr + row * stride_dx + offs, dx.to(dx_ptr.dtype.element_ty), mask=row_mask)
    if WANT_DW:
        tl.store(dw_ptr + pid * N + offs, dw, mask=mask)


@triton.jit
def exact_logprob_backward_kernel(
    x_ptr, t_ptr, gp_ptr, ge_ptr, grad_ptr, stride_x, stride_g, V, inv_t,
    BLOCK_V: tl.constexpr, WITH_ENTROPY: tl.constexpr,
):  # fmt: skip
    """The gradient of exact mode's logprobs and entropy (rlx/kernels/sampling.py's draw kernels) with respect to the
    logits, one program per row of x [R, V] (the logits before the temperature, any float dtype): z = x / T,
    p = softmax(z), and
    dx = (gp * (onehot(t) - p) - ge * p * (log p + H)) / T for the row's upstream gradients gp (logprob) and ge
    (entropy), written in grad's dtype. Two passes for the statistics and one to write: the gradient needs no batch
    invariance, only the row's own float32 arithmetic."""
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_x
    offs = tl.arange(0, BLOCK_V)
    lane_max = tl.full([BLOCK_V], float("-inf"), dtype=tl.float32)
    for first in range(0, V, BLOCK_V):
        z = tl.load(base + first + offs, mask=first + offs < V, other=float("-inf")).to(tl.float32) * inv_t
        lane_max = tl.maximum(lane_max, z)
    top = tl.max(lane_max, 0)
    sums = tl.zeros([BLOCK_V], dtype=tl.float32)
    weighted = tl.zeros([BLOCK_V], dtype=tl.float32)
    for first in range(0, V, BLOCK_V):
        mask = first + offs < V
        shifted = tl.load(base + first + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_t - top
        p = tl.exp(shifted)
        sums += p
        if WITH_ENTROPY:
            weighted += p * tl.where(mask, shifted, 0.0)
    total = tl.sum(sums, 0)
    log_total = tl.log(total)
    gp = tl.load(gp_ptr + row)
    target = tl.load(t_ptr + row)
    entropy = log_total - tl.sum(weighted, 0) / total
    ge = tl.load(ge_ptr + row) if WITH_ENTROPY else 0.0
    for first in range(0, V, BLOCK_V):
        mask = first + offs < V
        logp = tl.load(base + first + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_t - top - log_total
        p = tl.exp(logp)
        g = tl.where(first + offs == target, gp, 0.0) - p * gp
        if WITH_ENTROPY:
            g -= p * tl.where(mask, logp + entropy, 0.0) * ge
        tl.store(grad_ptr + row * stride_g + first + offs, (g * inv_t).to(grad_ptr.dtype.element_ty), mask=mask)
