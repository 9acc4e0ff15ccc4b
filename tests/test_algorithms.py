"""GRPO advantages, the PPO clipped loss and KL estimators against hand-computed values."""

from __future__ import annotations

import math

import torch

from rlx.engine.algorithms.advantages import compute_grpo_advantages
from rlx.engine.algorithms.losses import kl_estimate, ppo_clip_loss


def test_grpo_by_hand():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.bool)
    adv, returns = compute_grpo_advantages(scores, ["a", "a", "a", "b", "c"], mask)
    # group a: mean 1/3, unbiased std sqrt(1/3); group b (one sample): mean 0, std 1; group c likewise
    std_a = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)
    expected = [(2 / 3) / (std_a + 1e-6), (-1 / 3) / (std_a + 1e-6), (-1 / 3) / (std_a + 1e-6), 1.0, 5.0]
    for row, value in enumerate(expected):
        assert torch.allclose(adv[row][mask[row]], torch.tensor(value), atol=1e-5)
        assert (adv[row][~mask[row]] == 0).all()
    assert torch.equal(adv, returns)


def test_grpo_identical_rewards_give_zero_and_dr_grpo_centres_only():
    mask = torch.ones(4, 2, dtype=torch.bool)
    adv, _ = compute_grpo_advantages(torch.tensor([0.7, 0.7, 0.2, 0.6]), ["g", "g", "h", "h"], mask)
    assert (adv[:2] == 0).all()
    adv, _ = compute_grpo_advantages(torch.tensor([0.7, 0.7, 0.2, 0.6]), ["g", "g", "h", "h"], mask, norm_by_std=False)
    assert torch.allclose(adv[2:, 0], torch.tensor([-0.2, 0.2]))


def test_ppo_clip_by_hand():
    old = torch.zeros(1, 4)
    new = torch.log(torch.tensor([[1.5, 0.5, 1.1, 5.0]]))
    adv = torch.tensor([[1.0, -1.0, 2.0, -1.0]])
    mask = torch.tensor([[1, 1, 1, 1]], dtype=torch.bool)
    loss, sums = ppo_clip_loss(new, old, adv, mask, num_tokens=4, clip_low=0.2, clip_high=0.2, dual_clip=3.0)
    # token 0: A>0, r=1.5 -> clipped to 1.2: -1.2; token 1: A<0, r=0.5 -> max(0.5, 0.8) = 0.8
    # token 2: r=1.1 inside: -2.2; token 3: A<0, r=5 -> max(5, 1.2)=5, dual-clip caps at 3
    expected = (-1.2 + 0.8 - 2.2 + 3.0) / 4
    assert torch.allclose(loss, torch.tensor(expected), atol=1e-6)
    assert sums["pg_clipfrac"] == 2 and sums["pg_clipfrac_lower"] == 1 and sums["tokens"] == 4


def test_loss_is_normalised_by_the_given_token_count_and_ignores_padding():
    torch.manual_seed(0)
    new, old, adv = torch.randn(3, 5), torch.randn(3, 5), torch.randn(3, 5)
    mask = torch.rand(3, 5) > 0.3
    full, _ = ppo_clip_loss(new, old, adv, mask, num_tokens=mask.sum())
    parts = sum(
        ppo_clip_loss(new[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1], num_tokens=mask.sum())[0]
        for i in range(3)
    )
    assert torch.allclose(full, parts, atol=1e-6)
    garbage = new.masked_fill(~mask, 1e4)
    assert torch.allclose(ppo_clip_loss(garbage, old, adv, mask, num_tokens=mask.sum())[0], full)


def test_dual_clip_bounds_the_loss_for_negative_advantages():
    new = torch.linspace(-3, 5, 50).unsqueeze(0)
    adv = -torch.rand(1, 50) - 0.1
    loss, _ = ppo_clip_loss(
        new, torch.zeros_like(new), adv, torch.ones_like(new, dtype=torch.bool), num_tokens=1, dual_clip=3.0
    )
    per_token = [
        ppo_clip_loss(
            new[:, i : i + 1], torch.zeros(1, 1), adv[:, i : i + 1], torch.ones(1, 1, dtype=torch.bool), num_tokens=1
        )[0]
        for i in range(50)
    ]
    assert all(p <= -a * 3.0 + 1e-6 for p, a in zip(per_token, adv[0]))


def test_kl_estimators():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    d = logp - ref
    assert torch.allclose(kl_estimate(logp, ref, "k1"), d)
    assert torch.allclose(kl_estimate(logp, ref, "abs"), d.abs())
    assert torch.allclose(kl_estimate(logp, ref, "k2"), 0.5 * d**2)
    assert torch.allclose(kl_estimate(logp, ref, "k3"), torch.exp(-d) + d - 1)
    assert (kl_estimate(torch.randn(100), torch.randn(100), "k3") >= 0).all()
    assert kl_estimate(torch.tensor([0.0]), torch.tensor([-50.0]), "k3") == 10  # clamped like verl
