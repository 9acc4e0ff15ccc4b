"""verl's data as it is: parquet prompt files through `rlx rollout` and `rlx score`, `extra_info` reaching the
reward function unchanged, and non-numeric reward extras kept in scores.jsonl (metrics keep the numbers)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import cli, cli_ok, read_jsonl, write_jsonl

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

EXTRA_INFOS = [
    {"split": "train", "index": 0, "answer": "The sum is 3.", "tags": ["easy", "add"], "weight": 0.5},
    {"split": "train", "index": 1, "answer": "4", "tags": [], "weight": None},
]


def write_verl_parquet(path):
    """Two rows in verl's layout: chat prompt, data_source, ability, reward_model, extra_info, an extra column."""
    rows = {
        "data_source": ["openai/gsm8k", "openai/gsm8k"],
        "prompt": [[{"role": "user", "content": "1+2"}], [{"role": "user", "content": "2+2"}]],
        "ability": ["math", "math"],
        "reward_model": [{"style": "rule", "ground_truth": "3"}, {"style": "rule", "ground_truth": "4"}],
        "extra_info": EXTRA_INFOS,
        "level": [1, 2],
    }
    pq.write_table(pa.table(rows), path)
    return path


CHECKING_REWARD = """
import json
EXPECTED = json.loads({expected!r})

def score(data_source, solution_str, ground_truth, extra_info=None):
    row = int(extra_info['prompt_id'])
    for key, value in EXPECTED[row].items():  # verl's extra_info, unchanged and not nested
        assert extra_info[key] == value, (key, extra_info[key], value)
    assert 'extra_info' not in extra_info
    assert extra_info['sample_index'] in (0, 1) and extra_info['id'] == f"{{row}}/{{extra_info['sample_index']}}"
    assert extra_info['ability'] == 'math' and extra_info['level'] == row + 1
    assert extra_info['reward_model'] == {{'style': 'rule', 'ground_truth': ground_truth}}
    assert data_source == 'openai/gsm8k' and ground_truth == ['3', '4'][row]
    return {{'score': 1.0 + row, 'pred': solution_str[:3], 'is_exact': row == 1, 'tags': extra_info['tags'],
             'acc': 0.25}}
"""


def test_parquet_prompts_through_rollout_and_score(tmp_path, chat_ckpt):
    prompts = write_verl_parquet(tmp_path / "train.parquet")
    reward = tmp_path / "check.py"
    reward.write_text(CHECKING_REWARD.format(expected=json.dumps(EXTRA_INFOS)))
    rollouts, out, metrics = tmp_path / "r.jsonl", tmp_path / "s", tmp_path / "m.jsonl"
    cli_ok("rollout", "--model", chat_ckpt, "--prompts", prompts, "--out", rollouts, "--n", "2",
           "--max-new-tokens", "3")  # fmt: skip
    records = read_jsonl(rollouts)
    assert [r["id"] for r in records] == ["0/0", "0/1", "1/0", "1/1"]
    assert records[2]["ground_truth"] == "4" and records[2]["extra_info"] == EXTRA_INFOS[1]
    assert records[0]["prompt"] == [{"role": "user", "content": "1+2"}] and records[0]["level"] == 1
    cli_ok("score", "--rollouts", rollouts, "--actor", chat_ckpt, "--reward", f"{reward}:score", "--out", out,
           "--metrics", metrics)  # fmt: skip
    scores = read_jsonl(out / "scores.jsonl")
    assert [s["reward"] for s in scores] == [1.0, 1.0, 2.0, 2.0]
    details = scores[2]["rewards"]["score"]
    assert details == {"score": 2.0, "pred": records[2]["response"][:3], "is_exact": True, "tags": [], "acc": 0.25}
    first = scores[0]["rewards"]["score"]
    assert first["tags"] == ["easy", "add"] and first["is_exact"] is False
    line = json.loads(metrics.read_text())
    assert line["reward/score/acc"] == 0.25 and line["reward/score/is_exact"] == 0.5  # booleans count as 0/1
    assert "reward/score/pred" not in line and "reward/score/tags" not in line


def test_jsonl_extra_info_is_not_nested(tmp_path, chat_ckpt):
    """The same rule for prompts.jsonl: an `extra_info` object reaches the reward function as it is."""
    prompts = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"prompt": [{"role": "user", "content": "1+2"}], "data_source": "openai/gsm8k", "ground_truth": "3",
             "ability": "math", "level": 1, "reward_model": {"style": "rule", "ground_truth": "3"},
             "extra_info": EXTRA_INFOS[0]},
            {"prompt": [{"role": "user", "content": "2+2"}], "data_source": "openai/gsm8k", "ground_truth": "4",
             "ability": "math", "level": 2, "reward_model": {"style": "rule", "ground_truth": "4"},
             "extra_info": EXTRA_INFOS[1]},
        ],
    )  # fmt: skip
    reward = tmp_path / "check.py"
    reward.write_text(CHECKING_REWARD.format(expected=json.dumps(EXTRA_INFOS)))
    rollouts = tmp_path / "r.jsonl"
    cli_ok("rollout", "--model", chat_ckpt, "--prompts", prompts, "--out", rollouts, "--n", "2",
           "--max-new-tokens", "2")  # fmt: skip
    out = tmp_path / "s"
    cli_ok("score", "--rollouts", rollouts, "--actor", chat_ckpt, "--reward", f"{reward}:score", "--out", out)


def test_parquet_bad_input(tmp_path, chat_ckpt, monkeypatch):
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    result = cli("rollout", "--model", chat_ckpt, "--prompts", bad, "--out", tmp_path / "r.jsonl")
    assert result.exit_code == 1 and "bad.parquet: not a readable parquet file" in result.stderr
    no_prompt = tmp_path / "no_prompt.parquet"
    pq.write_table(pa.table({"question": ["1+2"]}), no_prompt)
    result = cli("rollout", "--model", chat_ckpt, "--prompts", no_prompt, "--out", tmp_path / "r.jsonl")
    assert result.exit_code == 1 and "no_prompt.parquet:row 0: missing required field 'prompt'" in result.stderr
    images = tmp_path / "images.parquet"
    pq.write_table(pa.table({"prompt": ["1+2"], "images": [b"\x89PNG"]}), images)
    result = cli("rollout", "--model", chat_ckpt, "--prompts", images, "--out", tmp_path / "r.jsonl")
    assert result.exit_code == 1 and "column 'images' holds binary data" in result.stderr
    result = cli("rollout", "--model", chat_ckpt, "--prompts", tmp_path / "missing.parquet", "--out", tmp_path / "r")
    assert result.exit_code == 1 and "missing.parquet: no such file" in result.stderr
    import builtins

    real_import = builtins.__import__

    def no_pyarrow(name, *args, **kwargs):  # pyarrow absent: the error names the extra
        if name.startswith("pyarrow"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    result = cli("rollout", "--model", chat_ckpt, "--prompts", no_prompt, "--out", tmp_path / "r.jsonl")
    assert result.exit_code == 1 and "pip install 'rlx[parquet]'" in result.stderr
