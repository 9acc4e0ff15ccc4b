"""Rule rewards, user reward functions, and what happens when a reward function fails."""

from __future__ import annotations

import json

import pytest

from rlx.scoring.rules import arith, gsm8k, last_boxed, math, normalize_math
from tests.conftest import cli, cli_ok, read_jsonl, rollout_args, write_jsonl


@pytest.mark.parametrize(
    "response,truth,score",
    [
        ("7", "7", 1.0),
        ("3+4=7", "7", 1.0),
        ("The answer is 1,234.", "1234", 1.0),
        ("-3", "-3", 1.0),
        ("0.5", "1/2", 1.0),
        ("x = 7.0", "7", 1.0),
        ("8", "7", 0.0),
        ("seven", "7", 0.0),
        ("", "7", 0.0),
        ("12 + 7 = 19", "19", 1.0),
        ("\\boxed{19} because 12 + 7", "19", 1.0),
        ("reason #### 42", "42", 1.0),
    ],
)
def test_arith(response, truth, score):
    assert arith("arith", response, truth)["score"] == score


def test_arith_rejects_a_non_numeric_ground_truth():
    with pytest.raises(ValueError, match="not a number"):
        arith("arith", "7", "seven")


@pytest.mark.parametrize(
    "response,truth,method,score",
    [
        ("so she has 18 eggs #### 18", "Janet ... #### 18", "strict", 1.0),
        ("#### 1,000", "1000", "strict", 1.0),
        ("the answer is 18", "18", "strict", 0.0),
        ("the answer is 18", "18", "flexible", 1.0),
        ("#### 17", "18", "strict", 0.0),
    ],
)
def test_gsm8k(response, truth, method, score):
    assert gsm8k("openai/gsm8k", response, truth, method=method)["score"] == score


@pytest.mark.parametrize(
    "response,truth,score",
    [
        ("so \\boxed{\\frac{1}{2}}", "\\frac12", 1.0),
        ("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0),
        ("\\boxed{10\\%}", "10", 1.0),
        ("\\boxed{\\text{(B)}}", "(B)", 1.0),
        ("\\boxed{x = 5}", "5", 1.0),
        ("\\boxed{6}", "5", 0.0),
        ("no box, 5", "5", 0.0),
    ],
)
def test_math(response, truth, score):
    assert math("lighteval/MATH", response, truth)["score"] == score


def test_boxed_extraction_handles_nesting():
    assert last_boxed("a \\boxed{1} then \\boxed{\\frac{a}{b^{2}}} end") == "\\frac{a}{b^{2}}"
    assert last_boxed("nothing here") is None
    assert normalize_math("\\left( 1, 2 \\right)") == "(1,2)"


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory, tiny_ckpt, prompts_file):
    path = tmp_path_factory.mktemp("r") / "rollouts.jsonl"
    cli_ok(*rollout_args(tiny_ckpt, prompts_file, path))
    return path


def test_reward_by_data_source_and_by_user_function(tmp_path, tiny_ckpt, rollouts, monkeypatch):
    module = tmp_path / "my_reward.py"
    module.write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': float(len(solution_str)), 'bonus': 0.5}\n"
    )
    out = tmp_path / "s"
    cli_ok("score", "--rollouts", rollouts, "--actor", tiny_ckpt, "--reward", f"{module}:score", "--out", out)
    scores, records = read_jsonl(out / "scores.jsonl"), read_jsonl(rollouts)
    assert [s["reward"] for s in scores] == [float(len(r["response"])) for r in records]
    assert scores[0]["rewards"] == {"score": {"score": scores[0]["reward"], "bonus": 0.5}}
    monkeypatch.syspath_prepend(str(tmp_path))
    cli_ok(
        "score",
        "--rollouts",
        rollouts,
        "--actor",
        tiny_ckpt,
        "--reward",
        "my_reward:score",
        "--out",
        out,
        "--overwrite",
    )
    cli_ok("score", "--rollouts", rollouts, "--actor", tiny_ckpt, "--out", out, "--overwrite")  # data_source 'arith'
    assert "arith" in read_jsonl(out / "scores.jsonl")[0]["rewards"]


def _failing_module(tmp_path, body: str):
    module = tmp_path / "bad_reward.py"
    module.write_text(
        f"import math\ndef score(data_source, solution_str, ground_truth, extra_info=None):\n    {body}\n"
    )
    return f"{module}:score"


@pytest.mark.parametrize(
    "body,message",
    [
        (
            "if extra_info['sample_index'] == 2: raise RuntimeError('grader crashed')\n    return 1.0",
            "raised RuntimeError: grader crashed",
        ),
        ("return math.nan if extra_info['sample_index'] == 2 else 1.0", "returned nan"),
        ("return None if extra_info['sample_index'] == 2 else 1.0", "returned None"),
    ],
)
def test_failing_reward_names_the_sample(tmp_path, tiny_ckpt, rollouts, body, message):
    spec = _failing_module(tmp_path, body)
    out = tmp_path / "s"
    result = cli("score", "--rollouts", rollouts, "--actor", tiny_ckpt, "--reward", spec, "--out", out)
    first_bad = read_jsonl(rollouts)[2]["id"]
    assert result.exit_code == 1 and f"sample {first_bad!r}" in result.stderr and message in result.stderr
    assert "Traceback" not in result.stderr and not out.exists()
    # opting in: failed samples score 0, are counted, and the batch has no NaN
    metrics = tmp_path / "m.jsonl"
    cli_ok(
        "score",
        "--rollouts",
        rollouts,
        "--actor",
        tiny_ckpt,
        "--reward",
        spec,
        "--out",
        out,
        "--on-reward-error",
        "zero",
        "--max-reward-error-fraction",
        "1",
        "--metrics",
        metrics,
    )
    scores = read_jsonl(out / "scores.jsonl")
    failed = [s for s in scores if "reward_error" in s]
    assert len(failed) == 4 and all(s["reward"] == 0.0 for s in failed)
    assert json.loads(metrics.read_text())["reward/num_errors"] == 4.0
    from rlx.formats.batch import TrainBatch

    batch = TrainBatch.load(out / "batch.safetensors")
    for tensor in batch.tensors().values():
        assert not tensor.float().isnan().any()


def test_unknown_data_source(tmp_path, tiny_ckpt, rollouts):
    records = read_jsonl(rollouts)
    records[0]["data_source"] = "my-dataset"
    path = write_jsonl(tmp_path / "r.jsonl", records)
    result = cli("score", "--rollouts", path, "--actor", tiny_ckpt, "--out", tmp_path / "s")
    assert result.exit_code == 1 and "'my-dataset'" in result.stderr and records[0]["id"] in result.stderr
