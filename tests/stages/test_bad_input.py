"""Bad input exits 1 with one message naming the file, line or key; no traceback; no partial output."""

from __future__ import annotations

import json
import shutil

import pytest

from rlx.models.tiny import write_tiny_model_dir
from tests.conftest import cli, cli_ok, rollout_args, write_jsonl


def assert_user_error(result, *fragments: str) -> None:
    assert result.exit_code == 1, result
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.mark.parametrize(
    "content,fragments",
    [
        ('{"prompt": "1+1="}\n{"prompt": "2+2=" \n', [":2:", "malformed JSON"]),
        ('{"prompt": "1+1="}\n{"id": "x"}\n', [":2:", "missing required field 'prompt'"]),
        ('{"prompt": 7}\n', [":1:", "field 'prompt'", "expected a non-empty string"]),
        (
            '{"id": "a", "prompt": "1+1="}\n{"id": "a", "prompt": "2+2="}\n',
            [":2:", "duplicate prompt id 'a'", "line 1"],
        ),
        ("", ["no prompts", "empty"]),
        ("[1, 2]\n", [":1:", "expected a JSON object"]),
    ],
)
def test_bad_prompts_file(tmp_path, tiny_ckpt, content, fragments):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(content)
    out = tmp_path / "rollouts.jsonl"
    assert_user_error(cli(*rollout_args(tiny_ckpt, prompts, out)), str(prompts), *fragments)
    assert not out.exists()


def test_missing_model_dir(tmp_path, prompts_file):
    out = tmp_path / "r.jsonl"
    assert_user_error(cli(*rollout_args(tmp_path / "nope", prompts_file, out)), "nope", "not found")
    assert not out.exists()
    assert_user_error(cli("shard", "--model", tmp_path / "nope", "--out", tmp_path / "ck"), "not found")
    assert not (tmp_path / "ck").exists()


def test_model_dir_without_weights(tmp_path, tiny_dir, prompts_file):
    assert_user_error(cli(*rollout_args(tiny_dir, prompts_file, tmp_path / "r.jsonl")), "no weights")


def _corrupt_copy(src, dst, mode):
    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if mode == "truncated" else b"\x00" * 64 + data[64:])
    return dst


@pytest.mark.parametrize("mode", ["truncated", "foreign"])
def test_damaged_model_weights(tmp_path, tiny_ckpt, prompts_file, mode):
    bad = _corrupt_copy(tiny_ckpt, tmp_path / "bad", mode)
    out = tmp_path / "r.jsonl"
    assert_user_error(cli(*rollout_args(bad, prompts_file, out)), "model.safetensors", "not a readable safetensors")
    assert not out.exists()
    assert_user_error(cli("merge", "--checkpoint", bad, "--out", tmp_path / "hf"), "model.safetensors")
    assert not (tmp_path / "hf").exists()


@pytest.fixture(scope="module")
def scored(tmp_path_factory, tiny_ckpt, prompts_file):
    d = tmp_path_factory.mktemp("scored")
    cli_ok(*rollout_args(tiny_ckpt, prompts_file, d / "rollouts.jsonl"))
    cli_ok("score", "--rollouts", d / "rollouts.jsonl", "--actor", tiny_ckpt, "--reward", "arith", "--out", d)
    return d


@pytest.mark.parametrize("mode", ["truncated", "foreign", "not-a-batch"])
def test_damaged_batch(tmp_path, tiny_ckpt, scored, mode):
    batch = tmp_path / "batch.safetensors"
    data = (scored / "batch.safetensors").read_bytes()
    if mode == "truncated":
        batch.write_bytes(data[:-100])
    elif mode == "foreign":
        batch.write_text("hello, this is not safetensors at all" * 4)
    else:
        shutil.copy(tiny_ckpt / "model.safetensors", batch)  # valid safetensors, not a batch
    out = tmp_path / "next"
    fragment = "not an rlx batch" if mode == "not-a-batch" else "not a readable safetensors"
    assert_user_error(
        cli("train-step", "--checkpoint", tiny_ckpt, "--batch", batch, "--out", out), str(batch), fragment
    )
    assert not out.exists()


def test_a_checkpoint_missing_its_optimizer_state_is_refused(tmp_path, tiny_ckpt, scored):
    """rlx.json records AdamW state; optimizer.safetensors is gone (a copy that skipped the largest file): refused,
    not trained on with fresh moments."""
    batch = scored / "batch.safetensors"
    cli_ok("train-step", "--checkpoint", tiny_ckpt, "--batch", batch, "--out", tmp_path / "one")
    # the batch's old logprobs are tiny_ckpt's: training another checkpoint of the model is said, not refused
    noted = cli_ok("train-step", "--checkpoint", tmp_path / "one", "--batch", batch, "--out", tmp_path / "noted")
    assert f"was scored by {tiny_ckpt.resolve()} (step 0); training {tmp_path / 'one'} (step 1)" in noted.stderr
    (tmp_path / "one" / "optimizer.safetensors").unlink()
    out = tmp_path / "two"
    result = cli("train-step", "--checkpoint", tmp_path / "one", "--batch", batch, "--out", out)
    assert_user_error(result, "optimizer.safetensors is missing", "at step 1")
    assert not out.exists()


def test_a_batch_scored_by_a_model_of_another_shape_is_said(tmp_path, scored):
    """Its old logprobs are another model's: trained (an off-policy experiment may mean it), with a warning."""
    other = write_tiny_model_dir(tmp_path / "other", num_layers=3)
    cli_ok("shard", "--model", other, "--init", "random", "--out", tmp_path / "ck")
    batch = scored / "batch.safetensors"
    result = cli_ok("train-step", "--checkpoint", tmp_path / "ck", "--batch", batch, "--out", tmp_path / "next")
    assert "warning: " in result.stderr and "a model of another shape" in result.stderr and "llama 3x" in result.stderr


def test_vocab_size_mismatch(tmp_path, scored):
    other = write_tiny_model_dir(tmp_path / "other", chars="0123456789+-*= abc")
    cli_ok("shard", "--model", other, "--init", "random", "--out", tmp_path / "ck")
    out = tmp_path / "next"
    result = cli("train-step", "--checkpoint", tmp_path / "ck", "--batch", scored / "batch.safetensors", "--out", out)
    assert_user_error(result, "batch.safetensors", "vocabulary of 19", "22")
    assert not out.exists()


def test_rollouts_from_another_vocabulary(tmp_path, tiny_ckpt, scored):
    records = [json.loads(line) for line in (scored / "rollouts.jsonl").read_text().splitlines()]
    records[3]["response_ids"][0] = 500
    bad = write_jsonl(tmp_path / "r.jsonl", records)
    result = cli("score", "--rollouts", bad, "--actor", tiny_ckpt, "--reward", "arith", "--out", tmp_path / "s")
    assert_user_error(result, "token id 500", "19 entries", records[3]["id"])
    assert not (tmp_path / "s").exists()


def test_unknown_reward_name(tmp_path, tiny_ckpt, scored):
    out = tmp_path / "s"
    result = cli(
        "score", "--rollouts", scored / "rollouts.jsonl", "--actor", tiny_ckpt, "--reward", "arithmetic", "--out", out
    )
    assert_user_error(result, "arithmetic", "arith, gsm8k, math")
    assert not out.exists()


def test_bad_rollouts_line(tmp_path, tiny_ckpt, scored):
    lines = (scored / "rollouts.jsonl").read_text().splitlines()
    record = json.loads(lines[1])
    record["rollout_logprobs"] = record["rollout_logprobs"][:-1]
    lines[1] = json.dumps(record)
    bad = tmp_path / "r.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    result = cli("score", "--rollouts", bad, "--actor", tiny_ckpt, "--out", tmp_path / "s")
    assert_user_error(result, f"{bad}:2:", "rollout_logprobs")


def test_bad_option_values(tmp_path, tiny_ckpt, prompts_file):
    result = cli(*rollout_args(tiny_ckpt, prompts_file, tmp_path / "r.jsonl", "--top-p", "0"))
    assert_user_error(result, "--top-p", "(0, 1]")
    result = cli(*rollout_args(tiny_ckpt, prompts_file, tmp_path / "r.jsonl", "--engine", "vllm2"))
    assert_user_error(result, "--engine", "'hf'")


def test_existing_checkpoint_output_is_not_overwritten(tmp_path, tiny_dir, tiny_ckpt):
    result = cli("shard", "--model", tiny_dir, "--init", "random", "--out", tiny_ckpt)
    assert_user_error(result, "already exists", "--overwrite")


def test_unknown_recipe_key(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[model]\npath = "m"\n[data]\nprompts = "p"\n[rollout]\nnum_samples = 4\n')
    assert_user_error(cli("ppo", recipe, "--out", tmp_path / "run"), "r.toml", "rollout.num_samples", "unknown key")
    assert not (tmp_path / "run").exists()
    assert_user_error(cli("ppo", recipe, "--set", "train.lrr=1", "--out", tmp_path / "run"), "rollout.num_samples")
    recipe.write_text('[model]\npath = "m"\n[data]\nprompts = "p"\n')  # a key of --set is --set's, not the file's
    bad = cli("ppo", recipe, "--set", "train.optim.lrr=1", "--out", tmp_path / "run")
    assert_user_error(bad, "--set: train.optim.lrr: unknown key (did you mean 'lr'?")
    assert "r.toml" not in bad.stderr


def test_non_finite_numbers_are_named_and_nothing_is_written(tmp_path):
    """A NaN logprob (a model with non-finite logits) names the record and field; no half-written file."""
    from rlx.errors import UserError
    from rlx.utils.io import write_jsonl

    out = tmp_path / "rollouts.jsonl"
    good = {"id": "p0-0", "rollout_logprobs": [-0.5, -1.0]}
    bad = {"id": "p0-1", "response_ids": [3, 4], "rollout_logprobs": [-0.5, float("nan")]}
    with pytest.raises(UserError, match=r"record 'p0-1': 'rollout_logprobs' holds NaN or infinity"):
        write_jsonl(out, [good, bad])
    assert not out.exists() and list(tmp_path.iterdir()) == []
    with pytest.raises(UserError, match=r"'rewards' holds NaN"):
        write_jsonl(out, [{"id": "s", "reward": 1.0, "rewards": {"judge": {"score": float("inf")}}}])
