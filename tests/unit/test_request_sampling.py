"""Per-request sampling through an engine stream: a request with its own temperature, top_p, top_k or seed gets
the tokens it gets alone in a stream started with those settings, whatever its neighbours ask."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlx.rollout.config import SamplingParams
from rlx.rollout.requests import TokenRequest
from rlx.rollout.sampling import batch_sampling, filter_logits, sample_next
from tests.agent_helpers import random_chat_model, token_engine

OWN = [  # (temperature, top_p, top_k, seed) of each request; None: the stream's
    (0.5, None, None, None),
    (1.7, None, None, 5),
    (None, 0.8, 4, None),
    (0.0, None, None, None),
    (None, None, None, None),
]


@pytest.mark.parametrize("name", ["hf", "native"])
def test_each_request_samples_as_it_would_alone_with_its_settings(name):
    model, tokenizer = random_chat_model(stop_bias=-10.0)  # never stops: every request runs to its limit
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("ab", "abc", "xyz!", "ba", "cab")]
    stream = SamplingParams(max_new_tokens=6, temperature=1.0, seed=2)
    requests = [
        TokenRequest(f"k{i}", ids, 6, temperature=t, top_p=p, top_k=k, seed=s)
        for i, (ids, (t, p, k, s)) in enumerate(zip(prompts, OWN))
    ]
    engine = token_engine(model, tokenizer, name)
    together = engine.generate_tokens(requests, stream)
    for request, got in zip(requests, together):
        own = request.sampling_of(stream)
        plain = dataclasses.replace(request, temperature=None, top_p=None, top_k=None, seed=None)
        alone = engine.generate_tokens([plain], own)[0]
        assert got.response_ids == alone.response_ids, request
        assert got.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    greedy = engine.generate_tokens([dataclasses.replace(requests[3], temperature=None, greedy=True)], stream)[0]
    assert together[3].response_ids == greedy.response_ids
    # the settings changed the draws: the cold and hot requests differ from the stream's own sampling of them
    for i in (0, 1):
        plain = dataclasses.replace(requests[i], temperature=None, seed=None)
        assert engine.generate_tokens([plain], stream)[0].logprobs != pytest.approx(together[i].logprobs, abs=1e-3)


def test_row_filters_equal_each_rows_scalar_filters():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    stream = SamplingParams(temperature=1.0)
    asked = ({"temperature": 0.3}, {"top_k": 5}, {"top_p": 0.6, "temperature": 2.0}, {"top_k": -1, "top_p": 0.9})
    rows = [dataclasses.replace(stream, **own) for own in asked]
    per_row = batch_sampling(rows, stream)
    assert isinstance(per_row.temperature, torch.Tensor)
    assert batch_sampling([stream, stream], stream).temperature == 1.0  # alike rows keep the scalar path
    uniforms = torch.rand(4, dtype=torch.float64)
    tokens, logprobs = sample_next(logits, uniforms, None, per_row.temperature, per_row.top_k, per_row.top_p)
    for i, r in enumerate(rows):
        one, lp = sample_next(logits[i : i + 1], uniforms[i : i + 1], None, r.train_temperature, r.top_k, r.top_p)
        assert int(tokens[i]) == int(one[0]) and float(logprobs[i]) == pytest.approx(float(lp[0]), abs=1e-6)
        scaled = logits[i : i + 1] / r.train_temperature
        kept = filter_logits(scaled, per_row.top_k[i : i + 1], per_row.top_p[i : i + 1]).isfinite()
        assert torch.equal(kept, filter_logits(scaled, max(r.top_k, 0), r.top_p).isfinite())
    with pytest.raises(ValueError, match="top_p 0 is out of range"):
        TokenRequest("k", [1], 1, top_p=0)
