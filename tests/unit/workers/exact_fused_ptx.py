"""Subprocess of tests/unit/test_exact_fused.py: exact mode's fused elementwise kernels (exact_fused_kernels.py)
compiled ahead of time for an H100 (sm_90, no GPU needed) as Triton specialises them for different calls: without
hints, with every pointer, stride and width a multiple of 16 (the trainer's contiguous tensors; the engine's strided
views of one stacked matmul), and, for rotary, with one token a sequence (T = 1: a decode step). The variants load
and store differently, and may pack two bfloat16 results in one instruction; the rounding instructions they run
(multiplies, fused multiply-adds, adds, divisions, exponentials, narrowing conversions; a packed pair counted as
two) must be the same in kind and number, else an element could round differently in the engine and in the
trainer. Exact ones (negations, widening conversions) are not compared: their count follows the threads' layout.
Prints one line per kernel and dtype: name, dtype, instruction count, 'same' or 'differ'."""

import re
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from rlx.kernels.exact_fused_kernels import rotary_kernel, silu_mul_backward_kernel, silu_mul_kernel

_ROUNDING_OP = re.compile(r"\s*(?:@!?%p\d+\s+)?((?:fma|mul|add|sub|ex2|div|rcp|cvt\.rn)\.[\w.]*)")


def rounding_ops(ptx: str) -> Counter:
    """The rounding floating-point instructions of `ptx` by kind, a packed pair (bf16x2) counted as two."""
    ops = [m.group(1) for m in map(_ROUNDING_OP.match, ptx.splitlines()) if m]
    ops = [op for op in ops if ".f" in op or ".bf16" in op]
    return Counter(op.replace("x2", "") for op in ops for _ in range(2 if "x2" in op else 1))


def compile_ops(kernel, pointers: dict, constexprs: dict, aligned: bool, decode: bool = False) -> Counter:
    """The rounding instructions of `kernel` compiled with `pointers` (name: type) and `constexprs`; `aligned`: every
    pointer and integer hinted a multiple of 16; `decode`: T the constant 1."""
    names = kernel.arg_names
    constants = {**constexprs, **({"T": 1} if decode else {})}
    signature = {n: pointers.get(n, "constexpr" if n in constants else "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if aligned and n not in constants}
    source = ASTSource(kernel, signature, {(names.index(k),): v for k, v in constants.items()}, attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    return rounding_ops(compiled.asm["ptx"])


def report(name: str, dtype: str, variants: list[Counter]) -> None:
    print(name, dtype, variants[0].total(), "same" if all(v == variants[0] for v in variants[1:]) else "differ")


for dtype in ("bf16", "fp32"):
    silu = dict(gate_ptr=f"*{dtype}", up_ptr=f"*{dtype}", out_ptr=f"*{dtype}")
    report("silu_mul", dtype, [compile_ops(silu_mul_kernel, silu, {"BLOCK": 1024}, a) for a in (False, True)])
    grads = dict(grad_ptr=f"*{dtype}", gate_ptr=f"*{dtype}", up_ptr=f"*{dtype}", d_gate_ptr=f"*{dtype}",
                 d_up_ptr=f"*{dtype}")  # fmt: skip
    report("silu_mul_backward", dtype, [compile_ops(silu_mul_backward_kernel, grads, {"BLOCK": 1024}, a)
                                        for a in (False, True)])  # fmt: skip
for x, angles, out in (("bf16", "fp32", "fp32"), ("bf16", "bf16", "bf16"), ("fp32", "fp32", "fp32")):
    pointers = dict(q_ptr=f"*{x}", k_ptr=f"*{x}", cos_ptr=f"*{angles}", sin_ptr=f"*{angles}", q_out_ptr=f"*{out}",
                    k_out_ptr=f"*{out}")  # fmt: skip
    for backward in (False, True):
        constexprs = dict(HALF=64, HEADS_PAD=32, KV_PAD=4, HALF_PAD=64, BACKWARD=backward)
        variants = [compile_ops(rotary_kernel, pointers, constexprs, a, d) for a, d in ((False, False), (True, False),
                                                                                       (True, True))]  # fmt: skip
        report("rotary_backward" if backward else "rotary", f"{x}/{angles}", variants)
