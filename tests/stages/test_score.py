"""`rlx score`: the batch it writes, old/ref logprobs, KL, advantages, metrics."""

from __future__ import annotations

import json

import pytest
import torch

from rlx.formats.batch import TrainBatch
from tests.conftest import cli, cli_ok, read_jsonl, rollout_args


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory, tiny_ckpt, prompts_file):
    path = tmp_path_factory.mktemp("r") / "rollouts.jsonl"
    cli_ok(*rollout_args(tiny_ckpt, prompts_file, path, "--max-new-tokens", "4", "--temperature", "0.9"))
    return path


def test_batch_layout_matches_the_rollouts(tmp_path, tiny_ckpt, rollouts):
    cli_ok(
        "score",
        "--rollouts",
        rollouts,
        "--actor",
        tiny_ckpt,
        "--ref",
        tiny_ckpt,
        "--reward",
        "arith",
        "--out",
        tmp_path,
    )
    batch = TrainBatch.load(tmp_path / "batch.safetensors")
    records, scores = read_jsonl(rollouts), read_jsonl(tmp_path / "scores.jsonl")
    assert batch.meta.sample_ids == [r["id"] for r in records] == [s["id"] for s in scores]
    assert batch.meta.temperature == 0.9 and batch.meta.vocab_size == 19 and batch.meta.pad_token_id == 0
    for row, rec in enumerate(records):
        n_p, n_r = len(rec["prompt_ids"]), len(rec["response_ids"])
        assert batch.prompt_ids[row, -n_p:].tolist() == rec["prompt_ids"]
        assert batch.prompt_mask[row].sum() == n_p and batch.prompt_mask[row, -n_p:].all()
        assert batch.response_ids[row, :n_r].tolist() == rec["response_ids"]
        assert batch.response_mask[row].sum() == n_r
        assert torch.allclose(batch.rollout_logprobs[row, :n_r], torch.tensor(rec["rollout_logprobs"]))
        # old logprobs recomputed by the actor agree with the sampler's (same weights, same temperature)
        assert torch.allclose(batch.old_logprobs[row, :n_r], torch.tensor(rec["rollout_logprobs"]), atol=1e-5)
        assert batch.token_rewards[row, n_r - 1] == scores[row]["reward"]
        assert torch.allclose(batch.advantages[row, :n_r], torch.tensor(scores[row]["advantage"]), atol=1e-6)
    assert torch.equal(batch.ref_logprobs, batch.old_logprobs)  # ref == actor here


def test_in_reward_kl_and_metrics(tmp_path, tiny_ckpt, rollouts, prompts_file):
    step1 = tmp_path / "step1"
    # make a second policy: one train step away from the first
    cli_ok("score", "--rollouts", rollouts, "--actor", tiny_ckpt, "--reward", "arith", "--out", tmp_path / "s0")
    cli_ok(
        "train-step",
        "--checkpoint",
        tiny_ckpt,
        "--batch",
        tmp_path / "s0" / "batch.safetensors",
        "--out",
        step1,
        "--lr",
        "0.05",
    )
    metrics = tmp_path / "m.jsonl"
    cli_ok(
        "score",
        "--rollouts",
        rollouts,
        "--actor",
        step1,
        "--ref",
        tiny_ckpt,
        "--reward",
        "arith",
        "--kl-coef",
        "0.5",
        "--out",
        tmp_path / "s1",
        "--metrics",
        metrics,
    )
    batch = TrainBatch.load(tmp_path / "s1" / "batch.safetensors")
    kl = (batch.old_logprobs - batch.ref_logprobs) * batch.response_mask
    assert kl.abs().max() > 1e-5
    expected = -0.5 * kl
    last = batch.response_mask.sum(-1) - 1
    expected[torch.arange(batch.size), last] += batch.rewards
    assert torch.allclose(batch.token_rewards, expected, atol=1e-6)
    line = json.loads(metrics.read_text())
    assert line["step"] == 2  # the actor checkpoint is at step 1
    assert line["actor/ref_kl"] == pytest.approx((kl.sum() / batch.response_mask.sum()).item(), rel=1e-5)
    for key in (
        "reward/mean",
        "reward/std",
        "response_length/mean",
        "rollout_corr/logprob_abs_diff_mean",
        "reward/arith/has_answer",
        "timing/score_s",
    ):
        assert key in line


def test_kl_coef_needs_a_reference(tmp_path, tiny_ckpt, rollouts):
    result = cli("score", "--rollouts", rollouts, "--actor", tiny_ckpt, "--kl-coef", "0.1", "--out", tmp_path / "s")
    assert result.exit_code == 1 and "--ref" in result.stderr


def test_old_logprobs_from_the_rollout(tmp_path, tiny_ckpt, rollouts):
    cli_ok("score", "--rollouts", rollouts, "--actor", tiny_ckpt, "--old-logprobs", "rollout", "--out", tmp_path)
    batch = TrainBatch.load(tmp_path / "batch.safetensors")
    assert torch.equal(batch.old_logprobs, batch.rollout_logprobs)


def test_packed_scoring_equals_padded(tmp_path, tiny_ckpt, rollouts):
    """--use-packing runs token-budget micro-batches as packed rows: the same logprobs (old and ref) as the padded
    micro-batches, whatever the budget."""
    common = ["score", "--rollouts", rollouts, "--actor", tiny_ckpt, "--ref", tiny_ckpt, "--reward", "arith"]
    cli_ok(*common, "--out", tmp_path / "padded", "--micro-batch-size", "3")
    cli_ok(*common, "--out", tmp_path / "packed", "--use-packing", "--max-tokens-per-micro-batch", "40")
    padded, packed = (TrainBatch.load(tmp_path / name / "batch.safetensors") for name in ("padded", "packed"))
    assert (packed.old_logprobs - padded.old_logprobs).abs().max() < 1e-5
    assert (packed.ref_logprobs - padded.ref_logprobs).abs().max() < 1e-5
    assert packed.old_logprobs.abs().sum() > 0
