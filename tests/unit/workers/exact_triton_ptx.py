"""Subprocess of tests/unit/test_exact_triton.py: exact mode's attention kernel compiled ahead of time for an H100
(sm_90, no GPU needed) with paged and with contiguous keys, bfloat16 and float32. The two variants differ only in
how they address the keys; their floating-point instructions (dots, exp2, max, adds, fused multiply-adds, warp
shuffles of the reductions) must be the same sequence, else a token's output could differ between the engine's
paged cache and the trainer's forward; the paged variant that writes a decode step's keys first (WRITE_KV) too.
Prints one line per dtype: dtype, instruction count, 'same' or 'differ'."""

import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from rlx.kernels.exact import KEY_BLOCK
from rlx.kernels.exact_triton import _ATTENTION_STAGES, _ATTENTION_WARPS
from rlx.kernels.exact_triton_kernels import exact_attention_kernel

_FLOAT_OP = re.compile(r"\s*(?:@!?%p\d+\s+)?((?:mma|wgmma|fma|mul|add|sub|ex2|max|min|div|rcp|lg2|cvt|shfl|neg)[\w.]*)")


def float_ops(ptx: str) -> list[str]:
    ops = (m.group(1) for m in map(_FLOAT_OP.match, ptx.splitlines()) if m)
    return [op for op in ops if "mma" in op or "shfl" in op or ".f" in op or ".bf16" in op]


def compile_attention(dtype: str, paged: bool, write_kv: bool = False) -> str:
    names = exact_attention_kernel.arg_names
    pointers = {n: f"*{dtype}" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "kn_ptr", "vn_ptr")}
    pointers.update(len_ptr="*i32", row_ptr="*i64", start_ptr="*i64", bt_ptr="*i32", slot_ptr="*i64")
    pointers.update(scale_log2="fp32")
    constexprs = dict(PAGED=paged, BLOCK_SIZE=16, GROUP=7, HEAD_DIM=64, GROUP_PAD=16, DIM_PAD=64, KEY_BLOCK=KEY_BLOCK,
                      IEEE=dtype == "fp32", INTERPRET_KEYS=0, WRITE_KV=write_kv)  # fmt: skip
    signature = {n: pointers.get(n, "constexpr" if n in constexprs else "i32") for n in names}
    source = ASTSource(exact_attention_kernel, signature, {(names.index(k),): v for k, v in constexprs.items()})
    options = {"num_warps": _ATTENTION_WARPS, "num_stages": _ATTENTION_STAGES}
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    return kernel.asm["ptx"]


for dtype in ("bf16", "fp32"):
    paged, contiguous = (float_ops(compile_attention(dtype, p)) for p in (True, False))
    writing = float_ops(compile_attention(dtype, True, write_kv=True))  # a decode step's: its new keys written first
    print(dtype, len(paged), "same" if paged == contiguous == writing else "differ")
