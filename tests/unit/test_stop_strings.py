"""Stop strings (--stop / rollout.sampling.stop): every engine ends a response at the token that completes the first
stop string, finish_reason 'stop', the response text ends before the stop string; without it nothing changes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlx.formats.records import PromptRecord
from rlx.models.tiny import build_char_tokenizer, tiny_llama_config
from rlx.rollout.config import RolloutConfig, SamplingParams
from rlx.rollout.requests import Generated
from rlx.rollout.stops import StopStrings
from tests.conftest import cli_ok, generate, make_engine, read_jsonl, rollout_args

PROMPTS = [PromptRecord(id=f"p{i}", prompt=f"{i}+{i}=") for i in range(6)]


@pytest.fixture(scope="module")
def model_and_tokenizer():
    from transformers import AutoModelForCausalLM

    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_llama_config(len(tokenizer))), tokenizer


def test_cut_by_hand():
    tokenizer = build_char_tokenizer()
    ids = tokenizer("12+34=46", add_special_tokens=False)["input_ids"]
    stops = StopStrings(tokenizer, ("+3", "="))
    cut = stops.cut(Generated(ids, [float(i) for i in range(len(ids))], "length"))
    assert tokenizer.decode(cut.response_ids) == "12+3" and cut.logprobs == [0.0, 1.0, 2.0, 3.0]
    assert cut.finish_reason == "stop" and cut.stop_string == "+3"
    assert stops.cut(Generated(ids[:3], [0.0] * 3, "length")).finish_reason == "length"  # "12+": no stop yet
    assert stops.hit(ids[:4]) and not stops.hit(ids[:3])


@pytest.mark.parametrize("engine", ["hf", "native"])
def test_engines_stop_at_the_first_stop_string(model_and_tokenizer, engine):
    model, tokenizer = model_and_tokenizer
    plain = RolloutConfig(engine=engine, device="cpu", sampling=SamplingParams(n=3, max_new_tokens=12, seed=2))
    with_stop = dataclasses.replace(plain, sampling=dataclasses.replace(plain.sampling, stop=("1", "2")))
    free = generate(make_engine(model, tokenizer, plain), PROMPTS, plain)
    stopped = generate(make_engine(model, tokenizer, with_stop), PROMPTS, with_stop)
    hf = generate(make_engine(model, tokenizer, dataclasses.replace(with_stop, engine="hf")), PROMPTS, with_stop)
    assert [r.response_ids for r in stopped] == [r.response_ids for r in hf]  # every engine cuts alike
    assert sum(r.finish_reason == "stop" and r.response_ids[-1] not in (2,) for r in stopped) >= 3
    for a, b in zip(free, stopped):
        text = tokenizer.decode(a.response_ids, skip_special_tokens=True)
        hits = [text.find(s) for s in ("1", "2") if s in text]
        if not hits:  # never said: the same response as without stop strings
            assert b.response_ids == a.response_ids and b.finish_reason == a.finish_reason
            continue
        assert b.finish_reason == "stop" and b.response == text[: min(hits)]  # the text ends before it
        assert a.response_ids[: len(b.response_ids)] == b.response_ids  # a prefix of the free response
        assert torch.allclose(torch.tensor(b.rollout_logprobs), torch.tensor(a.rollout_logprobs[: len(b.response_ids)]))
        decoded = tokenizer.decode(b.response_ids, skip_special_tokens=True)
        assert decoded[-1] in "12" and "1" not in decoded[:-1] and "2" not in decoded[:-1]


def test_rollout_command_takes_stop(tmp_path, tiny_ckpt, prompts_file):
    out = tmp_path / "r.jsonl"
    cli_ok(*rollout_args(tiny_ckpt, prompts_file, out, "--max-new-tokens", "10", "--stop", "1", "--stop", "+"))
    for record in read_jsonl(out):
        assert "1" not in record["response"] and "+" not in record["response"]
