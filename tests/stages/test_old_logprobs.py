"""score.old_logprobs = 'train': with one update per batch the train step's own forward gives the old logprobs
(detached), so the score phase runs no actor forward; the update equals the one on the actor-scored batch, and the
rollout/trainer mismatch metrics come from the train step."""

from __future__ import annotations

import pytest
import torch

from rlx.errors import UserError
from rlx.formats.batch import TrainBatch
from rlx.ppo.config import load_recipe
from tests.conftest import REPO, cli, cli_ok, max_diff, read_jsonl, write_length_reward
from tests.stages.test_ppo import SMALL

QUICKSTART = REPO / "recipes" / "quickstart.toml"
ONE_UPDATE = ["train.mini_batch_size=0", "use_ref=false"]


def _close_weights(a, b, atol: float) -> None:
    from rlx.models.loading import read_weights

    wa, wb = read_weights(a), read_weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], atol=atol, rtol=0, msg=key)


def test_ppo_takes_the_old_logprobs_from_the_train_forward(tmp_path):
    """The same run with old logprobs from the train forward and from the actor's scoring forward: the same
    rollouts at step 1, weights within float noise after two steps, the mismatch metrics present in both (from
    the train step in the first), and the batch file says where its old logprobs come from."""
    runs = {}
    for source in ("train", "actor"):
        sets = [f"--set={s}" for s in (*ONE_UPDATE, "steps=2", f"score.old_logprobs={source}")]
        cli_ok("ppo", QUICKSTART, "--out", tmp_path / source, *SMALL, *sets)
        runs[source] = read_jsonl(tmp_path / source / "metrics.jsonl")
    train, actor = tmp_path / "train", tmp_path / "actor"
    step1 = "step_000001/rollouts.jsonl"
    assert (train / step1).read_bytes() == (actor / step1).read_bytes()
    _close_weights(train / "checkpoints" / "step_000002", actor / "checkpoints" / "step_000002", atol=1e-5)
    assert max_diff(train / "checkpoints" / "step_000001", train / "checkpoints" / "step_000002") > 1e-4
    for line_train, line_actor in zip(runs["train"], runs["actor"]):
        assert line_train["actor/old_logprobs_from_train"] == 1.0
        assert "actor/old_logprobs_from_train" not in line_actor
        for key in ("rollout_corr/logprob_abs_diff_max", "rollout_corr/kl_k3", "rollout_corr/is_ratio_max"):
            assert abs(line_train[key] - line_actor[key]) < 1e-4, (key, line_train[key], line_actor[key])
        assert line_train["actor/ppo_kl"] == 0.0  # the ratio is 1: the old logprobs are the new ones, detached
        assert line_train["reward/mean"] == pytest.approx(line_actor["reward/mean"])
    batch = TrainBatch.load(train / "step_000001" / "batch.safetensors")
    assert batch.meta.old_logprobs == "train"
    assert TrainBatch.load(actor / "step_000001" / "batch.safetensors").meta.old_logprobs == "actor"


def test_auto_takes_train_only_where_one_update_sees_the_sampling_policy():
    def resolved(*sets: str) -> str:
        return load_recipe(QUICKSTART, ["score.old_logprobs=auto", *sets]).score.old_logprobs

    assert resolved(*ONE_UPDATE) == "train"
    assert resolved("train.mini_batch_size=0", "use_ref=true") == "train"  # the KL loss reads the ref, not these
    assert resolved("use_ref=false") == "actor"  # the quickstart's 2 mini-batches of 128 of 256 samples
    assert resolved(*ONE_UPDATE, "train.epochs=2") == "actor"
    assert resolved(*ONE_UPDATE, "train.correction.rollout_rs=token") == "actor"
    assert resolved(*ONE_UPDATE, "exact=true", "rollout.engine=native") == "actor"  # it takes the rollout's
    assert resolved(*ONE_UPDATE, "megatron={tp_degree=1}") == "actor"  # its stages have no detached-forward path
    assert resolved(*ONE_UPDATE, "score.router_replay=rollout") == "actor"  # the old ones replayed, the new not
    assert resolved("train.mini_batch_size=0", "use_ref=true", "score.kl_coef=0.01") == "actor"
    assert load_recipe(QUICKSTART, ONE_UPDATE).score.old_logprobs == "actor"  # not on unless asked (CUDA fast path)
    with pytest.raises(UserError, match=r"score.old_logprobs.*train.epochs = 2"):
        load_recipe(QUICKSTART, ["score.old_logprobs=train", *ONE_UPDATE, "train.epochs=2"])


def test_train_step_on_a_batch_scored_for_the_train_forward(tmp_path, tiny_ckpt, prompts_file):
    """`rlx score --old-logprobs train` then `rlx train-step`: the update the actor-scored batch gives (within float
    noise), the mismatch metrics from the step, and a clear refusal where the step would update more than once."""
    rollouts = tmp_path / "rollouts.jsonl"
    cli_ok("rollout", "--model", tiny_ckpt, "--prompts", prompts_file, "--out", rollouts, "--n", "4",
           "--max-new-tokens", "4", "--num-prompts", "3", "--temperature", "1")  # fmt: skip
    metrics, reward = tmp_path / "metrics.jsonl", write_length_reward(tmp_path)
    for source in ("train", "actor"):
        scored = tmp_path / source
        cli_ok("score", "--rollouts", rollouts, "--out", scored, "--actor", tiny_ckpt, "--reward", f"{reward}:score",
               "--old-logprobs", source, "--metrics", tmp_path / f"score_{source}.jsonl")  # fmt: skip
        cli_ok("train-step", "--checkpoint", tiny_ckpt, "--batch", scored / "batch.safetensors", "--out",
               tmp_path / f"step_{source}", "--lr", "1e-2", "--micro-batch-size=5", "--metrics", metrics)  # fmt: skip
    assert "rollout_corr/logprob_abs_diff_max" not in read_jsonl(tmp_path / "score_train.jsonl")[-1]
    assert "rollout_corr/logprob_abs_diff_max" in read_jsonl(tmp_path / "score_actor.jsonl")[-1]
    from_train, from_actor = read_jsonl(metrics)
    assert from_train["actor/old_logprobs_from_train"] == 1.0
    assert from_train["rollout_corr/logprob_abs_diff_max"] == pytest.approx(
        read_jsonl(tmp_path / "score_actor.jsonl")[-1]["rollout_corr/logprob_abs_diff_max"], abs=1e-5
    )
    assert from_train["actor/loss"] == pytest.approx(from_actor["actor/loss"], abs=1e-5)
    _close_weights(tmp_path / "step_train", tmp_path / "step_actor", atol=1e-5)
    assert max_diff(tiny_ckpt, tmp_path / "step_train") > 1e-3  # the step moved the weights
    batch = tmp_path / "train" / "batch.safetensors"
    twice = cli("train-step", "--checkpoint", tiny_ckpt, "--batch", batch, "--out", tmp_path / "e2", "--epochs", "2")
    assert twice.exit_code == 1, twice
    assert f"{batch}: the batch's old logprobs are to come from this step's forward" in twice.stderr
    assert "train.epochs = 2 and train.mini_batch_size = 0" in twice.stderr
    assert not (tmp_path / "e2").exists()
    kl = cli("score", "--rollouts", rollouts, "--out", tmp_path / "kl", "--actor", tiny_ckpt, "--ref", tiny_ckpt,
             "--kl-coef", "0.1", "--old-logprobs", "train")  # fmt: skip
    assert kl.exit_code == 1 and "--old-logprobs: 'train' leaves them to the train step" in kl.stderr, kl
