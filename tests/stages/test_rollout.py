"""`rlx rollout` (hf engine): contract, reproducibility, sampling filters, logprobs, EOS, chat templates."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from rlx.rollout.sampling import draw_tokens, filter_logits, sample_uniforms
from tests.conftest import cli_ok, read_jsonl, rollout_args, run_script, write_jsonl

ROLLOUT_FIELDS = {
    "format_version",
    "id",
    "prompt_id",
    "sample_index",
    "prompt",
    "response",
    "prompt_ids",
    "response_ids",
    "rollout_logprobs",
    "finish_reason",
    "temperature",
    "data_source",
    "ground_truth",
}


def test_writes_the_contract(tmp_path, tiny_ckpt, prompts_file):
    out = tmp_path / "r.jsonl"
    cli_ok(*rollout_args(tiny_ckpt, prompts_file, out))
    records = read_jsonl(out)
    assert len(records) == 16
    prompts = read_jsonl(prompts_file)[:4]
    for i, rec in enumerate(records):
        assert set(rec) >= ROLLOUT_FIELDS
        assert rec["prompt_id"] == prompts[i // 4]["id"] and rec["sample_index"] == i % 4
        assert rec["id"] == f"{rec['prompt_id']}/{rec['sample_index']}"
        assert len(rec["rollout_logprobs"]) == len(rec["response_ids"]) <= 3
        assert all(lp <= 0 for lp in rec["rollout_logprobs"])
        if rec["finish_reason"] == "stop":
            assert rec["response_ids"][-1] == 2  # <eos> kept as the last trained token
        else:
            assert 2 not in rec["response_ids"] and len(rec["response_ids"]) == 3


def test_same_seed_same_file_other_seed_other_file(tmp_path, tiny_ckpt, prompts_file):
    paths = [tmp_path / f"{name}.jsonl" for name in ("a", "b", "c")]
    cli_ok(*rollout_args(tiny_ckpt, prompts_file, paths[0], "--seed", "5", "--max-new-tokens", "6"))
    cli_ok(*rollout_args(tiny_ckpt, prompts_file, paths[1], "--seed", "5", "--max-new-tokens", "6"))
    cli_ok(*rollout_args(tiny_ckpt, prompts_file, paths[2], "--seed", "6", "--max-new-tokens", "6"))
    assert paths[0].read_bytes() == paths[1].read_bytes()
    assert paths[0].read_bytes() != paths[2].read_bytes()


def test_samples_do_not_depend_on_batching(tmp_path, tiny_ckpt, prompts_file):
    """Each sample draws from its own stream: batch size and the prompt window do not change it."""
    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    cli_ok(*rollout_args(tiny_ckpt, prompts_file, a, "--batch-size", "64", "--num-prompts", "6"))
    cli_ok(*rollout_args(tiny_ckpt, prompts_file, b, "--batch-size", "3", "--num-prompts", "6"))
    cli_ok(*rollout_args(tiny_ckpt, prompts_file, c, "--num-prompts", "2", "--data-position", "4"))
    ra, rb, rc = read_jsonl(a), read_jsonl(b), read_jsonl(c)
    assert [r["response_ids"] for r in ra] == [r["response_ids"] for r in rb]
    for x, y in zip(ra, rb):
        assert max(abs(p - q) for p, q in zip(x["rollout_logprobs"], y["rollout_logprobs"])) < 1e-5
    assert [r["response_ids"] for r in ra[16:]] == [r["response_ids"] for r in rc]


def test_logprobs_match_a_full_forward(tmp_path, tiny_ckpt, prompts_file):
    """The sampler's logprobs equal log_softmax(logits / T) of a plain forward over prompt + response."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "r.jsonl"
    cli_ok(*rollout_args(tiny_ckpt, prompts_file, out, "--temperature", "0.7", "--max-new-tokens", "5"))
    model = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32)
    for rec in read_jsonl(out):
        ids = torch.tensor([rec["prompt_ids"] + rec["response_ids"]])
        with torch.no_grad():
            logits = model(ids).logits[0, len(rec["prompt_ids"]) - 1 : -1].float() / 0.7
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(rec["response_ids"])[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(rec["rollout_logprobs"]), expected, atol=1e-5), rec["id"]


def test_greedy_equals_transformers_generate(tmp_path, tiny_ckpt, prompts_file):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "r.jsonl"
    cli_ok(*rollout_args(tiny_ckpt, prompts_file, out, "--temperature", "0", "--n", "1", "--max-new-tokens", "8"))
    model = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32)
    for rec in read_jsonl(out):
        ids = torch.tensor([rec["prompt_ids"]])
        expected = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=2, pad_token_id=0)
        expected = expected[0, ids.shape[1] :].tolist()
        if 2 in expected:
            expected = expected[: expected.index(2) + 1]
        assert rec["response_ids"] == expected


def test_stdin_and_stdout(tmp_path, tiny_ckpt, prompts_file):
    result = cli_ok(
        "rollout",
        "--model",
        tiny_ckpt,
        "--prompts",
        "-",
        "--out",
        "-",
        "--n",
        "2",
        "--max-new-tokens",
        "2",
        input=prompts_file.read_text().splitlines()[0] + "\n",
    )
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith('{"format_version":1') for line in lines)


def test_chat_template_applied_when_the_tokenizer_has_one(tmp_path, tiny_dir):
    import shutil

    from rlx.models.loading import ModelSource, load_tokenizer

    chat_dir = tmp_path / "chat"
    shutil.copytree(tiny_dir, chat_dir)
    tok = load_tokenizer(ModelSource(chat_dir))
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}={% endfor %}{% if add_generation_prompt %} {% endif %}"
    )
    tok.save_pretrained(chat_dir)
    ckpt = tmp_path / "ckpt"
    cli_ok("shard", "--model", chat_dir, "--init", "random", "--out", ckpt)
    prompts = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"id": "text", "prompt": "1+2"},
            {"id": "chat", "prompt": [{"role": "user", "content": "1+2"}]},
        ],
    )
    out = tmp_path / "r.jsonl"
    cli_ok("rollout", "--model", ckpt, "--prompts", prompts, "--out", out, "--max-new-tokens", "2")
    text, chat = read_jsonl(out)
    assert text["prompt_ids"] == chat["prompt_ids"] == tok("1+2= ", add_special_tokens=False)["input_ids"]
    cli_ok(
        "rollout",
        "--model",
        ckpt,
        "--prompts",
        prompts,
        "--out",
        out,
        "--max-new-tokens",
        "2",
        "--chat-template",
        "off",
        "--num-prompts",
        "1",
        "--overwrite",
    )
    assert read_jsonl(out)[0]["prompt_ids"] == tok("1+2")["input_ids"]


def test_top_k_and_top_p_filtering():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(logits, 2, 1.0)).tolist() == [[False, False, True, True]]
    # top-p 0.75: 0.5 < 0.75 so the second token joins (0.8 >= 0.75); the rest are cut
    assert torch.isinf(filter_logits(logits, 0, 0.75)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, 0, 0.5)).tolist() == [[False, True, True, True]]
    assert torch.isinf(filter_logits(logits, 0, 0.81)).tolist() == [[False, False, False, True]]


def test_inverse_cdf_draws_follow_the_distribution():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    logits = torch.log(probs).expand(4, -1)
    assert draw_tokens(logits, torch.tensor([0.0, 0.099, 0.1, 0.95], dtype=torch.float64)).tolist() == [0, 0, 2, 3]
    u = sample_uniforms(0, [f"p/{i}" for i in range(20000)], 1)[:, 0]
    counts = torch.bincount(draw_tokens(torch.log(probs).expand(len(u), -1), u), minlength=4).float() / len(u)
    assert counts[1] == 0 and torch.allclose(counts, probs, atol=0.015)
    assert torch.equal(sample_uniforms(3, ["a/0"], 5), sample_uniforms(3, ["b/1", "a/0"], 5)[1:])


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_triton_draw_in_the_interpreter():
    """The GPU's two draw kernels (rlx/kernels/sampling.py), run by Triton's interpreter on the CPU: the float64
    reference's tokens, the first argmax and the log-normaliser, on rows with filtered slices, one token left, a
    repeated max and the mass at a slice boundary."""
    out = run_script(Path(__file__).parent / "workers" / "triton_draw_check.py", {"TRITON_INTERPRET": "1"})
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
