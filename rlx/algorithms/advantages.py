"""Advantage estimators: GAE, GRPO (and Dr.GRPO), RLOO, REINFORCE++ (+baseline), ReMax, OPO, GPG, GRPO pass@k.

Every estimator takes `AdvantageInputs` and returns (advantages, returns), both [B, R] and zero on
masked tokens. Conventions follow verl's `core_algos` (named in each docstring), so numbers compare
one-to-one with runs built on verl. Outcome estimators use the sequence score
`token_rewards.sum(-1)` (the rule/RM reward on the last token, minus any in-reward KL penalty).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlx.algorithms.core import group_rows, masked_whiten


@dataclass
class AdvantageInputs:
    """What the estimators read.  B samples, R response tokens."""

    token_rewards: torch.Tensor
    """[B, R] per-token rewards (outcome reward on the last token, minus any KL penalty)."""
    response_mask: torch.Tensor
    """[B, R] bool, True on response tokens."""
    group_ids: list[str]
    """B prompt ids: samples of one prompt form a group."""
    values: torch.Tensor | None = None
    """[B, R] critic values V(s_t) (GAE only)."""
    reward_baselines: torch.Tensor | None = None
    """[B] baseline reward per sample: the greedy rollout's reward (ReMax only)."""
    gamma: float = 1.0
    """Discount factor (GAE, REINFORCE++)."""
    lam: float = 1.0
    """GAE lambda."""
    norm_adv_by_std: bool = True
    """GRPO / pass@k: divide by the group std (False = Dr.GRPO)."""
    whiten: bool = True
    """GAE: whiten advantages over the batch (verl always does)."""
    epsilon: float = 1e-6
    """Added to group std before dividing."""


def _scores(x: AdvantageInputs) -> torch.Tensor:
    return x.token_rewards.float().sum(dim=-1)


def _broadcast(per_seq: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    adv = per_seq.unsqueeze(-1) * mask
    return adv, adv.clone()


def _group_stats(scores: torch.Tensor, group_ids: list[str]) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """Per-row group mean and unbiased std; a group of one has mean 0 and std 1 (verl's convention)."""
    mean, std = torch.zeros_like(scores), torch.ones_like(scores)
    groups = group_rows(group_ids)
    for rows in groups:
        if len(rows) > 1:
            mean[rows] = scores[rows].mean()
            std[rows] = scores[rows].std()
    return mean, std, groups


def grpo(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (verl `compute_grpo_outcome_advantage`): (s - mean_g) / (std_g + eps), or s - mean_g for Dr.GRPO.

    std is torch.std (unbiased); a group of one keeps its raw score (mean 0, std 1); eps is added
    to the std, not inside the square root.
    """
    scores = _scores(x)
    mean, std, _ = _group_stats(scores, x.group_ids)
    centred = scores - mean
    return _broadcast(centred / (std + x.epsilon) if x.norm_adv_by_std else centred, x.response_mask)


def grpo_passk(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO pass@k (verl `compute_grpo_passk_outcome_advantage`): only each group's best sample gets
    r_max - r_second (divided by std_g + eps when norm_adv_by_std); groups need at least 2 samples;
    ties go to the first best sample."""
    scores = _scores(x)
    adv = torch.zeros_like(scores)
    for rows in group_rows(x.group_ids):
        if len(rows) < 2:
            raise ValueError(f"grpo_passk needs at least 2 samples per prompt, got {len(rows)}")
        values = scores[rows]
        top, top_idx = torch.topk(values, 2)
        gain = top[0] - top[1]
        if x.norm_adv_by_std:
            gain = gain / (values.std() + x.epsilon)
        adv[rows[int(top_idx[0])]] = gain
    return _broadcast(adv, x.response_mask)


def rloo(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (verl `compute_rloo_outcome_advantage`): s - mean of the other samples of the group,
    i.e. (s - mean_g) * n / (n - 1); a group of one keeps its raw score."""
    scores = _scores(x)
    adv = scores.clone()
    for rows in group_rows(x.group_ids):
        n = len(rows)
        if n > 1:
            adv[rows] = (scores[rows] - scores[rows].mean()) * n / (n - 1)
    return _broadcast(adv, x.response_mask)


def opo(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (verl `compute_opo_outcome_advantage`): s - length-weighted mean of the group's scores;
    a group of one has baseline 0."""
    scores = _scores(x)
    lengths = x.response_mask.sum(dim=-1).float()
    adv = scores.clone()
    for rows in group_rows(x.group_ids):
        if len(rows) > 1:
            adv[rows] = scores[rows] - (lengths[rows] * scores[rows]).sum() / lengths[rows].sum()
    return _broadcast(adv, x.response_mask)


def gpg(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (verl `compute_gpg_outcome_advantage`, f_norm = 1): alpha * (s - mean_g), where
    alpha = B / (number of samples with a non-zero score, at least 1)."""
    scores = _scores(x)
    alpha = len(scores) / max(int(torch.count_nonzero(scores)), 1)
    mean, _, _ = _group_stats(scores, x.group_ids)
    return _broadcast(alpha * (scores - mean), x.response_mask)


def reinforce_plus_plus(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (verl `compute_reinforce_plus_plus_outcome_advantage`): discounted returns of the
    token rewards, whitened over all response tokens of the batch. Masked tokens are skipped (the return
    carries across a multi-turn sample's environment tokens, discounted per model token), where verl resets
    the return at them; on single-turn rows, whose only masked tokens are the padding after the response,
    the two agree."""
    mask = x.response_mask.float()
    returns = torch.zeros_like(x.token_rewards, dtype=torch.float32)
    running = torch.zeros(x.token_rewards.shape[0])
    for t in reversed(range(x.token_rewards.shape[1])):
        step = x.token_rewards[:, t].float() + x.gamma * running
        running = step * mask[:, t] + running * (1 - mask[:, t])
        returns[:, t] = running
    return masked_whiten(returns, x.response_mask) * mask, returns * mask


def reinforce_plus_plus_baseline(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (verl): s - mean_g (group of one: baseline 0) on every token, then
    whitened over all response tokens of the batch."""
    scores = _scores(x)
    mean, _, _ = _group_stats(scores, x.group_ids)
    adv = (scores - mean).unsqueeze(-1) * x.response_mask
    adv = masked_whiten(adv, x.response_mask) * x.response_mask
    return adv, adv.clone()


def remax(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (verl `compute_remax_outcome_advantage`): returns-to-go of the token rewards minus the
    greedy rollout's reward (`reward_baselines`) on every token; unlike verl, masked tokens inside a
    response are zeroed in the returns too (verl's loss masks them anyway)."""
    if x.reward_baselines is None:
        raise ValueError("remax needs greedy baseline rewards (rlx rollout --remax-baseline)")
    mask = x.response_mask.float()
    returns = (x.token_rewards.float() * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1]) * mask
    return returns - x.reward_baselines.float().unsqueeze(-1) * mask, returns


def gae(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (verl `compute_gae_advantage_return`): reverse scan of delta_t = r_t + gamma V_{t+1} - V_t,
    A_t = delta_t + gamma lam A_{t+1}; masked tokens are skipped (they carry V and A through);
    returns = A + V; advantages whitened over the batch when `whiten`."""
    if x.values is None:
        raise ValueError("gae needs critic values (rlx score --critic)")
    mask = x.response_mask.float()
    rewards, values = x.token_rewards.float(), x.values.float()
    b, r = rewards.shape
    next_value, last_gae = torch.zeros(b), torch.zeros(b)
    reversed_adv = []
    for t in reversed(range(r)):
        delta = rewards[:, t] + x.gamma * next_value - values[:, t]
        gae_t = delta + x.gamma * x.lam * last_gae
        next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
        last_gae = gae_t * mask[:, t] + (1 - mask[:, t]) * last_gae
        reversed_adv.append(last_gae)
    adv = torch.stack(reversed_adv[::-1], dim=1)
    returns = (adv + values) * mask
    if x.whiten:
        adv = masked_whiten(adv, x.response_mask)
    return adv * mask, returns


ESTIMATORS: dict[str, Callable[[AdvantageInputs], tuple[torch.Tensor, torch.Tensor]]] = {
    "gae": gae,
    "grpo": grpo,
    "rloo": rloo,
    "reinforce_plus_plus": reinforce_plus_plus,
    "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline,
    "remax": remax,
    "opo": opo,
    "gpg": gpg,
    "grpo_passk": grpo_passk,
}


def compute_advantages(name: str, inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Run estimator `name`; unknown names list the valid ones."""
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r} (valid: {', '.join(ESTIMATORS)})")
    return ESTIMATORS[name](inputs)
