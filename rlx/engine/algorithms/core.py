"""Masked reductions shared by estimators and losses."""

from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of `values` where `mask` is true."""
    return (values * mask).sum()


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` where `mask` is true (0 for an empty mask)."""
    return (values * mask).sum() / mask.sum().clamp(min=1)
