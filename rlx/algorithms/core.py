"""Masked reductions and grouping shared by estimators and losses.

Conventions follow verl's `torch_functional`: means divide by the mask count, the variance used
for whitening is unbiased (Bessel-corrected over masked elements), and whitening adds 1e-8 under
the square root.
"""

from __future__ import annotations

from collections import defaultdict

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` is true (over `dim`, or everything)."""
    product = values * mask
    return product.sum() if dim is None else product.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` where `mask` is true (0 for an empty mask)."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unbiased variance of the masked elements (needs at least two of them)."""
    count = mask.sum()
    if count < 2:
        raise ValueError(f"whitening needs at least 2 unmasked elements, got {int(count)}")
    centred = values - masked_mean(values, mask)
    return masked_mean(centred.square(), mask) * count / (count - 1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(values - mean) / sqrt(var + 1e-8) over the masked elements; the mean is added back if not shift_mean."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def group_rows(group_ids: list[str]) -> list[list[int]]:
    """Row indices of each group, in order of first appearance."""
    groups: dict[str, list[int]] = defaultdict(list)
    for row, gid in enumerate(group_ids):
        groups[gid].append(row)
    return list(groups.values())
