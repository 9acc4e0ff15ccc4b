"""Exact mode's arithmetic on CUDA: batch-invariant Triton matmul, RMSNorm and attention (exact_triton_kernels.py).

rlx/kernels/exact.py keeps the plain-PyTorch scheme (the CPU's, pinned by the CPU tests); on a CUDA device with
triton, exact mode runs these instead (`use_triton`), in every path alike (trainer forward, engine prefill and
decode), so the rollout's and the trainer's logprobs stay equal bit for bit:

- `exact_linear`: `F.linear` as one launch for any number of rows, tiles chosen by the shapes (`matmul_plan`), K in
  order (in chunks fixed by K alone, `split_k`, added in order), float32 accumulation, in autocast's dtype where
  autocast is on (as `F.linear` under autocast). It replaces
  the 64-row cuBLAS calls of `blocked_linear`. Differentiable (the backward is two ordinary matmuls: gradients need no
  batch invariance). With a residual it returns `residual + F.linear(...)` from the same kernel (the eager add's bits).
- `exact_logprobs` / `exact_target_logprobs`: the log-probability of each row's target (and the row's entropy)
  from float32 logits divided by the temperature: the native engine's sampler's own (its draw kernels' fixed
  vocabulary slices, rlx/kernels/sampling.py), so a sampled token costs no second pass for its logprob and the
  trainer runs the same kernels; the trainer's differentiable, its backward one kernel (three passes over the row,
  where the PyTorch formula made about ten over a float32 copy).
- `exact_rms_norm`: the Llama-family RMSNorm, one program per row (one kernel where the PyTorch scheme's
  `tree_sum` takes about twenty); differentiable, its backward one kernel too (`exact_rms_norm_backward_kernel`:
  programs of consecutive rows, each writing dx and its share of the weight's gradient, where the PyTorch formula made
  about ten passes over a float32 copy).
- `exact_attention`: per (query token, kv head), the token's keys in KEY_BLOCK blocks from position 0, from a paged
  KV cache (block tables) or from contiguous rows (a training forward's packed or padded samples); sequence
  lengths stay on the device (no host sync: CUDA-graph capturable); at a decode step it writes the step's keys and
  values into the paged cache itself. `exact_packed_attention` is the trainer's,
  differentiable (the backward recomputes the attention with SDPA on a padded layout).

Both also run on the CPU under TRITON_INTERPRET=1 (the tests), with small tiles.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F

from rlx.kernels.exact import KEY_BLOCK
from rlx.kernels.sampling import draw_tokens_triton, picked_logprobs

HAS_TRITON = importlib.util.find_spec("triton") is not None
SMALL_TILES = (64, 64, 64, 4, 4)
"""BLOCK_M, BLOCK_N, BLOCK_K, warps, stages of the matmul on CUDA for a call's few rows (decode steps), and for up to
DECODE_ROWS rows against a weight narrower than WIDE_N outputs: enough programs to fill the device (the 0.5B shape's
gate/up stack, 9,728 outputs, at 256 rows: 13.8 us against MEDIUM_TILES' 14.9 on an H200, sixteenth session)."""
NARROW_TILES = (64, 32, 128, 4, 3)
"""For a call of few rows whose 64 x 32 tiles number no more than the device's SMs (a decode step's o and down
projections, its k/v): narrower tiles, more programs, a longer K slice. bench/exact_matmul.py on an H100 (device time
in a CUDA graph, bench/RESULTS.md "Exact", fifteenth session): the 0.5B down projection at 256 rows 12.7 us against
SMALL_TILES' 14.8, the 7B one at 64 rows 73.7 against 89.9, each with the same bits as every other set; slower where
the tiles outnumber the SMs (the 0.5B gate/up at 64 rows, 5.6 against 4.7 us)."""
DECODE_WIDE_TILES, DECODE_WIDE_N = (64, 128, 64, 4, 3), 8192
"""More than FEW_ROWS rows, up to DECODE_ROWS, against DECODE_WIDE_N to WIDE_N outputs: the 0.5B shape's gate/up
stack at 256 rows 13.7-13.9 us against SMALL_TILES' 15.6 (bench/exact_matmul.py --cold, one H200, seventeenth
session, two calls)."""
MEDIUM_TILES, LARGE_TILES = (128, 128, 64, 8, 3), (256, 128, 64, 8, 3)
"""More rows: 128 x 128 tiles; 256 x 128 where the weight has LARGE_WEIGHT elements or more (the 7B shape's
projections, an LM head), where they were fastest (bench/exact_matmul.py on an H100, bench/RESULTS.md, "Exact")."""
DECODE_ROWS, FEW_ROWS, WIDE_N, LARGE_WEIGHT, IEEE_WIDE_N = 512, 64, 16384, 12 * 2**20, 2048
"""The tiles change no bit of the result: each program's K loop chains its float32 accumulator through `tl.dot` in
order, 16 columns an MMA step, whatever the tile sizes (every candidate of bench/exact_matmul.py gave the bits of
every other on an H100, and tests/gpu/test_exact_cuda.py checks the sets in use), so a call picks them by its number
of rows, and a row still gets the same bits in a call of 1 row or 30,000."""
# the interpreter: one row a tile (NumPy's matmul, the interpreter's tl.dot, rounds a row by its position in the tile)
_INTERPRETER_TILES = (1, 64, 64, 1, 1)
_GROUP_M = 8
_ATTENTION_WARPS = 4
_ATTENTION_STAGES = 2  # with KEY_BLOCK 64: bench/exact_attention.py (3, Triton's default, 16.7 us against 16.0)


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether exact mode runs this module's kernels for `tensor` (a CUDA tensor, triton installed)."""
    return HAS_TRITON and tensor.device.type == "cuda"


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _kernels() -> types.ModuleType:
    """rlx/kernels/exact_triton_kernels.py, imported on first use."""
    from rlx.kernels import exact_triton_kernels

    return exact_triton_kernels


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


SPLIT_CHUNK, SPLIT_MIN_CHUNK, SPLITS = 128, 1024, (4, 2)
"""`split_k`: K is cut into the most of SPLITS chunks that are multiples of SPLIT_CHUNK (so of every tile's BLOCK_K)
and at least SPLIT_MIN_CHUNK long. The 0.5B down projection (K 4,864) in 2, the 7B shape's projections (K 3,584) in
2 and its down projection (18,944) in 4; K 896 (the 0.5B shape's other weights) not at all."""


_COUNTS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _tile_counts(device: torch.device, tiles: int) -> torch.Tensor:
    """int32 zeros counting each tile's finished chunks in a grid split (each call leaves them zero: its
    last program resets its tile's count), grown where a call has more tiles: one buffer a stream (the calls on one
    stream run one after another; an engine's CUDA graphs keep their capture stream's, which no other work uses)."""
    key = (device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    counts = _COUNTS.get(key)
    if counts is None or counts.numel() < tiles:
        counts = _COUNTS[key] = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
    return counts


def split_k(depth: int) -> int:
    """How many chunks of K `exact_matmul` sums separately for a weight of `depth` inputs: a function of the weight
    alone, so a row's bits stay the same in a call of 1 row or 30,000. A decode step's few rows give few tiles, each
    walking the whole K in order: chunks run as separate programs there (`exact_matmul_kernel`'s GRID_SPLIT)."""
    for split in SPLITS:
        chunk = depth // split
        if depth % (split * SPLIT_CHUNK) == 0 and chunk >= SPLIT_MIN_CHUNK:
            return split
    return 1


SPLIT_SMALL_TILES, SPLIT_WIDE_TILES, SPLIT_WIDE_CHUNK = (64, 64, 64, 4, 5), (128, 256, 64, 8, 3), 4096
"""A decode step's matmul of a weight whose K `split_k` cuts (bench/exact_matmul.py --cold, one H200, seventeenth
session): the chunks run as separate programs with the tiles of NARROW_TILES, SPLIT_SMALL_TILES or (more than
FEW_ROWS rows, chunks of SPLIT_WIDE_CHUNK or more) SPLIT_WIDE_TILES whose programs, tiles times chunks, number most
within twice the SMs: the 0.5B down projection at 256 rows 14.1 us against 18.5 unsplit, the 7B one at 64 rows 42.6
against 69.7 and at 256 rows 70.1 against 94.7, the 7B q/o at 64 rows 13.8 against 15.8. Where none fits (the wide
gate/up), a program walks the chunks in turn: no partials, the unsplit call's programs."""
SPLIT_LARGE_TILES = (128, 128, 128, 8, 3)
"""Tiles for MEDIUM_TILES' and LARGE_TILES' calls against a weight whose K is cut, its chunks walked: a program keeps
two float32 accumulators, which LARGE_TILES' 256 x 128 cannot hold in registers (the 0.5B down projection at 16,384
rows 0.272 ms against MEDIUM_TILES' 0.297; the 7B gate/up stack at 256 rows 0.149 against 0.176)."""


def matmul_plan(
    outputs: int, depth: int, rows: int, dtype: torch.dtype = torch.bfloat16, sms: int = 132
) -> tuple[tuple[int, ...], int, bool]:
    """(tiles, K's chunks, whether the chunks run as separate programs) of `exact_matmul` on CUDA for `rows` x [depth]
    inputs and a weight [outputs, depth] of `dtype` on a device of `sms` multiprocessors: `split_k`'s chunks (the
    weight's alone), tiles and grid by speed (none of those changes a bit: DECODE_ROWS' and `split_k`'s notes)."""
    split = split_k(depth)
    if split > 1 and dtype == torch.bfloat16 and rows <= DECODE_ROWS:
        candidates = [NARROW_TILES, SPLIT_SMALL_TILES]
        if rows > FEW_ROWS and depth // split >= SPLIT_WIDE_CHUNK:
            candidates.append(SPLIT_WIDE_TILES)
        programs = {t: _cdiv(rows, t[0]) * _cdiv(outputs, t[1]) * split for t in candidates}
        fitting = [t for t in candidates if programs[t] <= 2 * sms]
        if fitting:
            return max(fitting, key=programs.get), split, True
    tiles = matmul_tiles(outputs, depth, rows, dtype, sms)
    if split > 1 and tiles in (LARGE_TILES, MEDIUM_TILES):
        tiles = SPLIT_LARGE_TILES
    return tiles, split, False


def matmul_tiles(
    outputs: int, depth: int, rows: int, dtype: torch.dtype = torch.bfloat16, sms: int = 132
) -> tuple[int, ...]:
    """The CUDA tiles (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of `exact_matmul` for `rows` x [depth] inputs and a
    weight [outputs, depth] of `dtype` on a device of `sms` multiprocessors, K in one piece (the fastest measured;
    any of them gives the same bits: DECODE_ROWS' note; `matmul_plan` for a K cut in chunks). A weight in another
    dtype than bfloat16 (float32's IEEE dots, float16: not measured by rows) takes tiles by its width alone."""
    if dtype != torch.bfloat16:
        return MEDIUM_TILES if outputs >= IEEE_WIDE_N else SMALL_TILES
    if rows <= DECODE_ROWS and _cdiv(rows, NARROW_TILES[0]) * _cdiv(outputs, NARROW_TILES[1]) <= sms:
        return NARROW_TILES
    if FEW_ROWS < rows <= DECODE_ROWS and DECODE_WIDE_N <= outputs < WIDE_N:
        return DECODE_WIDE_TILES
    if rows <= FEW_ROWS or (rows <= DECODE_ROWS and outputs < WIDE_N):
        return SMALL_TILES
    if rows <= DECODE_ROWS or outputs * depth < LARGE_WEIGHT:
        return MEDIUM_TILES
    return LARGE_TILES


def exact_matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, tiles: tuple | None = None,
    residual: torch.Tensor | None = None, split: int | None = None, grid_split: bool | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [M, K] @ weight [N, K].T (+ bias [N]) -> [M, N] in weight's dtype, batch-invariantly (no autograd). x in
    weight's dtype (bfloat16, float16 or float32: IEEE float32 dots, no TF32), or float32 for a bfloat16 / float16
    weight: the kernel rounds x as it loads it, the bits of `x.to(weight.dtype)` without that copy. `tiles`: other
    (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) than `matmul_plan`'s on CUDA (bench/exact_matmul.py). `residual` [M,
    N]: returns `residual + product` in their promoted dtype, the bits of that eager add (one kernel, no product
    written). `split`: K's chunks (default `split_k`'s; tests and benchmarks); `grid_split`: the chunks as separate
    programs, the tile's last one adding them, else each program walks them all (the same bits either way; default:
    `matmul_plan`'s, with given tiles where the programs number at most twice the SMs at up to DECODE_ROWS rows)."""
    if x.dtype != weight.dtype and x.dtype != torch.float32:
        raise ValueError(f"exact_matmul: x is {x.dtype}, weight {weight.dtype}")
    x, weight = x.contiguous(), weight.contiguous()
    (rows, depth), outputs = x.shape, weight.shape[0]
    if residual is not None:
        if residual.shape != (rows, outputs):
            raise ValueError(f"exact_matmul: residual {tuple(residual.shape)}, product {(rows, outputs)}")
        residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    dtype = weight.dtype if residual is None else torch.promote_types(residual.dtype, weight.dtype)
    out = x.new_empty(rows, outputs, dtype=dtype)
    if rows == 0:
        return out
    cuda = x.device.type == "cuda"
    sms = _multiprocessors(x.device) if cuda else 132
    if cuda and tiles is None and split is None:
        tiles, split, planned = matmul_plan(outputs, depth, rows, weight.dtype, sms)
        grid_split = planned if grid_split is None else grid_split
    elif cuda and tiles is None:
        tiles = matmul_tiles(outputs, depth, rows, weight.dtype, sms)
    tile_m, tile_n, tile_k, warps, stages = tiles or _INTERPRETER_TILES
    split = split or split_k(depth)
    chunk = depth // split
    if depth % split or (split > 1 and chunk % tile_k):
        raise ValueError(f"exact_matmul: K {depth} does not cut into {split} chunks of whole {tile_k}-column tiles")
    tiles_count = _cdiv(rows, tile_m) * _cdiv(outputs, tile_n)
    if grid_split is None:
        grid_split = rows <= DECODE_ROWS and tiles_count * split <= 2 * sms
    grid_split = grid_split and split > 1
    partials = x.new_empty(split, rows, outputs, dtype=torch.float32) if grid_split else out
    counts = _tile_counts(x.device, tiles_count) if grid_split else partials
    bias_arg, residual_rows = out if bias is None else bias.contiguous(), out if residual is None else residual
    _kernels().exact_matmul_kernel[(tiles_count, split if grid_split else 1)](
        x, weight, bias_arg, residual_rows, out, partials, counts, rows, outputs, depth, chunk, x.stride(0),
        weight.stride(0), residual_rows.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=tile_m,
        BLOCK_N=tile_n, BLOCK_K=tile_k, GROUP_M=_GROUP_M, IEEE=x.dtype == torch.float32, EVEN_K=chunk % tile_k == 0,
        HAS_RESIDUAL=residual is not None, SPLIT=split, GRID_SPLIT=grid_split, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


class _ExactLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, residual):
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.residual_dtype = bias is not None, None if residual is None else residual.dtype
        return exact_matmul(x, weight, bias, residual=residual)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_r = None if ctx.residual_dtype is None else grad.to(ctx.residual_dtype)
        grad = grad.to(weight.dtype)  # with a residual: the product's cast to the sum's dtype, transposed
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        grad_w = grad.t() @ x if ctx.needs_input_grad[1] else None
        grad_b = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, grad_r


def exact_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` over the flattened rows of x [..., K] with `exact_matmul` -> [..., N]; under
    autocast the inputs are cast to autocast's dtype first (the dtype `F.linear` would compute in). `residual`
    [..., N]: `residual + F.linear(...)` instead, in one kernel with the same bits."""
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    rows, weight, bias = x.reshape(-1, x.shape[-1]), weight.to(dtype), None if bias is None else bias.to(dtype)
    residual_rows = None if residual is None else residual.reshape(-1, weight.shape[0])
    if torch.is_grad_enabled() and (rows.requires_grad or weight.requires_grad or residual is not None
                                    and residual.requires_grad):  # fmt: skip
        out = _ExactLinear.apply(rows.to(dtype), weight, bias, residual_rows)  # the backward's matmuls take x in dtype
    else:  # generation: a float32 input is rounded inside the kernel (no copy)
        rows = rows if rows.dtype == torch.float32 else rows.to(dtype)
        out = exact_matmul(rows, weight, bias, residual=residual_rows)
    return out.view(*x.shape[:-1], weight.shape[0])


def exact_attention(
    q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, lengths: torch.Tensor, scale: float, *,
    starts: torch.Tensor | None = None, rows: torch.Tensor | None = None, block_tables: torch.Tensor | None = None,
    config: tuple[int, int, int] | None = None, new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:  # fmt: skip
    """Causal attention of each query token over its own keys, batch-invariantly (no autograd).

    q [N, H, D]; lengths [N]: keys each query sees (its position + 1). Keys and values either contiguous, k_store
    [S, Hkv, D] / v_store [S, Hkv, D] with `starts` [N] (the store row of each query's position 0), or a paged
    cache, k_store [num_blocks, block_size, Hkv, D] with `block_tables` [B, max_blocks] and `rows` [N] (each query's
    row of the tables). q and the stores share a dtype. -> [N, H, D] in q's dtype. `lengths` in int32 are taken as
    they are (each at least 1: a decode step's, prepared once for all its layers); others are converted and clamped
    to 1. `config`: other (key block, warps, stages) than exact mode's (bench/exact_attention.py; another key block
    sums in another order: other bits than the trainer's). `new_kv` (paged decode only: each query its sequence's
    last token): (k [N, Hkv, D], v, slots [N]) written into the cache by the kernel itself before it reads (what
    `write_kv` does in two launches)."""
    key_block, warps, stages = config or (KEY_BLOCK, _ATTENTION_WARPS, _ATTENTION_STAGES)
    paged = block_tables is not None
    if paged == (starts is not None):
        raise ValueError("exact_attention: give either starts (contiguous keys) or block_tables and rows (paged)")
    n, heads, dim = q.shape
    kv_heads = k_store.shape[-2]
    q, k_store, v_store = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k_store, v_store))
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if n == 0:
        return out
    if lengths.dtype != torch.int32:
        lengths = lengths.to(torch.int32).clamp(min=1)
    lengths = lengths.contiguous()
    if new_kv is not None and not paged:
        raise ValueError("exact_attention: new_kv writes into a paged cache (give block_tables and rows)")
    new_k, new_v, slots = new_kv if new_kv is not None else (q, q, lengths)  # without it: unread placeholders
    new_k, new_v = (t.to(k_store.dtype) for t in (new_k, new_v))
    new_k, new_v = (t if t.stride(-1) == 1 else t.contiguous() for t in (new_k, new_v))
    if paged:
        tables, token_rows, token_starts = block_tables.to(torch.int32).contiguous(), rows.long().contiguous(), out
        block_size, strides = k_store.shape[1], (*k_store.stride()[:3], *v_store.stride()[:3])
        bound = tables.shape[1] * block_size
    else:
        tables, token_rows, token_starts = lengths, lengths, starts.long().contiguous()
        block_size, strides = 1, (0, *k_store.stride()[:2], 0, *v_store.stride()[:2])
        bound = int(lengths.max()) if _interpreting() else 0  # a host sync only under the interpreter
    _kernels().exact_attention_kernel[(n, kv_heads)](
        q, k_store, v_store, out, lengths, token_rows, token_starts, tables, new_k, new_v, slots,
        scale * math.log2(math.e), q.stride(0), q.stride(1), *strides, out.stride(0), out.stride(1), tables.stride(0),
        new_k.stride(0), new_k.stride(1), new_v.stride(0), new_v.stride(1),
        PAGED=paged, BLOCK_SIZE=block_size, GROUP=heads // kv_heads, HEAD_DIM=dim,
        GROUP_PAD=max(16, _next_pow2(heads // kv_heads)), DIM_PAD=max(16, _next_pow2(dim)), KEY_BLOCK=key_block,
        IEEE=q.dtype == torch.float32, INTERPRET_KEYS=-(-bound // key_block) * key_block if _interpreting() else 0,
        WRITE_KV=new_kv is not None, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def packed_positions(cu_seqlens: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts [N], lengths [N]) of `exact_attention` for N packed tokens whose samples start at cu_seqlens [B + 1]:
    each token's sample start and its position + 1, computed on the device."""
    cu = cu_seqlens.long()
    index = torch.arange(count, device=cu.device)
    starts = cu[torch.bucketize(index, cu[1:], right=True)]
    return starts, index - starts + 1


class _ExactPackedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, scale, recompute):
        ctx.save_for_backward(q, k, v, cu_seqlens)
        ctx.scale, ctx.recompute = scale, recompute
        starts, lengths = packed_positions(cu_seqlens, q.shape[0])
        return exact_attention(q, k, v, lengths, scale, starts=starts)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, cu_seqlens = ctx.saved_tensors
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            recompute = ctx.recompute or functools.partial(_padded_sdpa, cu_seqlens=cu_seqlens, scale=ctx.scale)
            out = recompute(q, k, v)
            grads = torch.autograd.grad(out, (q, k, v), grad)
        return *grads, None, None, None


def _padded_sdpa(q, k, v, cu_seqlens, scale: float) -> torch.Tensor:
    """The same causal attention by SDPA (differentiable, not batch-invariant): packed [N, H, D] -> padded
    [B, H, T, D] -> packed."""
    cu = cu_seqlens.long()
    samples, longest = cu.numel() - 1, int((cu[1:] - cu[:-1]).max())
    starts, lengths = packed_positions(cu, q.shape[0])
    sample, position = torch.bucketize(torch.arange(q.shape[0], device=q.device), cu[1:], right=True), lengths - 1
    group = q.shape[1] // k.shape[1]

    def pad(t: torch.Tensor) -> torch.Tensor:
        padded = t.new_zeros(samples, longest, *t.shape[1:]).index_put((sample, position), t)
        return padded.transpose(1, 2)

    keys, values = (pad(t).repeat_interleave(group, dim=1) for t in (k, v))
    out = F.scaled_dot_product_attention(pad(q), keys, values, is_causal=True, scale=scale)
    return out.transpose(1, 2)[sample, position]


def exact_packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
    recompute: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:  # fmt: skip
    """Causal attention of N packed tokens q [N, H, D], k/v [N, Hkv, D] whose samples start at cu_seqlens [B + 1]
    -> [N, H, D], with `exact_attention`. Differentiable: the backward recomputes the same attention with
    `recompute(q, k, v)` (a varlen kernel; default: SDPA over the samples padded to the longest) and takes its
    gradients, which need not be batch-invariant."""
    return _ExactPackedAttention.apply(q, k, v, cu_seqlens, scale, recompute)


_VOCAB_BLOCK, _INTERPRETER_VOCAB_BLOCK = 1024, 64


def exact_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool = False, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probability of each target [R], entropy [R] or None), float32, of logits [R, V] (any float dtype) divided
    by `temperature` inside the kernels (times its float32 reciprocal, as PyTorch's CUDA `logits.float() /
    temperature`: no float32 copy of the logits) and targets [R], batch-invariantly (no autograd): the sampler's own
    (`picked_logprobs` of the draw kernels' log-normaliser, rlx/kernels/sampling.py), so the engine that drew a
    token and the trainer get its bits from the same kernels, and the entropy from the same pass."""
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    rows = logits.shape[0]
    inverse = inverse_temperature(temperature)
    _, _, lse, entropy = draw_tokens_triton(logits, torch.zeros(rows, device=logits.device), inverse)
    return picked_logprobs(logits, targets, inverse, lse), entropy if with_entropy else None


def inverse_temperature(temperature: float) -> float:
    """1 / temperature rounded to float32, the factor PyTorch's CUDA division by a scalar multiplies by."""
    return float(torch.tensor(1.0) / torch.tensor(float(temperature)))


class _ExactTargetLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, targets, temperature, with_entropy):
        ctx.save_for_backward(rows, targets)
        ctx.temperature = temperature
        picked, entropy = exact_logprobs(rows, targets, with_entropy, temperature)
        return picked, entropy if entropy is not None else picked.new_zeros(0)

    @staticmethod
    def backward(ctx, grad_picked, grad_entropy):
        rows, targets = ctx.saved_tensors
        rows = rows if rows.stride(-1) == 1 else rows.contiguous()
        with_entropy = grad_entropy is not None and grad_entropy.numel() > 0
        grad = torch.empty_like(rows, memory_format=torch.contiguous_format)
        if rows.shape[0]:
            picked = grad_picked.float().contiguous()
            entropy = grad_entropy.float().contiguous() if with_entropy else picked
            block = _VOCAB_BLOCK if rows.device.type == "cuda" else _INTERPRETER_VOCAB_BLOCK
            _kernels().exact_logprob_backward_kernel[(rows.shape[0],)](
                rows, targets.long().contiguous(), picked, entropy, grad, rows.stride(0), grad.stride(0),
                rows.shape[1], inverse_temperature(ctx.temperature), BLOCK_V=block, WITH_ENTROPY=with_entropy,
                num_warps=4,
            )  # fmt: skip
        return grad, None, None, None


def exact_target_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logprob of each target, entropy or None) float32 for logits [..., V] and targets [...] at `temperature`:
    `exact_logprobs` of `logits.float() / temperature` (the sampler's scaling), differentiable (the backward
    recomputes each row's softmax in one kernel, writing the logits' gradient alone: nothing else [rows, V] is made)."""
    flat = logits.reshape(-1, logits.shape[-1])
    picked, entropy = _ExactTargetLogprobs.apply(flat, targets.reshape(-1), temperature, with_entropy)
    return picked.view(targets.shape), entropy.view(targets.shape) if with_entropy else None


def _rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Llama-family RMSNorm in plain PyTorch: what `exact_rms_norm` computes, and (through autograd) the
    gradients its backward kernel is tested against."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class _ExactRmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, low_dtype):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        ctx.set_materialize_grads(False)
        rows = x.reshape(-1, x.shape[-1])
        rows = rows if rows.stride(-1) == 1 else rows.contiguous()
        out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
        # without low_dtype: an empty second output (never an alias of the first, which must stay differentiable)
        low = torch.empty(rows.shape if low_dtype else (0,), dtype=low_dtype or out.dtype, device=x.device)
        low_arg = low if low_dtype else out  # the kernel writes no low copy without LOW: any pointer of out's rows
        if rows.shape[0]:
            _kernels().exact_rms_norm_kernel[(rows.shape[0],)](
                rows, weight.contiguous(), out, low_arg, rows.stride(0), out.stride(0), low_arg.stride(0),
                rows.shape[1], eps, BLOCK=_next_pow2(rows.shape[1]), LOW=low_dtype is not None,
                num_warps=4 if rows.shape[1] <= 4096 else 8,
            )  # fmt: skip
        ctx.out_dtype = out.dtype
        return out.view(*x.shape[:-1], x.shape[-1]), low.view(*x.shape[:-1], x.shape[-1]) if low_dtype else low

    @staticmethod
    def backward(ctx, grad, grad_low):
        x, weight = ctx.saved_tensors
        if grad_low is not None and grad_low.numel():  # low = out.to(low dtype): its gradient cast back, as `.to`'s
            grad_low = grad_low.to(ctx.out_dtype)
            grad = grad_low if grad is None else grad + grad_low
        if grad is None:
            return None, None, None, None
        return *rms_norm_backward(x, weight, grad, ctx.eps, *ctx.needs_input_grad[:2]), None, None


_RMS_BACKWARD_PROGRAMS_PER_SM, _INTERPRETER_RMS_BACKWARD_PROGRAMS = 4, 4


def rms_norm_backward_grid(rows: int, device: torch.device) -> tuple[int, int]:
    """(programs, rows per program) of the RMSNorm backward for `rows` rows: at most a few programs per SM (on the
    CPU, `_INTERPRETER_RMS_BACKWARD_PROGRAMS`), so the weight's float32 partials stay [programs, N] whatever the
    number of rows; the last program may hold fewer rows."""
    if rows == 0:
        return 0, 1
    if device.type == "cuda":
        limit = torch.cuda.get_device_properties(device).multi_processor_count * _RMS_BACKWARD_PROGRAMS_PER_SM
    else:
        limit = _INTERPRETER_RMS_BACKWARD_PROGRAMS
    per_program = _cdiv(rows, min(rows, limit))
    return _cdiv(rows, per_program), per_program


def rms_norm_backward(
    x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor, eps: float, need_x: bool = True, need_w: bool = True
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(grad of x in x's dtype or None, grad of weight in its dtype or None) of `exact_rms_norm(x, weight, eps)` for
    the upstream grad (out's shape [..., N]) with `exact_rms_norm_backward_kernel`: dx per row, the weight's
    gradient as float32 partials per program summed here in a fixed order (deterministic, not batch-invariant)."""
    rows = x.reshape(-1, x.shape[-1])
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    grads = grad.reshape(rows.shape)
    grads = grads if grads.stride(-1) == 1 else grads.contiguous()
    count, width = rows.shape
    programs, per_program = rms_norm_backward_grid(count, x.device)
    grad_x = torch.empty(rows.shape, dtype=x.dtype, device=x.device) if need_x else None
    partials = torch.empty(programs, width, dtype=torch.float32, device=x.device) if need_w else None
    if programs and (need_x or need_w):
        _kernels().exact_rms_norm_backward_kernel[(programs,)](
            rows, weight.contiguous(), grads, rows if grad_x is None else grad_x,
            rows if partials is None else partials, rows.stride(0), grads.stride(0),
            width if grad_x is None else grad_x.stride(0), count, width, per_program, eps,
            BLOCK=_next_pow2(width), WANT_DX=need_x, WANT_DW=need_w, num_warps=4 if width <= 4096 else 8,
        )  # fmt: skip
    grad_w = partials.sum(0).to(weight.dtype) if need_w else None
    return (grad_x.view(x.shape) if need_x else None), grad_w


def exact_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * (x.float() * rsqrt(mean(x.float() ** 2) + eps)).to(x.dtype)` over the last dimension of x, one
    program per row (batch-invariant), in torch's promotion of the two dtypes; differentiable."""
    return _ExactRmsNorm.apply(x, weight, eps, None)[0]


def exact_rms_norm_pair(
    x: torch.Tensor, weight: torch.Tensor, eps: float, low_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`exact_rms_norm`'s result, the same rounded to `low_dtype`: the bits of `.to(low_dtype)` on the first, from
    one kernel), both differentiable (the second's gradient as that `.to`'s: cast back and added). The first may
    differ in rare last bits from `exact_rms_norm`'s (another compilation of the kernel; see `exact_rms_norm_kernel`):
    use one function or the other for a given norm everywhere."""
    return _ExactRmsNorm.apply(x, weight, eps, low_dtype)
