"""Advantage estimators over outcome rewards.

Conventions follow verl's `core_algos` so numbers compare one-to-one with runs built on it.
"""

from __future__ import annotations

from collections import defaultdict

import torch

ESTIMATORS = ("grpo",)


def compute_grpo_advantages(
    scores: torch.Tensor,
    group_ids: list[str],
    response_mask: torch.Tensor,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantages: (score - group mean) / (group std + epsilon), on every response token.

    scores: [B] sequence scores; group_ids: B prompt ids; response_mask: [B, R].
    Returns (advantages, returns), both [B, R], zero on masked tokens.

    Convention (verl `compute_grpo_outcome_advantage`): the std is the unbiased sample std
    (torch.std); a group of one sample has mean 0 and std 1, so its advantage is its raw score;
    epsilon is added to the std, not under a square root; `norm_by_std=False` gives Dr.GRPO
    (mean-centred only).
    """
    groups: dict[str, list[int]] = defaultdict(list)
    for row, gid in enumerate(group_ids):
        groups[gid].append(row)
    scores = scores.float()
    mean = torch.zeros_like(scores)
    std = torch.ones_like(scores)
    for rows in groups.values():
        if len(rows) > 1:
            values = scores[rows]
            mean[rows] = values.mean()
            std[rows] = values.std()
    centred = scores - mean
    adv = centred / (std + epsilon) if norm_by_std else centred
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv.clone()
