"""`rlx eval`: pass@k / mean@n math by hand, the command end to end on the tiny model (greedy == greedy rollout,
sampled pass@k recomputed from eval.jsonl, per data_source metrics), --help and bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rlx.evaluation.evaluate import EvalSample, eval_metrics, group_metrics, k_values, pass_at_k
from rlx.scoring.rules import arith
from tests.conftest import cli, cli_ok, read_jsonl, write_jsonl


def test_pass_at_k_by_hand():
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(8, 3, 4) == pytest.approx(1 - math.comb(5, 4) / math.comb(8, 4))
    assert pass_at_k(4, 3, 2) == 1.0  # fewer wrong samples than k: some pick is always right
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 4, 1) == 1.0 and pass_at_k(1, 1, 1) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)
    assert (
        k_values(1) == [1] and k_values(4) == [1, 2, 4] and k_values(6) == [1, 2, 4, 6] and k_values(8) == [1, 2, 4, 8]
    )


def test_group_metrics_by_hand():
    rewards = {"a": [1.0, 0.0, 0.5], "b": [0.0, 0.0, 0.0]}
    correct = {"a": [True, False, False], "b": [False, False, False]}
    m = group_metrics(rewards, correct, "val/")
    assert m["val/reward_mean"] == pytest.approx(1.5 / 6)
    assert m["val/mean@3"] == pytest.approx((0.5 + 0.0) / 2)
    assert m["val/pass@1"] == pytest.approx((1 / 3 + 0) / 2)
    assert m["val/pass@2"] == pytest.approx((1 - 1 / 3 + 0) / 2)  # a: 1 - C(2,2)/C(3,2)
    assert m["val/pass@3"] == pytest.approx(0.5) and m["val/num_prompts"] == 2.0
    assert set(m) == {"val/reward_mean", "val/mean@3", "val/num_prompts", "val/pass@1", "val/pass@2", "val/pass@3"}
    with pytest.raises(ValueError, match="same number of samples"):
        group_metrics({"a": [1.0], "b": [1.0, 0.0]}, {"a": [True], "b": [True, False]}, "val/")


def sample(pid, index, source, reward, correct, length=3) -> EvalSample:
    return EvalSample(id=f"{pid}/{index}", prompt_id=pid, sample_index=index, data_source=source, prompt="p",
                      response="r", ground_truth=None, reward=reward, is_correct=correct, rewards={},
                      response_length=length, finish_reason="stop")  # fmt: skip


def test_metrics_per_data_source_when_there_are_several():
    samples = [sample("a", 0, "arith", 1.0, True, 2), sample("b", 0, "gsm8k", 0.0, False, 4)]
    m = eval_metrics(samples)
    assert m["val/reward_mean"] == 0.5 and m["val/pass@1"] == 0.5 and m["val/response_length_mean"] == 3.0
    assert m["val/arith/pass@1"] == 1.0 and m["val/gsm8k/pass@1"] == 0.0 and m["val/gsm8k/reward_mean"] == 0.0
    assert not any(k.startswith("val/arith") for k in eval_metrics(samples[:1]))  # one source: no breakdown


def test_greedy_eval_end_to_end(tmp_path, tiny_ckpt, prompts_file):
    out, metrics = tmp_path / "eval", tmp_path / "m.jsonl"
    prompts = write_jsonl(tmp_path / "p.jsonl", read_jsonl(prompts_file)[:12])
    result = cli_ok("eval", "--model", tiny_ckpt, "--prompts", prompts, "--reward", "arith", "--out", out,
                    "--max-new-tokens", "3", "--metrics", metrics)  # fmt: skip
    samples = read_jsonl(out / "eval.jsonl")
    assert len(samples) == 12 and "pass@1" in result.stderr
    for s, p in zip(samples, read_jsonl(prompts)):
        assert (s["id"], s["prompt_id"], s["sample_index"]) == (f"{p['id']}/0", p["id"], 0)
        assert s["reward"] == arith("arith", s["response"], p["ground_truth"])["score"]
        assert s["is_correct"] == (s["reward"] >= 1.0) and s["rewards"]["arith"]["score"] == s["reward"]
        assert s["ground_truth"] == p["ground_truth"] and s["data_source"] == "arith"
    # greedy evaluation answers exactly as a greedy rollout
    cli_ok("rollout", "--model", tiny_ckpt, "--prompts", prompts, "--out", tmp_path / "r.jsonl", "--temperature", "0",
           "--max-new-tokens", "3")  # fmt: skip
    assert [s["response"] for s in samples] == [r["response"] for r in read_jsonl(tmp_path / "r.jsonl")]
    (line,) = read_jsonl(metrics)
    accuracy = sum(s["is_correct"] for s in samples) / 12
    assert line["step"] == 0 and line["val/pass@1"] == pytest.approx(accuracy)
    assert line["val/reward_mean"] == pytest.approx(sum(s["reward"] for s in samples) / 12)
    assert line["val/mean@1"] == pytest.approx(line["val/reward_mean"]) and line["val/num_prompts"] == 12


REWARD = """
def score(data_source, solution_str, ground_truth, extra_info=None):
    return {'score': float(solution_str.count('1') % 2), 'seen': solution_str}
"""


def test_sampled_eval_pass_at_k_from_the_file(tmp_path, tiny_ckpt, prompts_file):
    records = read_jsonl(prompts_file)[:6]
    for i, r in enumerate(records):
        r["data_source"] = ["arith", "other"][i % 2]
    prompts = write_jsonl(tmp_path / "p.jsonl", records)
    reward = tmp_path / "parity.py"
    reward.write_text(REWARD)
    out, metrics = tmp_path / "eval", tmp_path / "m.jsonl"
    args = ["eval", "--model", tiny_ckpt, "--prompts", prompts, "--reward", f"{reward}:score", "--out", out]
    args += ["--n", "4", "--temperature", "1.0", "--max-new-tokens", "4", "--seed", "3", "--metrics", metrics]
    cli_ok(*args)
    samples = read_jsonl(out / "eval.jsonl")
    assert len(samples) == 24 and all(s["rewards"]["score"]["seen"] == s["response"] for s in samples)
    line = read_jsonl(metrics)[0]
    for prefix, keep in (("val/", lambda s: True), ("val/other/", lambda s: s["data_source"] == "other")):
        part = [s for s in samples if keep(s)]
        counts = {}
        for s in part:
            counts.setdefault(s["prompt_id"], []).append(s["is_correct"])
        for k in (1, 2, 4):
            expected = sum(1 - math.comb(4 - sum(c), k) / math.comb(4, k) for c in counts.values()) / len(counts)
            assert line[f"{prefix}pass@{k}"] == pytest.approx(expected), (prefix, k)
        assert line[f"{prefix}mean@4"] == pytest.approx(sum(s["reward"] for s in part) / len(part))
    assert 0 < line["val/pass@1"] < line["val/pass@4"] <= 1  # a random model: some right, not all
    cli_ok(*args, "--overwrite")  # same seed, same file
    assert read_jsonl(out / "eval.jsonl") == samples


def test_bad_input(tmp_path, tiny_ckpt, prompts_file):
    base = ["eval", "--model", tiny_ckpt, "--prompts", prompts_file, "--reward", "arith", "--max-new-tokens", "2"]
    result = cli(*base, "--out", tmp_path / "e", "--n", "4")
    assert result.exit_code == 1 and "--n: n = 4 greedy responses would all be the same" in result.stderr
    result = cli(*base, "--out", tmp_path / "e", "--top-p", "0")
    assert result.exit_code == 1 and "--top-p" in result.stderr
    result = cli(*base, "--out", tmp_path / "e", "--engine", "nope")
    assert result.exit_code == 1 and "--engine" in result.stderr
    result = cli("eval", "--model", tiny_ckpt, "--prompts", tmp_path / "missing.jsonl", "--out", tmp_path / "e")
    assert result.exit_code == 1 and "missing.jsonl: no such file" in result.stderr
    result = cli("eval", "--model", tmp_path / "no-model", "--prompts", prompts_file, "--out", tmp_path / "e")
    assert result.exit_code == 1 and "no-model" in result.stderr
    result = cli(*base[:-4], "--reward", "no_such_reward", "--out", tmp_path / "e", "--max-new-tokens", "1")
    assert result.exit_code == 1 and "no_such_reward" in result.stderr
    (tmp_path / "file").write_text("x")
    result = cli(*base, "--out", tmp_path / "file")
    assert result.exit_code == 1 and "is a file" in result.stderr
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "eval.jsonl").write_text("{}\n")
    result = cli(*base, "--out", tmp_path / "done")
    assert result.exit_code == 1 and "already exists" in result.stderr and "Traceback" not in result.stderr
    assert json.loads((tmp_path / "done" / "eval.jsonl").read_text()) == {}


def save_model_that_answers_token_5(out, eos_ids: list[int], **sampling):
    """A tiny untied Llama whose greedy answer to any prompt is token 5 (every weight 0 but the final norm, the last
    MLP's output bias along dimension 0 and lm_head row 5 there), saved with a generation_config.json naming
    `eos_ids` as its EOS tokens while config.json names one (2), as Llama 3 and Qwen2.5 instruct models ship, and
    the `sampling` settings given (do_sample, temperature, ...)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from rlx.models.tiny import build_char_tokenizer, tiny_llama_config

    tokenizer = build_char_tokenizer()
    config = tiny_llama_config(len(tokenizer))
    config.tie_word_embeddings, config.mlp_bias = False, True
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.model.norm.weight.fill_(1.0)
        model.model.layers[-1].mlp.down_proj.bias[0] = 1.0
        model.lm_head.weight[5, 0] = 1.0
    model.generation_config = GenerationConfig(bos_token_id=1, pad_token_id=0, eos_token_id=eos_ids, **sampling)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.parametrize("layout", ["single", "fsdp", "lora"])
def test_eval_stops_at_the_eos_ids_of_generation_config_in_every_layout(tmp_path, prompts_file, layout):
    """generation_config.json's EOS list ends responses whether the model is the HF dir or a checkpoint of any
    layout (those built from config.json alone stopped at its one EOS id and ran on to --max-new-tokens)."""
    hf = save_model_that_answers_token_5(tmp_path / "hf", [2, 5])
    cli_ok("shard", "--model", hf, "--out", tmp_path / "ckpt", "--layout", layout)
    prompts = write_jsonl(tmp_path / "p.jsonl", read_jsonl(prompts_file)[:3])
    for name, model in (("hf", hf), ("ckpt", tmp_path / "ckpt")):
        cli_ok("eval", "--model", model, "--prompts", prompts, "--reward", "arith", "--out", tmp_path / f"eval_{name}",
               "--max-new-tokens", "4")  # fmt: skip
        samples = read_jsonl(tmp_path / f"eval_{name}" / "eval.jsonl")
        assert [(s["finish_reason"], s["response_length"]) for s in samples] == [("stop", 1)] * 3, name


def test_a_random_start_keeps_the_eos_ids_of_generation_config(tmp_path):
    """`rlx ppo` / `rlx sft` with init 'random' on a model dir stop their rollouts where the dir's model stops."""
    from rlx.checkpoints.loading import load_initial_policy
    from rlx.rollout.prompts import stop_token_ids

    hf = save_model_that_answers_token_5(tmp_path / "hf", [2, 5])
    model, tokenizer, _ = load_initial_policy(str(hf), "random", seed=0)
    assert stop_token_ids(model, tokenizer) == {2, 5}


def test_eval_says_where_it_departs_from_the_sampling_of_generation_config(tmp_path, prompts_file):
    """A model whose generation_config.json samples (temperature 0.7, top_p 0.8, top_k 20, as Qwen2.5 instruct ships)
    is evaluated greedily, or with only the options given: one line says so rather than overruling it silently."""
    hf = save_model_that_answers_token_5(tmp_path / "hf", [2], do_sample=True, temperature=0.7, top_p=0.8, top_k=20)
    prompts = write_jsonl(tmp_path / "p.jsonl", read_jsonl(prompts_file)[:2])
    base = ["eval", "--model", hf, "--prompts", prompts, "--reward", "arith", "--max-new-tokens", "2"]
    greedy = cli_ok(*base, "--out", tmp_path / "greedy").stderr
    assert "generation_config.json samples (temperature 0.7, top_p 0.8, top_k 20)" in greedy
    assert "decodes greedily" in greedy
    sampled = cli_ok(*base, "--out", tmp_path / "sampled", "--n", "2", "--temperature", "0.7").stderr
    assert "sampling with top_p 1.0, top_k 0 where the model's generation_config.json gives top_p 0.8, top_k 20" in (
        sampled
    )
    matched = ["--n", "2", "--temperature", "0.7", "--top-p", "0.8", "--top-k", "20"]
    assert "generation_config" not in cli_ok(*base, "--out", tmp_path / "matched", *matched).stderr
    plain = save_model_that_answers_token_5(tmp_path / "plain", [2])  # no sampling settings: nothing to say
    assert "generation_config" not in cli_ok(*base[:2], plain, *base[3:], "--out", tmp_path / "plain_eval").stderr
