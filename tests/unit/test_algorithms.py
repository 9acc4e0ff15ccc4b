"""Advantage estimators, policy losses, KL estimators and rollout correction against hand-computed values.

Expected numbers are computed independently here (plain Python, `math`, `statistics`) following the verl
`core_algos` convention each function names in its docstring: unbiased std, eps added to the std, a group of
one keeps its raw score, clamps as in verl.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from rlx.algorithms import losses
from rlx.algorithms.advantages import ESTIMATORS, AdvantageInputs, compute_advantages
from rlx.algorithms.config import CorrectionConfig, LossConfig
from rlx.algorithms.core import group_rows, masked_mean, masked_sum, masked_var, masked_whiten
from rlx.algorithms.kl import adaptive_kl_coef, kl_estimate
from rlx.algorithms.losses import AGG_MODES, LossNorm, aggregate, compute_policy_loss
from rlx.algorithms.rollout_correction import correct, mismatch_metrics

F64 = torch.float64
EPS = 1e-6
DETERMINISTIC_LOSSES = ("ppo", "gspo", "cispo", "sapo", "gpg", "geo_mean")
GROUP_ESTIMATORS = ("grpo", "rloo", "opo", "gpg", "grpo_passk")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def t(*rows) -> torch.Tensor:
    """float64 [len(rows), R] tensor."""
    return torch.tensor(rows, dtype=F64)


def m(*rows) -> torch.Tensor:
    """bool [len(rows), R] mask from 0/1 rows."""
    return torch.tensor(rows, dtype=torch.bool)


def close(actual, expected, atol=1e-6):
    actual, expected = torch.as_tensor(actual, dtype=F64), torch.as_tensor(expected, dtype=F64)
    assert torch.allclose(actual, expected, atol=atol, rtol=0), (actual, expected)


def outcome(scores, groups, lengths=None, width=3, **kw) -> AdvantageInputs:
    """Each score on the last response token of its row; rows are `lengths` long (default: full width)."""
    lengths = lengths or [width] * len(scores)
    rewards, mask = torch.zeros(len(scores), width, dtype=F64), torch.zeros(len(scores), width, dtype=torch.bool)
    for row, (score, n) in enumerate(zip(scores, lengths)):
        rewards[row, n - 1], mask[row, :n] = score, True
    return AdvantageInputs(token_rewards=rewards, response_mask=mask, group_ids=list(groups), **kw)


def seq_adv(name: str, x: AdvantageInputs) -> list[float]:
    """Per-row advantage of an outcome estimator, checking it is constant on the response and 0 on padding."""
    adv, returns = compute_advantages(name, x)
    per_row = adv[:, 0]  # every row of `outcome` starts with a response token
    assert torch.equal(adv, per_row.unsqueeze(-1) * x.response_mask) and torch.equal(adv, returns)
    return per_row.tolist()


def norm_of(mask: torch.Tensor, scale: float = 7.0) -> LossNorm:
    return LossNorm(num_tokens=float(mask.sum()), num_seqs=float((mask.sum(-1) > 0).sum()), scale_factor=scale)


def loss_of(name, logp, old, adv, mask, mode="token-mean", norm=None, **params) -> torch.Tensor:
    norm = norm or norm_of(mask)
    return compute_policy_loss(name, logp, old, adv, mask, norm, mode, LossConfig(**params))[0]


def pad(x: torch.Tensor, cols: int, fill: float | None = None) -> torch.Tensor:
    """Append `cols` columns of garbage (or of `fill`; bool tensors get False)."""
    if x.dtype == torch.bool:
        return torch.cat([x, torch.zeros(x.shape[0], cols, dtype=torch.bool)], dim=-1)
    extra = torch.randn(x.shape[0], cols, dtype=F64) * 5 if fill is None else torch.full((x.shape[0], cols), fill)
    return torch.cat([x, extra.to(x.dtype)], dim=-1)


def full_inputs() -> AdvantageInputs:
    """4 rows, 2 groups, trailing padding of different lengths, critic values and greedy baselines."""
    mask = m([1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0])
    rewards = torch.randn(4, 4, dtype=F64) * 0.1 * mask
    rewards[[0, 1, 2, 3], [3, 1, 2, 0]] += torch.tensor([1.0, 0.0, 0.5, 2.0], dtype=F64)
    values, baselines = torch.randn(4, 4, dtype=F64), torch.tensor([0.3, 0.1, 0.9, 1.0], dtype=F64)
    return AdvantageInputs(rewards, mask, ["a", "a", "b", "b"], values, baselines, gamma=0.9, lam=0.7)


# ---------------------------------------------------------------- core
def test_masked_reductions_and_group_rows():
    """Masked sum/mean ignore masked values; var is unbiased; whiten divides by sqrt(var + 1e-8)."""
    v, mk = t([1.0, 2.0, 4.0, 100.0]), m([1, 1, 1, 0])
    mean, var = 7 / 3, statistics.variance([1.0, 2.0, 4.0])
    close(masked_sum(v, mk), 7.0)
    close(masked_mean(v, mk), mean)
    close(masked_mean(v, torch.zeros_like(mk)), 0.0)
    close(masked_var(v, mk), var)
    close(masked_whiten(v, mk)[0, :3], [(x - mean) / math.sqrt(var + 1e-8) for x in (1, 2, 4)])
    close(masked_whiten(v, mk, shift_mean=False)[0, :3], [(x - mean) / math.sqrt(var + 1e-8) + mean for x in (1, 2, 4)])
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(v, m([1, 0, 0, 0]))
    assert group_rows(["b", "a", "b", "c"]) == [[0, 2], [1], [3]]


# ---------------------------------------------------------------- advantage estimators
def test_grpo_by_hand_dr_grpo_and_group_of_one():
    """(s - mean_g) / (std_g + eps) with unbiased std, s = sum of token rewards; group of one keeps s."""
    rewards = t([0.5, 0.5, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.2], [0.0, 3.0, 0.0])
    mask = m([1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 0])
    x = AdvantageInputs(rewards, mask, ["a", "a", "a", "b"])
    mean, std = statistics.mean([1.0, 0.0, 0.2]), statistics.stdev([1.0, 0.0, 0.2])
    expected = [(s - mean) / (std + EPS) for s in (1.0, 0.0, 0.2)] + [3.0]
    assert seq_adv("grpo", x) == pytest.approx(expected, abs=1e-5)
    x.norm_adv_by_std = False
    assert seq_adv("grpo", x) == pytest.approx([1.0 - mean, -mean, 0.2 - mean, 3.0], abs=1e-6)
    x.norm_adv_by_std = True
    adv, returns = compute_advantages("grpo", x)
    close(adv[:, 0], expected, 1e-5)
    assert torch.equal(adv, returns) and (adv[~mask] == 0).all()


def test_rloo_leave_one_out():
    """s_i - mean of the other samples of the group; a group of one keeps its raw score."""
    x = outcome([1.0, 0.0, 0.5, 2.0], "aaab", lengths=[3, 1, 2, 2])
    expected = [1.0 - (0.0 + 0.5) / 2, 0.0 - (1.0 + 0.5) / 2, 0.5 - (1.0 + 0.0) / 2, 2.0]
    assert seq_adv("rloo", x) == pytest.approx(expected, abs=1e-6)


def test_opo_length_weighted_baseline():
    """s_i - sum_j(len_j s_j) / sum_j len_j over the group; a group of one has baseline 0."""
    x = outcome([1.0, 0.0, 0.4, 0.7], "aaab", lengths=[1, 3, 2, 2])
    baseline = (1 * 1.0 + 3 * 0.0 + 2 * 0.4) / (1 + 3 + 2)
    assert seq_adv("opo", x) == pytest.approx([1.0 - baseline, -baseline, 0.4 - baseline, 0.7], abs=1e-6)


def test_gpg_alpha_is_batch_over_nonzero_count():
    """alpha * (s - mean_g) with alpha = B / #(s != 0); a group of one has mean 0."""
    x = outcome([1.0, 0.0, 0.0, 2.0, 3.0], "aabbc")
    alpha = 5 / 3
    expected = [alpha * 0.5, alpha * -0.5, alpha * -1.0, alpha * 1.0, alpha * 3.0]
    assert seq_adv("gpg", x) == pytest.approx(expected, abs=1e-6)
    assert seq_adv("gpg", outcome([0.0, 0.0], "aa")) == [0.0, 0.0]  # no non-zero score: alpha = B / 1


def test_grpo_passk_only_the_best_sample():
    """The best sample of each group gets r_max - r_second (/ (std_g + eps)); the rest get 0; groups of one fail."""
    scores = [0.2, 0.9, 0.5, 1.0, 3.0]
    x = outcome(scores, "aaabb", norm_adv_by_std=False)
    assert seq_adv("grpo_passk", x) == pytest.approx([0.0, 0.9 - 0.5, 0.0, 0.0, 3.0 - 1.0], abs=1e-6)
    x.norm_adv_by_std = True
    std_a, std_b = statistics.stdev(scores[:3]), statistics.stdev(scores[3:])
    expected = [0.0, 0.4 / (std_a + EPS), 0.0, 0.0, 2.0 / (std_b + EPS)]
    assert seq_adv("grpo_passk", x) == pytest.approx(expected, abs=1e-5)
    with pytest.raises(ValueError, match="at least 2"):
        compute_advantages("grpo_passk", outcome([1.0, 0.0, 1.0], "aab"))


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
@pytest.mark.parametrize("norm_adv_by_std", [True, False])
def test_identical_group_rewards_give_zero_advantage(name, norm_adv_by_std):
    """A group whose rewards are all equal gets zero advantage whatever the other groups hold."""
    x = outcome([0.7, 0.7, 0.7, 0.1, 0.9], "aaabb", lengths=[1, 2, 3, 2, 3], norm_adv_by_std=norm_adv_by_std)
    assert seq_adv(name, x)[:3] == pytest.approx([0.0] * 3, abs=1e-6)


def test_reinforce_plus_plus_discounted_returns_by_hand():
    """Returns G_t = r_t + gamma G_{t+1}, reset at the response end (padding rewards ignored), then whitened."""
    rewards = t([0.0, 0.5, 1.0, 9.0], [1.0, 0.0, 9.0, 9.0])
    mask = m([1, 1, 1, 0], [1, 1, 0, 0])
    adv, returns = compute_advantages("reinforce_plus_plus", AdvantageInputs(rewards, mask, ["a", "b"], gamma=0.5))
    g0 = [0.0 + 0.5 * (0.5 + 0.5 * 1.0), 0.5 + 0.5 * 1.0, 1.0]
    g1 = [1.0 + 0.5 * 0.0, 0.0]
    close(returns, [g0 + [0.0], g1 + [0.0, 0.0]])
    mean, std = statistics.mean(g0 + g1), math.sqrt(statistics.variance(g0 + g1) + 1e-8)
    close(adv, [[(g - mean) / std for g in g0] + [0.0], [(g - mean) / std for g in g1] + [0.0, 0.0]])


def test_reinforce_plus_plus_baseline_by_hand():
    """s - mean_g on every response token (group of one: baseline 0), whitened over all response tokens."""
    x = outcome([1.0, 0.0, 2.0], "aab", lengths=[2, 3, 1])
    tokens = [0.5, 0.5] + [-0.5] * 3 + [2.0]
    mean, std = statistics.mean(tokens), math.sqrt(statistics.variance(tokens) + 1e-8)
    adv, returns = compute_advantages("reinforce_plus_plus_baseline", x)
    expected = [[(0.5 - mean) / std] * 2 + [0.0], [(-0.5 - mean) / std] * 3, [(2.0 - mean) / std, 0.0, 0.0]]
    close(adv, expected, 1e-5)
    assert torch.equal(adv, returns)


def test_remax_returns_to_go_minus_greedy_baseline():
    """Returns-to-go of the masked token rewards minus the greedy rollout's reward on response tokens."""
    rewards, mask = t([0.0, 0.2, 1.0], [0.5, 9.0, 9.0]), m([1, 1, 1], [1, 0, 0])
    x = AdvantageInputs(rewards, mask, ["a", "b"], reward_baselines=torch.tensor([0.6, 0.1]))
    adv, returns = compute_advantages("remax", x)
    close(returns, [[1.2, 1.2, 1.0], [0.5, 0.0, 0.0]])
    close(adv, [[1.2 - 0.6, 1.2 - 0.6, 1.0 - 0.6], [0.5 - 0.1, 0.0, 0.0]])


def test_gae_by_hand_skips_masked_token():
    """delta_t = r_t + gamma V_next - V_t, A_t = delta_t + gamma lam A_next; a masked token is skipped (V and A
    carried through it); returns = A + V on response tokens; whiten=True whitens A over response tokens."""
    gamma, lam = 0.9, 0.8
    rewards, values, mask = t([0.0, 0.5, 9.0, 1.0]), t([0.2, 0.4, 7.0, 0.3]), m([1, 1, 0, 1])
    x = AdvantageInputs(rewards, mask, ["a"], values=values, gamma=gamma, lam=lam, whiten=False)
    a3 = 1.0 + gamma * 0.0 - 0.3
    a1 = (0.5 + gamma * 0.3 - 0.4) + gamma * lam * a3  # next token is index 3: index 2 is skipped
    a0 = (0.0 + gamma * 0.4 - 0.2) + gamma * lam * a1
    adv, returns = compute_advantages("gae", x)
    close(adv, [[a0, a1, 0.0, a3]])
    close(returns, [[a0 + 0.2, a1 + 0.4, 0.0, a3 + 0.3]])
    x.whiten = True
    mean, std = statistics.mean([a0, a1, a3]), math.sqrt(statistics.variance([a0, a1, a3]) + 1e-8)
    close(compute_advantages("gae", x)[0], [[(a0 - mean) / std, (a1 - mean) / std, 0.0, (a3 - mean) / std]], 1e-5)


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_estimators_ignore_padding_columns(name):
    """Appending masked columns leaves the outputs unchanged and zero there. Values (and, for the token-level
    estimators, rewards) get garbage; outcome estimators score token_rewards.sum(-1) unmasked, as verl does,
    so their reward padding is zero."""
    x = full_inputs()
    adv, returns = compute_advantages(name, x)
    reward_fill = None if name in ("gae", "reinforce_plus_plus", "remax") else 0.0
    padded = AdvantageInputs(
        pad(x.token_rewards, 3, reward_fill), pad(x.response_mask, 3), x.group_ids, pad(x.values, 3),
        x.reward_baselines, gamma=x.gamma, lam=x.lam,
    )  # fmt: skip
    adv_p, returns_p = compute_advantages(name, padded)
    close(adv_p[:, :4], adv, 1e-5)
    close(returns_p[:, :4], returns, 1e-5)
    assert (adv_p[:, 4:] == 0).all() and (returns_p[:, 4:] == 0).all()


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_estimators_are_zero_on_interior_masked_tokens(name):
    """Module contract: advantages and returns are zero on masked tokens, also on masked tokens inside a
    response (e.g. multi-turn observation tokens)."""
    x = full_inputs()
    x.response_mask = m([1, 0, 1, 1], [1, 0, 1, 0], [1, 1, 0, 1], [1, 0, 1, 1])
    adv, returns = compute_advantages(name, x)
    assert (adv[~x.response_mask] == 0).all() and (returns[~x.response_mask] == 0).all()


# ---------------------------------------------------------------- policy losses
def test_aggregate_modes_by_hand():
    """Each mode with mini-batch normalisers (4 tokens, 2 sequences, scale 5)."""
    loss, mask, norm = t([1.0, 2.0, 3.0], [4.0, 50.0, 60.0]), m([1, 1, 1], [1, 0, 0]), LossNorm(4, 2, 5)
    expected = {"token-mean": (1 + 2 + 3 + 4) / 4, "seq-mean-token-sum": (6 + 4) / 2}
    expected |= {"seq-mean-token-mean": (6 / 3 + 4 / 1) / 2, "seq-mean-token-sum-norm": (6 / 5 + 4 / 5) / 2}
    assert set(expected) == set(AGG_MODES)
    for mode, value in expected.items():
        close(aggregate(loss, mask, mode, norm), value)


def test_ppo_by_hand_with_clip_fractions():
    """max(-A r, -A clip(r)) per token, dual-clip at 3 for A < 0; clipfrac / lower / ppo_kl token sums."""
    ratios, adv = [1.5, 0.5, 1.1, 5.0], t([1.0, -1.0, 2.0, -1.0, 8.0])
    logp, old, mask = t([math.log(r) for r in ratios] + [4.0]), t([0.0] * 5), m([1, 1, 1, 1, 0])
    loss, sums = compute_policy_loss("ppo", logp, old, adv, mask, LossNorm(4, 1, 5))
    # r=1.5, A>0: clipped at 1.2; r=0.5, A<0: clipped at 0.8; r=1.1 inside; r=5, A<0: max(5, 1.2) capped at 3
    close(loss, (-1.2 + 0.8 - 2.2 + 3.0) / 4)
    close([sums["pg_clipfrac"], sums["pg_clipfrac_lower"]], [2.0, 1.0])
    close(sums["ppo_kl"], -sum(math.log(r) for r in ratios))


def test_ppo_dual_clip_caps_negative_advantages():
    """For A < 0 the per-token loss never exceeds -A * clip_ratio_c; with clip_ratio_c=0 (off) it does."""
    logp = torch.linspace(-3, 5, 60, dtype=F64).unsqueeze(0)
    old, mask = torch.zeros_like(logp), torch.ones_like(logp, dtype=torch.bool)
    adv = -torch.rand(1, 60, dtype=F64) - 0.1
    capped = losses.ppo(logp, old, adv, mask, LossConfig(clip_ratio_c=3.0)).token_loss
    assert (capped <= -adv * 3.0 + 1e-12).all() and torch.isclose(capped, -adv * 3.0).any()
    free = losses.ppo(logp, old, adv, mask, LossConfig(clip_ratio_c=0)).token_loss
    close(free[0, -1], -adv[0, -1] * math.exp(5.0))
    assert (free > -adv * 3.0).any()


def test_ppo_clip_higher():
    """Ratio 1.25 with A > 0 is clipped at 1.2 (no gradient) for clip_ratio_high=0.2 but not for 0.28."""
    logp, old, adv, mask = t([math.log(1.25)]).requires_grad_(), t([0.0]), t([1.0]), m([1])
    low = loss_of("ppo", logp, old, adv, mask, clip_ratio_high=0.2)
    high = loss_of("ppo", logp, old, adv, mask, clip_ratio_high=0.28)
    close(low, -1.2)
    close(high, -1.25)
    close(torch.autograd.grad(low, logp)[0], [[0.0]])
    close(torch.autograd.grad(high, logp)[0], [[-1.25]])


def test_cispo_gradient_flows_through_clipped_tokens_unlike_ppo():
    """CISPO: loss -sg(clip(r)) A logp, so d/dlogp = -clip(r) A for every token; PPO gives clipped tokens none."""
    ratios, adv, mask = [1.5, 0.5, 1.1], t([1.0, -1.0, 2.0]), m([1, 1, 1])
    old = t([-1.0, -2.0, -0.5])
    logp = (old + t([math.log(r) for r in ratios])).detach().requires_grad_()
    norm = LossNorm(1, 1, 1)  # token-mean over one "token": the plain sum of token losses
    cispo = loss_of("cispo", logp, old, adv, mask, norm=norm)
    weights = [1.2, 0.8, 1.1]
    close(cispo, sum(-w * a * lp for w, a, lp in zip(weights, [1.0, -1.0, 2.0], logp[0].tolist())))
    close(torch.autograd.grad(cispo, logp)[0], [[-1.2 * 1.0, -0.8 * -1.0, -1.1 * 2.0]])
    ppo = loss_of("ppo", logp, old, adv, mask, norm=norm)
    close(torch.autograd.grad(ppo, logp)[0], [[0.0, 0.0, -2.0 * 1.1]])


def test_gspo_sequence_ratio_by_hand():
    """s = exp(mean_t log r) per sequence, clipped like PPO, aggregated with the mode passed (verl 0.9.1);
    under seq-mean-token-mean d loss / d logp_t = -A s / (len * num_seqs) for unclipped sequences, 0 for
    clipped ones."""
    log_r = t([0.1, -0.3, 0.5, 6.0], [0.6, 0.2, 0.4, 0.4], [-0.4, -0.4, 3.0, 3.0])
    old, mask = torch.randn(3, 4, dtype=F64), m([1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0])
    logp, adv = (old + log_r).requires_grad_(), t([1.0] * 4, [1.0] * 4, [-1.0] * 4)
    # s0 = e^0.1 inside; s1 = e^0.4 > 1.2 clipped (A > 0); s2 = e^-0.4 < 0.8 clipped (A < 0): loss 0.8
    seq_mean = (-math.exp(0.1) - 1.2 + 0.8) / 3
    close(loss_of("gspo", logp, old, adv, mask, "seq-mean-token-mean"), seq_mean)
    grad = torch.autograd.grad(loss_of("gspo", logp, old, adv, mask, "seq-mean-token-mean"), logp)[0]
    close(grad, [[-math.exp(0.1) / 9] * 3 + [0.0], [0.0] * 4, [0.0] * 4])
    # the same token losses (3, 4 and 2 tokens) under the other modes
    token_mean = (3 * -math.exp(0.1) + 4 * -1.2 + 2 * 0.8) / 9
    close(loss_of("gspo", logp, old, adv, mask, "token-mean"), token_mean)
    close(loss_of("gspo", logp, old, adv, mask, "seq-mean-token-sum"), (3 * -math.exp(0.1) + 4 * -1.2 + 2 * 0.8) / 3)
    assert abs(token_mean - seq_mean) > 0.05  # unequal lengths: the configured mode matters
    grad = torch.autograd.grad(loss_of("gspo", logp, old, adv, mask, "token-mean"), logp)[0]
    close(grad, [[-math.exp(0.1) / 9] * 3 + [0.0], [0.0] * 4, [0.0] * 4])


def test_sapo_gate_by_hand():
    """Token loss -A * sigmoid(tau (r - 1)) * 4 / tau, tau_pos for A > 0 else tau_neg; seq-mean-token-mean."""
    ratios = [[1.3, 0.7, 1.0], [0.9, 1.6, 2.0]]
    adv, mask = t([1.0, -2.0, 0.5], [-1.0, 3.0, 7.0]), m([1, 1, 1], [1, 1, 0])
    logp, old = t(*[[math.log(r) for r in row] for row in ratios]), torch.zeros(2, 3, dtype=F64)

    def token(r, a, tau_pos=2.0, tau_neg=3.0):
        tau = tau_pos if a > 0 else tau_neg
        return -a * 4 / tau / (1 + math.exp(-tau * (r - 1)))

    row0 = sum(token(r, a) for r, a in zip(ratios[0], [1.0, -2.0, 0.5])) / 3
    row1 = (token(0.9, -1.0) + token(1.6, 3.0)) / 2
    close(loss_of("sapo", logp, old, adv, mask, tau_pos=2.0, tau_neg=3.0), (row0 + row1) / 2)


def test_gpg_loss_and_is_weights_by_hand():
    """GPG token loss -logp A; token-level is_weights multiply it, sequence-level losses use their geometric mean."""
    logp, old, adv, mask = t([-0.5, -1.0, -3.0]), t([0.0] * 3), t([2.0, 3.0, 5.0]), m([1, 1, 0])
    close(loss_of("gpg", logp, old, adv, mask), (0.5 * 2.0 + 1.0 * 3.0) / 2)
    weights, norm = t([0.5, 8.0, 9.0]), norm_of(mask)
    weighted = compute_policy_loss("gpg", logp, old, adv, mask, norm, is_weights=weights)[0]
    close(weighted, (0.5 * 0.5 * 2.0 + 8.0 * 1.0 * 3.0) / 2)
    geo = compute_policy_loss("geo_mean", logp, old, adv, mask, norm)[0]
    weighted = compute_policy_loss("geo_mean", logp, old, adv, mask, norm, is_weights=weights)[0]
    close(weighted, geo * math.sqrt(0.5 * 8.0))


def test_geo_mean_by_hand():
    """GMPO: log ratios clipped to [-low, high] only on the pessimistic side for the advantage sign, ratio =
    exp(mean), loss -mean(A) * ratio per sequence, averaged over sequences."""
    log_r, adv = t([0.3, -0.5, 5.0], [-0.5, 0.4, 0.0]), t([1.0, 1.0, 4.0], [-1.0, -1.0, -1.0])
    old, mask = torch.randn(2, 3, dtype=F64), m([1, 1, 0], [1, 1, 1])
    # A > 0: min(x, clip(x)) = [0.2, -0.5]; A < 0: max(x, clip(x)) = [-0.2, 0.4, 0.0]
    expected = (-1.0 * math.exp((0.2 - 0.5) / 2) + 1.0 * math.exp((-0.2 + 0.4 + 0.0) / 3)) / 2
    close(loss_of("geo_mean", old + log_r, old, adv, mask), expected)


def test_kl_cov_penalises_top_covariance_token():
    """-A r plus |logp - old| on the top kl_cov_ratio share (at least 1) of tokens by (A - mean A)(logp - mean logp)."""
    logp, old, adv, mask = t([-0.1, -1.0, -0.2]), t([-1.0, -1.0, -1.0]), t([1.0, 0.0, -1.0]), m([1, 1, 1])
    # mean A = 0, mean logp = -1.3/3: cov = [1 * 1/3, 0, -1 * 7/30] -> token 0 is penalised (A * logp would pick 2)
    expected = (-math.exp(0.9) + 0.9 + 0.0 + math.exp(0.8)) / 3
    close(loss_of("kl_cov", logp, old, adv, mask), expected)


def test_value_loss_by_hand():
    """0.5 * agg(max((v - R)^2, (old + clip(v - old, -c, c) - R)^2)) and the clip fraction."""
    values, old, returns, mask = t([1.0, 0.0, 5.0]), t([0.5, 1.0, 0.0]), t([1.2, 0.0, 0.0]), m([1, 1, 0])
    # token 0: v - old = 0.5 inside the clip: 0.04; token 1: clipped v = 0.5, max(0, 0.25) = 0.25 (clipped)
    loss, sums = losses.value_loss(values, old, returns, mask, norm_of(mask), cliprange_value=0.5)
    close(loss, 0.5 * (0.04 + 0.25) / 2)
    close(sums["vf_clipfrac"], 1.0)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", DETERMINISTIC_LOSSES)
def test_policy_loss_micro_batch_invariance(name, mode):
    """Loss and d loss / d logp over the batch equal the sums over 1-row micro-batches sharing one LossNorm."""
    old, adv = torch.randn(4, 5, dtype=F64) - 1.0, torch.randn(4, 5, dtype=F64)
    logp = (old + 0.3 * torch.randn(4, 5, dtype=F64)).requires_grad_()
    mask = torch.rand(4, 5) > 0.3
    mask[:, 0], mask[2] = True, False  # row 2 is empty
    norm = norm_of(mask)
    whole = loss_of(name, logp, old, adv, mask, mode, norm)
    rows = [slice(i, i + 1) for i in range(4)]
    parts = sum(loss_of(name, logp[r], old[r], adv[r], mask[r], mode, norm) for r in rows)
    close(whole, parts, 1e-12)
    close(torch.autograd.grad(whole, logp)[0], torch.autograd.grad(parts, logp)[0], 1e-12)


@pytest.mark.parametrize("name", [*DETERMINISTIC_LOSSES, "kl_cov"])
def test_policy_loss_ignores_padding(name):
    """Garbage in appended masked columns changes neither loss, metric sums nor gradients (zero there)."""
    old, adv = torch.randn(3, 4, dtype=F64) - 1.0, torch.randn(3, 4, dtype=F64)
    logp, mask = old + 0.3 * torch.randn(3, 4, dtype=F64), m([1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0])
    logp_p, old_p, adv_p, mask_p = pad(logp, 3).requires_grad_(), pad(old, 3), pad(adv, 3), pad(mask, 3)
    logp = logp.requires_grad_()
    for mode in AGG_MODES:
        norm = norm_of(mask)
        loss, sums = compute_policy_loss(name, logp, old, adv, mask, norm, mode)
        loss_p, sums_p = compute_policy_loss(name, logp_p, old_p, adv_p, mask_p, norm, mode)
        close(loss_p, loss, 1e-12)
        assert sums.keys() == sums_p.keys() and all(torch.allclose(sums[k], sums_p[k]) for k in sums)
        grad, grad_p = torch.autograd.grad(loss, logp)[0], torch.autograd.grad(loss_p, logp_p)[0]
        close(grad_p[:, :4], grad, 1e-12)
        assert (grad_p[:, 4:] == 0).all()


# ---------------------------------------------------------------- KL
def test_kl_estimators_by_hand_and_aliases():
    """k1 = d, abs = |d|, k2 = d^2 / 2, k3 = e^-d + d - 1 (d = logp - ref); aliases kl / mse / low_var_kl."""
    logp, ref = t([-1.0, -2.0]), t([-1.5, -1.0])  # d = [0.5, -1.0]
    expected = {"k1": [0.5, -1.0], "abs": [0.5, 1.0], "k2": [0.125, 0.5]}
    expected["k3"] = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]
    for kind, value in expected.items():
        close(kl_estimate(logp, ref, kind), [value])
    for alias, kind in (("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")):
        assert torch.equal(kl_estimate(logp, ref, alias), kl_estimate(logp, ref, kind))
    assert (kl_estimate(torch.randn(200, dtype=F64) * 3, torch.randn(200, dtype=F64) * 3, "k3") >= 0).all()
    close(kl_estimate(t([0.0, 0.0]), t([100.0, -100.0]), "k3"), [[10.0, 10.0]])  # clamps like verl


def test_adaptive_kl_coef_by_hand():
    """coef * (1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon)."""
    assert adaptive_kl_coef(0.1, 0.11, 0.1, 1000, 256) == pytest.approx(0.1 * (1 + 0.1 * 256 / 1000))
    assert adaptive_kl_coef(0.1, 0.5, 0.1, 1000, 256) == pytest.approx(0.1 * (1 + 0.2 * 256 / 1000))
    assert adaptive_kl_coef(0.1, 0.0, 0.1, 1000, 256) == pytest.approx(0.1 * (1 - 0.2 * 256 / 1000))


# ---------------------------------------------------------------- rollout correction
def rc_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """old, rollout, mask: log ratios old - rollout as below; row 1's padded token holds a garbage -50."""
    log_r = t([0.1, 0.9, -0.2], [0.7, 0.3, -50.0], [-3.0, 0.05, 0.05])
    rollout = t([-1.0, -2.0, -0.5], [-0.3, -1.2, -0.1], [-2.0, -0.7, -1.1])
    return rollout + log_r, rollout, m([1, 1, 1], [1, 1, 0], [1, 1, 1])


def test_rollout_is_weights_by_hand():
    """Token: min(e^(old - rollout), threshold); sequence: min(e^(sum), threshold) broadcast; 0 on padding."""
    old, rollout, mask = rc_case()
    e = math.exp
    weights, keep, _ = correct(old, rollout, mask, CorrectionConfig(rollout_is="token", rollout_is_threshold=2.0))
    close(weights, [[e(0.1), 2.0, e(-0.2)], [2.0, e(0.3), 0.0], [e(-3.0), e(0.05), e(0.05)]])
    assert torch.equal(keep, mask)
    weights, _, metrics = correct(old, rollout, mask, CorrectionConfig(rollout_is="sequence", rollout_is_threshold=2.5))
    close(weights, [[e(0.8)] * 3, [2.5, 2.5, 0.0], [e(-2.9)] * 3])
    assert metrics["rollout_corr/is_weight_max"] == pytest.approx(2.5)
    assert correct(old, rollout, mask, CorrectionConfig())[0] is None


def test_rollout_rejection_masks_and_veto_by_hand():
    """Token / sequence / geometric-mean rejection outside [lower, upper] (lower defaults to 1 / upper, upper to
    is_threshold); the veto drops whole sequences holding an unmasked token with ratio below the floor."""
    old, rollout, mask = rc_case()
    cases = [
        (CorrectionConfig(rollout_rs="token", rollout_is_threshold=2.0), [[1, 0, 1], [0, 1, 0], [0, 1, 1]]),
        # sequence ratios e^0.8 = 2.23, e^1.0 = 2.72, e^-2.9 = 0.055 against [0.4, 2.5]
        (
            CorrectionConfig(rollout_rs="sequence", rollout_rs_threshold=2.5, rollout_rs_threshold_lower=0.4),
            [[1] * 3, [0] * 3, [0] * 3],
        ),
        # geometric means over response tokens e^(0.8/3) = 1.31, e^(1.0/2) = 1.65, e^(-2.9/3) = 0.38 against [2/3, 1.5]
        (CorrectionConfig(rollout_rs="geometric", rollout_rs_threshold=1.5), [[1] * 3, [0] * 3, [0] * 3]),
        (CorrectionConfig(rollout_rs="geometric", rollout_rs_threshold=1.7), [[1] * 3, [1, 1, 0], [0] * 3]),
        # e^-3 = 0.0498 < 0.1 vetoes row 2; row 1's padded e^-50 is ignored
        (CorrectionConfig(rollout_veto_threshold=0.1), [[1] * 3, [1, 1, 0], [0] * 3]),
    ]
    for cfg, expected in cases:
        weights, keep, metrics = correct(old, rollout, mask, cfg)
        assert weights is None and keep.tolist() == m(*expected).tolist(), cfg
    # metrics of the last (veto) case
    assert metrics["rollout_corr/rejected_token_frac"] == pytest.approx(3 / 8)
    assert metrics["rollout_corr/rejected_seq_frac"] == pytest.approx(1 / 3)


def test_mismatch_metrics_by_hand():
    """abs diff mean / max, k1 = mean(rollout - old), k3, ratio extremes over unmasked tokens; {} for no tokens."""
    old, rollout, mask = t([0.0, -1.0, 5.0]), t([0.5, -1.0, -5.0]), m([1, 1, 0])  # old - rollout = [-0.5, 0]
    out = mismatch_metrics(old, rollout, mask)
    quantiles = {f"rollout_corr/is_ratio_{q}" for q in ("p01", "p05", "p50", "p95", "p99")}
    names = ("logprob_abs_diff_mean", "logprob_abs_diff_max", "kl_k1", "kl_k3", "is_ratio_min", "is_ratio_max")
    assert set(out) == {f"rollout_corr/{k}" for k in (*names, "seq_is_ratio_mean", "seq_is_ratio_max")} | quantiles
    expected = [0.25, 0.5, 0.25, (math.exp(-0.5) + 0.5 - 1) / 2, math.exp(-0.5), 1.0]
    assert [out[f"rollout_corr/{k}"] for k in names] == pytest.approx(expected)
    assert out["rollout_corr/seq_is_ratio_max"] == pytest.approx(math.exp(-0.5))
    assert mismatch_metrics(old, rollout, torch.zeros_like(mask)) == {}


# ---------------------------------------------------------------- errors
def test_unknown_names_list_the_valid_ones():
    """Unknown estimator / loss / aggregation / KL names raise ValueError naming every valid choice."""
    x, z, mask = full_inputs(), t([0.0]), m([1])
    cases = [
        (lambda: compute_advantages("nope", x), ESTIMATORS),
        (lambda: compute_policy_loss("nope", z, z, z, mask, LossNorm(1, 1, 1)), losses.POLICY_LOSSES),
        (lambda: aggregate(z, mask, "nope", LossNorm(1, 1, 1)), AGG_MODES),
        (lambda: kl_estimate(z, z, "nope"), ("k1", "k2", "k3", "abs")),
    ]
    for call, valid in cases:
        with pytest.raises(ValueError, match="nope") as info:
            call()
        assert all(name in str(info.value) for name in valid)
    x.values, x.reward_baselines = None, None
    for name in ("gae", "remax"):
        with pytest.raises(ValueError):
            compute_advantages(name, x)
