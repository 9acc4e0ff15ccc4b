"""The tokenizer fingerprint: every rollout record and batch carries it, and `rlx score` / `rlx train-step` refuse
token ids of another tokenizer (even one whose ids all fit the model's vocabulary); files without it still load."""

from __future__ import annotations

import pytest

from rlx.formats.batch import TrainBatch
from rlx.models.fingerprint import tokenizer_fingerprint
from rlx.models.loading import ModelSource, load_tokenizer
from rlx.models.tiny import ARITH_CHARS, build_char_tokenizer, write_tiny_model_dir
from tests.conftest import cli, cli_ok, read_jsonl, rollout_args, write_jsonl


@pytest.fixture(scope="module")
def other_ckpt(tmp_path_factory):
    """A tiny model whose tokenizer maps the same characters to other ids (the same vocabulary size)."""
    folder = tmp_path_factory.mktemp("other")
    write_tiny_model_dir(folder / "model", chars=ARITH_CHARS[::-1])
    cli_ok("shard", "--model", folder / "model", "--init", "random", "--out", folder / "ckpt")
    return folder / "ckpt"


def test_fingerprint_is_stable_and_tells_tokenizers_apart(tmp_path):
    tokenizer = build_char_tokenizer()
    tokenizer.save_pretrained(tmp_path / "saved")
    reloaded = load_tokenizer(ModelSource(tmp_path / "saved"))
    assert tokenizer_fingerprint(tokenizer) == tokenizer_fingerprint(reloaded)
    assert tokenizer_fingerprint(tokenizer).startswith("tok-") and len(tokenizer_fingerprint(tokenizer)) == 20
    assert tokenizer_fingerprint(build_char_tokenizer(ARITH_CHARS[::-1])) != tokenizer_fingerprint(tokenizer)
    reloaded.chat_template = "{{ messages[0]['content'] }}"  # the same ids, another way to render chats
    assert tokenizer_fingerprint(reloaded) != tokenizer_fingerprint(tokenizer)


def test_score_and_train_step_refuse_another_tokenizer(tmp_path, tiny_ckpt, other_ckpt, prompts_file):
    rollouts = tmp_path / "r.jsonl"
    cli_ok(*rollout_args(tiny_ckpt, prompts_file, rollouts))
    ours = tokenizer_fingerprint(load_tokenizer(ModelSource(tiny_ckpt)))
    theirs = tokenizer_fingerprint(load_tokenizer(ModelSource(other_ckpt)))
    assert {r["tokenizer"] for r in read_jsonl(rollouts)} == {ours} != {theirs}
    score = ["score", "--rollouts", rollouts, "--reward", "arith"]
    result = cli(*score, "--actor", other_ckpt, "--out", tmp_path / "s_other")
    assert result.exit_code == 1 and ours in result.stderr and theirs in result.stderr, result
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "s_other" / "scores.jsonl").exists()

    cli_ok(*score, "--actor", tiny_ckpt, "--out", tmp_path / "s")
    batch = tmp_path / "s" / "batch.safetensors"
    assert TrainBatch.load(batch).meta.tokenizer == ours
    result = cli("train-step", "--checkpoint", other_ckpt, "--batch", batch, "--out", tmp_path / "next")
    assert result.exit_code == 1 and ours in result.stderr and theirs in result.stderr, result
    assert not (tmp_path / "next").exists()

    old = [{k: v for k, v in r.items() if k != "tokenizer"} for r in read_jsonl(rollouts)]  # an older rlx's lines
    write_jsonl(tmp_path / "old.jsonl", old)
    cli_ok("score", "--rollouts", tmp_path / "old.jsonl", "--reward", "arith", "--actor", other_ckpt,
           "--out", tmp_path / "s_old")  # fmt: skip
    assert TrainBatch.load(tmp_path / "s_old" / "batch.safetensors").meta.tokenizer == theirs


def test_a_tokenizer_transformers_rebuilds_for_the_model_type_is_warned_about(tmp_path, capsys):
    """transformers 5 loads a character (WordLevel) tokenizer.json in a `qwen2` folder as Qwen2's byte-level BPE,
    which drops the letters and spaces: the load says so (once per file); a llama folder loads the file as it is."""
    import json

    from transformers import Qwen2Config

    qwen2, llama = tmp_path / "qwen2", write_tiny_model_dir(tmp_path / "llama")
    build_char_tokenizer().save_pretrained(qwen2)
    Qwen2Config(vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=1).save_pretrained(qwen2)
    assert json.loads((qwen2 / "tokenizer.json").read_text())["model"]["type"] == "WordLevel"
    rebuilt = load_tokenizer(ModelSource(qwen2))
    assert len(rebuilt("1 + 2")["input_ids"]) < len(build_char_tokenizer()("1 + 2")["input_ids"])  # spaces dropped
    load_tokenizer(ModelSource(qwen2))
    load_tokenizer(ModelSource(llama))
    err = capsys.readouterr().err
    assert err.count("holds a WordLevel tokenizer, but transformers loads it as Qwen2Tokenizer (BPE)") == 1, err
    assert str(llama) not in err
