"""Subprocess of tests/unit/test_exact_triton.py (TRITON_INTERPRET=1 must be set before triton is imported): the
gradients of `exact_rms_norm` through its Triton backward (`exact_rms_norm_backward_kernel`) in Triton's interpreter,
against autograd through the PyTorch formula (`_rms_norm_reference`) with the same upstream gradient. Each case
raises on failure and prints its name when it passes; 'ok' at the end.

The kernel has no dots, so bfloat16 runs here too; but the interpreter rounds float32 to bfloat16 toward zero (CUDA
to nearest even), so the bfloat16 tolerances allow an ulp of the largest gradient.
"""

import torch

from rlx.kernels.exact_triton import _rms_norm_reference, exact_rms_norm, rms_norm_backward, rms_norm_backward_grid

EPS = 1e-6
g = torch.Generator().manual_seed(0)


def random(shape: tuple[int, ...], dtype: torch.dtype, mean: float = 0.0) -> torch.Tensor:
    return (mean + torch.randn(shape, generator=g)).to(dtype)


def gradients(norm, x, weight, upstream, wanted: tuple[bool, bool]) -> list[torch.Tensor | None]:
    """[grad of x, grad of weight] of `norm(x, weight, EPS)` for `upstream`, None where `wanted` says no (that input
    then needs no gradient, as autograd's needs_input_grad tells the backward)."""
    x, weight = (t.detach().requires_grad_(want) for t, want in zip((x, weight), wanted))
    inputs = [t for t, want in zip((x, weight), wanted) if want]
    found = iter(torch.autograd.grad(norm(x, weight, EPS), inputs, upstream))
    return [next(found) if want else None for want in wanted]


def assert_close_to(got: torch.Tensor, want: torch.Tensor, precise: bool) -> None:
    """Close: to a few float32 roundings if `precise` (float32 in and out), else to about a bfloat16 ulp of the
    largest value (a float32 weight's gradient from bfloat16 x holds the rounding of h to bfloat16)."""
    scale = float(want.abs().max()) if want.numel() else 1.0
    if precise:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)
    else:
        torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-2 * scale)


def check(name: str, x, weight, upstream=None, wanted: tuple[bool, bool] = (True, True)) -> None:
    """The kernel's gradients close to the reference's, in x's and weight's dtypes and shapes, the same bits when run
    again; prints `name`."""
    if upstream is None:
        upstream = random(x.shape, torch.promote_types(x.dtype, weight.dtype))
    got = gradients(exact_rms_norm, x, weight, upstream, wanted)
    want = gradients(_rms_norm_reference, x, weight, upstream, wanted)
    for found, expected, source in zip(got, want, (x, weight)):
        if expected is None:
            continue
        assert found.dtype == source.dtype and found.shape == source.shape, (name, found.dtype, found.shape)
        assert_close_to(found, expected, precise=found.dtype == x.dtype == torch.float32)
    again = gradients(exact_rms_norm, x, weight, upstream, wanted)
    assert all(a is None or torch.equal(a, b) for a, b in zip(got, again)), name
    print(name)


def check_one_gradient_wanted() -> None:
    """One of the two gradients wanted: the other is neither computed nor returned, and the wanted one is the same
    bits as when both are computed."""
    x, weight = random((5, 96), torch.bfloat16), random((96,), torch.float32, mean=1.0)
    upstream = random((5, 96), torch.float32)
    check("x's gradient alone", x, weight, upstream, wanted=(True, False))
    check("weight's gradient alone", x, weight, upstream, wanted=(False, True))
    both = rms_norm_backward(x, weight, upstream, EPS)
    grad_x, grad_w = rms_norm_backward(x, weight, upstream, EPS, need_w=False)
    assert grad_w is None and torch.equal(grad_x, both[0])
    grad_x, grad_w = rms_norm_backward(x, weight, upstream, EPS, need_x=False)
    assert grad_x is None and torch.equal(grad_w, both[1])


def check_rows_left_over() -> None:
    """A row count that is not a multiple of the rows per program: the last program's missing rows are masked."""
    programs, per_program = rms_norm_backward_grid(10, torch.device("cpu"))
    assert programs > 1 and 10 % per_program != 0 and programs * per_program > 10, (programs, per_program)
    check("rows not a multiple of the rows per program", random((10, 96), torch.float32), random((96,), torch.float32))


for x_dtype, w_dtype, width in ((torch.float32, torch.float32, 64), (torch.bfloat16, torch.float32, 160),
                                (torch.bfloat16, torch.bfloat16, 96), (torch.float32, torch.bfloat16, 96)):  # fmt: skip
    name = f"x {str(x_dtype)[6:]}, weight {str(w_dtype)[6:]}"
    check(name, random((6, width), x_dtype), random((width,), w_dtype, mean=1.0))
check(
    "3-D x, a non-contiguous upstream gradient",
    random((2, 3, 256), torch.bfloat16),
    random((256,), torch.float32, mean=1.0),
    random((256, 3, 2), torch.float32).permute(2, 1, 0),
)
check(
    "an upstream gradient of stride 0 (a sum's)",
    random((4, 64), torch.float32),
    random((64,), torch.float32),
    torch.ones(()).expand(4, 64),
)
check_one_gradient_wanted()
check_rows_left_over()
check("no rows", random((0, 64), torch.bfloat16), random((64,), torch.float32))
print("ok")
