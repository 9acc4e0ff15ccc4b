"""[eval] inside an asynchronous rollout rank's open stream (rlx/ppo/async_eval.py): eval samples batched next
to training samples come out exactly as `evaluate` makes them alone, on the hf and native engines."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlx.checkpoints.loading import load_initial_policy
from rlx.evaluation.evaluate import EvalConfig, evaluate
from rlx.formats.records import read_prompts
from rlx.ppo.async_eval import StreamEval, is_eval_tag, shares_stream, stream_sampling
from rlx.rollout.agent_config import AgentConfig
from rlx.rollout.config import RolloutConfig, SamplingParams
from rlx.rollout.requests import build_requests, token_requests
from tests.conftest import REPO, make_engine

PROMPTS = REPO / "recipes" / "data" / "arith_quickstart.jsonl"


@pytest.fixture(scope="module")
def policy():
    """tiny-arith with every weight drawn at std 0.3 (its own init answers every prompt greedily alike)."""
    model, tokenizer, _ = load_initial_policy(str(REPO / "recipes" / "tiny-arith"), "random", 3)
    draws = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=draws) * 0.3)
    return model, tokenizer


def run_in_stream(engine, rollout: RolloutConfig, eval_cfg: EvalConfig, prompts, train_prompts):
    """The eval of `prompts` in a stream opened with the training's sampling, `train_prompts`' samples (another seed)
    submitted before and after it; returns the graded eval share and how many training samples came back."""
    train = dataclasses.replace(rollout.sampling, seed=11)
    tokens = [dataclasses.replace(t, seed=train.seed)
              for t in token_requests(build_requests(train_prompts, engine.encoder, train), train)]  # fmt: skip
    longest = (
        max(len(t.prompt_ids) for t in tokens)
        + max(rollout.sampling.max_new_tokens, eval_cfg.sampling.max_new_tokens)
        + 64
    )
    stream = engine.open_stream(stream_sampling(train, eval_cfg), longest, len(tokens) + 8)
    work = StreamEval(2, eval_cfg, engine, prompts, 0.0)
    half = len(tokens) // 2
    for i in range(half):
        stream.submit(("train", i), tokens[i])
    work.submit(stream)
    for i in range(half, len(tokens)):
        stream.submit(("train", i), tokens[i])
        work.overlap_samples += 1
    trained = 0
    try:
        while stream.has_work:
            for tag, generated in stream.step():
                if is_eval_tag(tag):
                    assert tag[1] == 2
                    work.take(tag[2], generated)
                else:
                    trained += 1
    finally:
        stream.close()
    assert work.is_done
    return work.finish(engine.tokenizer), trained


@pytest.mark.parametrize("engine_name", ["hf", "native"])
@pytest.mark.parametrize(
    ("eval_settings", "rollout_settings"),
    [
        ({"temperature": 0.0, "max_new_tokens": 6}, {"temperature": 1.0, "max_new_tokens": 4}),  # greedy, wider
        (
            {"temperature": 0.9, "top_k": 5, "n": 3, "max_new_tokens": 3},
            {"temperature": 0.9, "top_k": 5, "max_new_tokens": 7},
        ),
        ({"temperature": 0.9, "n": 2, "max_new_tokens": 9}, {"temperature": 0.9, "max_new_tokens": 5}),
    ],
)
def test_eval_in_the_stream_equals_the_eval_alone(policy, engine_name, eval_settings, rollout_settings):
    """Greedy eval (the argmax rows of a sampled stream), and sampled eval at the training's temperature with
    narrower and wider responses than the training's (its draws a prefix of the same per-sample streams): the
    graded samples equal `evaluate`'s on an engine of its own, tokens included."""
    model, tokenizer = policy
    prompts = read_prompts(PROMPTS)
    eval_cfg = EvalConfig(prompts=str(PROMPTS), reward=["arith"], sampling=SamplingParams(seed=5, **eval_settings))
    rollout = RolloutConfig(engine=engine_name, sampling=SamplingParams(n=4, **rollout_settings))
    assert shares_stream(eval_cfg, rollout)
    alone, _ = evaluate(eval_cfg, make_engine(model, tokenizer, rollout), prompts[:6])
    engine = make_engine(model, tokenizer, rollout)
    share, trained = run_in_stream(engine, rollout, eval_cfg, prompts[:6], prompts[6:12])
    assert trained == 6 * 4 and share.overlap_samples == 12
    assert share.samples == alone
    assert len({s.response for s in alone}) > 1  # the comparison is not of empty or identical answers


def test_which_evals_share_the_training_stream():
    """Greedy evals share it; a sampled eval only at the training's temperature, top_p and top_k; stop strings must be
    the training's; multi-turn runs keep the drain path."""
    rollout = RolloutConfig(sampling=SamplingParams(temperature=1.0, stop=["\n"]))
    assert shares_stream(EvalConfig(prompts="p", sampling=SamplingParams(stop=["\n"])), rollout)
    assert not shares_stream(EvalConfig(prompts="p"), rollout)  # different stop strings
    assert shares_stream(EvalConfig(prompts="p", sampling=SamplingParams(temperature=1.0, n=2, stop=["\n"])), rollout)
    assert not shares_stream(
        EvalConfig(prompts="p", sampling=SamplingParams(temperature=0.7, n=2, stop=["\n"])), rollout
    )
    assert not shares_stream(
        EvalConfig(prompts="p", sampling=SamplingParams(temperature=1.0, top_p=0.9, n=2, stop=["\n"])), rollout
    )
    greedy_rollout = RolloutConfig(sampling=SamplingParams(temperature=0.0))
    assert not shares_stream(EvalConfig(prompts="p", sampling=SamplingParams(temperature=1.0, n=2)), greedy_rollout)
    multi_turn = RolloutConfig(agent=AgentConfig(env="rlx.tasks.calculator:CalculatorEnv"))
    assert not shares_stream(EvalConfig(prompts="p"), multi_turn)
    base = dataclasses.replace(rollout.sampling, seed=1)
    assert (
        stream_sampling(base, EvalConfig(prompts="p", sampling=SamplingParams(max_new_tokens=1000))).max_new_tokens
        == 1000
    )
    assert stream_sampling(base, EvalConfig(prompts="p", sampling=SamplingParams(max_new_tokens=3))) == base
