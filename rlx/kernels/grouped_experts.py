"""Routed expert MLPs of a mixture-of-experts layer as one batched computation (no Python loop over experts).

Each token goes to its top-k experts; the T * k (token, expert) assignments are sorted by expert so that every
expert's tokens are consecutive rows, and the experts' gate/up and down projections run as one grouped GEMM each
over those rows:

- `grouped`: `torch._grouped_mm` with the row offsets of each expert (CUDA with bf16 weights on torch >= 2.8;
  torch 2.13 also has a CPU kernel for float32);
- `padded`: each expert's rows scattered into a [E, T, H] buffer (an expert takes at most T of the T * k rows,
  since a token's k experts differ) and one `torch.bmm`; it computes E / k times the FLOPs it needs, so it is the
  portable reference, not the fast path.

Both keep every shape a function of T alone (the expert counts are tensors, never read on the host), so the step
traces under torch.compile without graph breaks and replays inside a CUDA graph. Each token's k expert outputs
are weighted and summed in float32, in a fixed order (no atomics): the result does not depend on the batch.
Weights use transformers' fused layout: gate_up [E, 2I, H] (gate rows first), down [E, H, I].

`grouped_linear` (with `grouped_mm_trains` saying where it runs) is the training side's building block: one grouped
GEMM with autograd over rows already sorted by expert, used by the expert-parallel forward (rlx/parallel/experts.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

ExpertsImpl = Literal["auto", "grouped", "padded"]
IMPLEMENTATIONS = ("auto", "grouped", "padded")


def grouped_mm_supported(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether 'auto' takes `torch._grouped_mm`: CUDA bf16 weights whose rows are 16-byte aligned (its kernel's
    stride rule)."""
    if not hasattr(torch, "_grouped_mm") or x.device.type != "cuda" or gate_up.dtype != torch.bfloat16:
        return False
    return all(t.shape[-1] * t.element_size() % 16 == 0 for t in (gate_up, down))


def grouped_mm_trains(device: torch.device, dtype: torch.dtype, *weights: torch.Tensor) -> bool:
    """Whether `grouped_linear` runs (forward and backward) on `device` in `dtype` for `weights` [E, out, in]:
    `torch.nn.functional.grouped_mm` (torch >= 2.10: a CPU kernel; on CUDA CUTLASS for bf16 on SM90/SM100, torch's
    per-group loop for float32) in float32 or bf16, or on older torch `torch._grouped_mm` for bf16 on Hopper; every
    operand's rows a multiple of 16 bytes (the kernels' stride rule). Under torch.compile bf16 only (its fake-tensor
    rule for grouped_mm refuses float32, torch 2.13)."""
    if torch.compiler.is_compiling() and dtype != torch.bfloat16:
        return False
    if hasattr(torch.nn.functional, "grouped_mm"):
        runs = device.type in ("cpu", "cuda") and dtype in (torch.float32, torch.bfloat16)
    else:  # torch 2.8's kernel: Hopper only
        runs = hasattr(torch, "_grouped_mm") and device.type == "cuda" and dtype == torch.bfloat16
        runs = runs and torch.cuda.get_device_capability(device)[0] == 9
    return runs and all(size * dtype.itemsize % 16 == 0 for w in weights for size in w.shape[-2:])


class _ContiguousGrad(torch.autograd.Function):
    """Identity forward; the gradient made contiguous (grouped_mm's backward refuses broadcast gradients, such as
    the one `out.sum()` gives)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def grouped_linear(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """rows [N, in] sorted by expert, weight [E, out, in], offsets [E] int32 (the end row of each expert's group)
    -> [N, out]: row r times its expert's weight transposed, as one grouped GEMM with autograd (torch's derivative of
    grouped_mm: an expert with no rows gets a zero gradient). rows and weight share a dtype (see
    `grouped_mm_trains`)."""
    grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    weight = weight if weight.data_ptr() % 16 == 0 else weight.clone()  # a view into a flat buffer (FSDP's)
    return _ContiguousGrad.apply(grouped_mm(rows, weight.transpose(-2, -1), offs=offsets))


def sort_by_expert(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """experts [T, k] -> (order [T*k]: the assignments (flat index t*k + j) sorted by expert, stably; their experts
    [T*k]; offsets [E] int32: the end row of each expert's group)."""
    flat = experts.reshape(-1).long()
    sorted_experts, order = torch.sort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # a bincount of static size (compiles without a break)
    return order, sorted_experts, counts.cumsum(0).to(torch.int32)


def _grouped_linear(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """rows [N, in] (sorted by expert), weight [E, out, in] -> [N, out] through `torch._grouped_mm`."""
    return torch._grouped_mm(rows.to(weight.dtype), weight.transpose(-2, -1), offs=offsets)


def _padded_linear(rows: torch.Tensor, weight: torch.Tensor, where: tuple[torch.Tensor, torch.Tensor], capacity: int):
    """rows [N, in] -> [N, out]: rows placed at (expert, slot) of a zero [E, capacity, in] buffer, one bmm with
    weight [E, out, in], and read back from the same places."""
    buffer = rows.new_zeros(weight.shape[0], capacity, rows.shape[-1])
    buffer[where] = rows.to(buffer.dtype)
    return torch.bmm(buffer.to(weight.dtype), weight.transpose(-2, -1))[where]


def routed_experts_mlp(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    impl: ExpertsImpl = "auto",
) -> torch.Tensor:
    """sum_j weights[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t)) with e = experts[t, j].

    x [T, H]; experts [T, k] int; weights [T, k]; gate_up [E, 2I, H]; down [E, H, I] -> [T, H] in x's dtype.
    impl: 'grouped' (`torch._grouped_mm`), 'padded' (a padded bmm) or 'auto' (grouped where
    `grouped_mm_supported`, else padded)."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"experts impl {impl!r}: expected one of {', '.join(IMPLEMENTATIONS)}")
    if impl == "auto":
        impl = "grouped" if grouped_mm_supported(x, gate_up, down) else "padded"
    tokens, top_k = experts.shape
    order, sorted_experts, offsets = sort_by_expert(experts, gate_up.shape[0])
    rows = x[order // top_k]  # [T*k, H]: each assignment's token, grouped by expert
    if impl == "grouped":
        linear = lambda r, w: _grouped_linear(r, w, offsets)  # noqa: E731
    else:
        starts = offsets.long() - torch.zeros_like(offsets, dtype=torch.long).scatter_add_(
            0, sorted_experts, torch.ones_like(sorted_experts)
        )  # [E]: the first row of each expert's group
        slots = torch.arange(sorted_experts.shape[0], device=x.device) - starts[sorted_experts]
        linear = lambda r, w: _padded_linear(r, w, (sorted_experts, slots), max(tokens, 1))  # noqa: E731
    gate, up = linear(rows, gate_up).chunk(2, dim=-1)
    out = linear(act(gate) * up, down)  # [T*k, H], sorted by expert
    flat = torch.empty_like(out).index_copy_(0, order, out)  # back to (token, slot) order
    summed = (flat.view(tokens, top_k, -1).float() * weights.float().unsqueeze(-1)).sum(1)
    return summed.to(x.dtype)
