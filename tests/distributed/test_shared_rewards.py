"""Per-sample CPU work done once over ranks that hold the same records (gloo, 2 ranks): rewards computed in shares
equal one process's, each reward function call happens once per sample, a failing sample stops every rank with
the same error, and each rank decodes only its own generated responses yet every rank gets one process's records."""

from __future__ import annotations

import pickle
import textwrap
from pathlib import Path

import pytest
import torch

from tests.conftest import cli_ok, read_jsonl, rollout_args, run_torchrun, save_tiny_hf, torchrun, write_jsonl

WORKER = Path(__file__).parent / "workers" / "shared_rewards.py"


def write_reward_fn(folder: Path) -> None:
    """A reward function that logs each call (pid, sample id) and fails on sample p2/1: NaN ('zero': a counted
    error) or an exception ('raise')."""
    (folder / "reward_fn.py").write_text(
        textwrap.dedent(f"""
        import math, os

        def score(data_source, solution_str, ground_truth, extra_info):
            with open({str(folder / "calls.log")!r}, "a") as log:
                log.write(f"{{os.getpid()}} {{extra_info['id']}}\\n")
            if extra_info["id"] == "p2/1":
                if os.path.exists({str(folder / "raise")!r}):
                    raise ValueError("no answer in the response")
                return math.nan
            return {{"score": len(solution_str) / 4, "length": len(solution_str)}}
        """)
    )


def test_rewards_shared_over_two_ranks_equal_one_process_and_run_once_per_sample(tmp_path):
    from rlx.scoring.config import ScoreConfig
    from rlx.scoring.score import compute_rewards

    write_reward_fn(tmp_path)
    run_torchrun(2, WORKER, "rewards", tmp_path, timeout=300)
    records, shared = pickle.loads((tmp_path / "rewards.pkl").read_bytes())
    calls = [line.split() for line in (tmp_path / "calls.log").read_text().splitlines()]
    assert sorted(sample for _, sample in calls) == sorted(r.id for r in records)  # each sample once, over the ranks
    assert len({pid for pid, _ in calls}) == 2  # both ranks did a share
    cfg = ScoreConfig(
        reward=[f"{tmp_path / 'reward_fn.py'}:score"], on_reward_error="zero", max_reward_error_fraction=0.5
    )
    alone = compute_rewards(records, cfg)
    assert torch.equal(shared.scores, alone.scores) and torch.equal(shared.task_scores, alone.task_scores)
    assert shared.details == alone.details and shared.errors == alone.errors
    assert shared.errors[5] is not None and shared.errors.count(None) == 6  # p2/1, rank 1's share, in its place
    assert shared.details[4] == {"score": {"score": 1.0, "length": 4}}


def test_a_failing_reward_stops_both_ranks_with_the_same_error(tmp_path):
    write_reward_fn(tmp_path)
    (tmp_path / "raise").write_text("")
    out = run_torchrun(2, WORKER, "raise", tmp_path, timeout=120, check=False)  # a rank left waiting: a timeout
    assert out.returncode != 0
    line = (
        "rlx test: error: sample 'p2/1': reward function 'score' raised ValueError: no answer in the response "
        "(pass --on-reward-error zero to score such samples 0 and count them)"
    )
    assert out.stderr.count(line + "\n") == 2, out.stderr[-3000:]  # rank 0 stops too, though its share scored
    assert not (tmp_path / "rewards.pkl").exists()


def test_generate_on_two_ranks_gives_one_process_records(tmp_path):
    """Each rank cuts at stop strings and decodes its own share only; every rank's records equal one process's."""
    from transformers import AutoModelForCausalLM

    from rlx.models.tiny import build_char_tokenizer
    from rlx.parallel.dist import DistContext
    from rlx.rollout.base import build_engine
    from rlx.rollout.config import RolloutConfig, SamplingParams
    from tests.distributed.workers.shared_rewards import PROMPTS, SAMPLING, counting_decodes

    model_dir = save_tiny_hf(tmp_path / "model")
    run_torchrun(2, WORKER, "generate", tmp_path, model_dir, timeout=300)
    two = pickle.loads((tmp_path / "records.pkl").read_bytes())
    model = AutoModelForCausalLM.from_pretrained(model_dir).requires_grad_(False)
    tokenizer = counting_decodes(build_char_tokenizer())
    engine = build_engine(RolloutConfig(), model, tokenizer, DistContext())
    one = engine.generate(PROMPTS, SamplingParams(**SAMPLING), progress=False).records
    # the same tokens and text; logprobs to float rounding (a rank's smaller batch may sum in another order on CPU)
    assert [{**r.to_json(), "rollout_logprobs": None} for r in two] == [
        {**r.to_json(), "rollout_logprobs": None} for r in one
    ]
    for a, b in zip(two, one, strict=True):
        assert a.rollout_logprobs == pytest.approx(b.rollout_logprobs, abs=1e-5), a.id
    # each response decoded (stop strings checked, text made) on one rank only: the ranks' decodes add up to one
    # process's, not twice as many
    assert sum(int((tmp_path / f"decodes{rank}").read_text()) for rank in (0, 1)) == tokenizer.num_decodes
    cut = [r for r in one if tokenizer.decode(r.response_ids).endswith("5") and "5" not in r.response]
    assert cut and all(r.finish_reason == "stop" for r in cut)  # the stop string ended some responses


def test_score_on_two_ranks_shares_the_reward_model(tmp_path, tiny_ckpt, prompts_file):
    """`rlx score` under torchrun: each rank runs the reward model (a plain module on every rank) on its share; the
    scores are one process's per-sample forwards."""
    from transformers import AutoModelForSequenceClassification

    from rlx.models.tiny import build_char_tokenizer, tiny_llama_config

    tokenizer = build_char_tokenizer()
    config = tiny_llama_config(len(tokenizer))
    config.num_labels, config.architectures = 1, ["LlamaForSequenceClassification"]
    torch.manual_seed(3)
    rm = AutoModelForSequenceClassification.from_config(config).eval()
    rm.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    rollouts = tmp_path / "rollouts.jsonl"
    cli_ok(*rollout_args(tiny_ckpt, prompts_file, rollouts, "--max-new-tokens", "4", "--num-prompts", "3"))
    args = ["--actor", tiny_ckpt, "--reward", "arith=0.5", "--reward-model", tmp_path / "rm", "--micro-batch-size", "2"]
    torchrun(2, "score", "--rollouts", rollouts, "--out", tmp_path / "s2", *args)
    scores = read_jsonl(tmp_path / "s2" / "scores.jsonl")
    assert len(scores) == len(read_jsonl(rollouts)) > 2
    for record, score in zip(read_jsonl(rollouts), scores):
        with torch.no_grad():
            expected = rm(torch.tensor([tokenizer(record["prompt"] + record["response"])["input_ids"]])).logits
        assert abs(score["rewards"]["reward_model"]["score"] - expected[0, 0].item()) < 1e-5
        assert abs(score["reward"] - (0.5 * score["rewards"]["arith"]["score"] + expected[0, 0].item())) < 1e-5


def test_eval_on_two_ranks_grades_in_shares_and_equals_one_process(tmp_path, tiny_ckpt, prompts_file):
    """`rlx eval` under torchrun: every rank holds the answers and grades a share; rank 0 writes one process's file."""
    prompts = write_jsonl(tmp_path / "p.jsonl", read_jsonl(prompts_file)[:5])
    args = ["--model", tiny_ckpt, "--prompts", prompts, "--reward", "arith", "--max-new-tokens", "3"]
    cli_ok("eval", *args, "--out", tmp_path / "one")
    torchrun(2, "eval", *args, "--out", tmp_path / "two")
    one, two = read_jsonl(tmp_path / "one" / "eval.jsonl"), read_jsonl(tmp_path / "two" / "eval.jsonl")
    assert len(one) == 5 and one == two
