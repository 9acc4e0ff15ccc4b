"""`rlx serve`'s prompt logprobs, as vLLM's OpenAI server gives them: a completion with `echo` and `logprobs` lists the
prompt's tokens first (the first one's logprob null) then the sampled ones, streamed too (in the first chunk); vLLM's
`prompt_logprobs` on chat and completions ({token id: {logprob, rank, decoded_token}} per prompt token, null for the
first); each equal to the served model scored teacher-forced by hand; an engine that cannot is refused by name; and the
keys vLLM's non-streamed replies always carry are there (null where rlx has nothing)."""

from __future__ import annotations

import copy

import httpx
import openai
import pytest
import torch

import rlx.logprobs
from rlx.rollout.config import SamplingParams
from rlx.serve.api import Limits, RequestError, read_chat, read_completion
from tests.agent_helpers import random_chat_model
from tests.unit.test_serve_endpoint import HI
from tests.unit.test_serve_stream import by_choice, events, joined_completion_logprobs, paced, serve, stop


def reference(model, ids: list[int], k: int, temperature: float = 1.0):
    """Each token's logprob (from the second) given those before it, its rank (1: the most likely) and the k most
    likely (id, logprob) there: one float32 forward of a copy of the served model."""
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float() / temperature, dim=-1)
    picked = logprobs.gather(-1, torch.tensor(ids[1:])[:, None])
    ranks = (logprobs >= picked).sum(-1).tolist()
    top = logprobs.topk(k, dim=-1)
    pairs = [list(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]
    return picked[:, 0].tolist(), ranks, pairs


@pytest.mark.parametrize("engine", ["hf", "native"])
def test_echo_with_logprobs_and_prompt_logprobs_are_the_prompt_scored_teacher_forced(engine, monkeypatch):
    """Completions: echo + logprobs k lists the prompt's tokens (their ids: the prompt's, as return_token_ids gives
    them) with the reference's logprobs (within 1e-5) and top k, then the sampled tokens as without echo; the
    choice's prompt_logprobs has the reference's logprob and rank of each token and its k alternatives; streamed, the
    first chunk lists the prompt's tokens and the chunks add up to the non-streamed reply. Chat: prompt_logprobs over
    the rendered context. The prompt's logprobs are under the request's temperature, as its sampled tokens' are."""
    model, tokenizer = random_chat_model(stop_bias=-10.0)  # every turn runs to max_tokens
    own = copy.deepcopy(model)  # the engine may lay the served model's weights out anew (native: merged projections)
    server = serve((model, tokenizer), engine)
    paced(server, monkeypatch)  # the stream cut where its tokens were sampled (native), whatever the machine's load
    url = f"{server.url}/v1"  # each request on a sample of its own: the same prompt there would continue the first
    body = {"prompt": "12+3=", "max_tokens": 4, "seed": 5, "logprobs": 2, "return_token_ids": True}
    try:
        echoed = httpx.post(f"{url}/completions", json={**body, "echo": True}, timeout=60).json()["choices"][0]
        plain = httpx.post(f"{server.url}/s/plain/v1/completions", json=body, timeout=60).json()["choices"][0]
        streamed = events(f"{server.url}/s/streamed/v1/completions", {**body, "echo": True, "stream": True})
        chat = httpx.post(f"{url}/chat/completions", json={"messages": HI, "max_tokens": 2, "prompt_logprobs": 0,
                                                            "return_token_ids": True}, timeout=60).json()  # fmt: skip
        cool_body = {**body, "prompt_logprobs": 0, "temperature": 0.5}
        cooler = httpx.post(f"{server.url}/s/cool/v1/completions", json=cool_body, timeout=60).json()
    finally:
        stop(server)
    ids = echoed["prompt_token_ids"]
    assert ids == tokenizer("12+3=")["input_ids"] and echoed["token_ids"] == plain["token_ids"]
    logprobs, ranks, top = reference(own, ids, 2)
    listed, num = echoed["logprobs"], len(ids)
    assert echoed["text"] == "12+3=" + plain["text"]
    assert listed["tokens"] == [tokenizer.decode([t]) for t in ids] + plain["logprobs"]["tokens"]
    assert listed["token_logprobs"][0] is None and listed["top_logprobs"][0] is None
    assert listed["token_logprobs"][1:num] == pytest.approx(logprobs, abs=1e-5)
    assert listed["token_logprobs"][num:] == plain["logprobs"]["token_logprobs"]
    for alternatives, expected in zip(listed["top_logprobs"][1:num], top):
        assert list(alternatives) == [tokenizer.decode([t]) for t, _ in expected]
        assert list(alternatives.values()) == pytest.approx([lp for _, lp in expected], abs=1e-5)
    assert listed["text_offset"] == [sum(len(t) for t in listed["tokens"][:i]) for i in range(len(listed["tokens"]))]
    # vLLM's prompt_logprobs on the choice: echo with logprobs k asks for them with k alternatives
    scored = echoed["prompt_logprobs"]
    assert len(scored) == num and scored[0] is None and plain["prompt_logprobs"] is None
    for i, entry in enumerate(scored[1:]):
        token = entry[str(ids[i + 1])]
        assert token["logprob"] == pytest.approx(logprobs[i], abs=1e-5) and token["rank"] == ranks[i]
        assert token["decoded_token"] == tokenizer.decode([ids[i + 1]])
        assert set(entry) == {str(ids[i + 1])} | {str(t) for t, _ in top[i]}  # the token and its 2 alternatives
    chunks = by_choice(streamed[:-1])[0]
    first = chunks[0]["logprobs"]  # the prompt's tokens, then the first sampled one's (a token a chunk)
    assert chunks[0]["text"].startswith("12+3=") and first["tokens"] == listed["tokens"][: num + 1]
    assert first["token_logprobs"][0] is None
    assert joined_completion_logprobs(chunks) == listed and "".join(c["text"] for c in chunks) == echoed["text"]
    # under the request's temperature, as its sampled tokens' logprobs are
    cool = [entry[str(t)]["logprob"] for entry, t in zip(cooler["choices"][0]["prompt_logprobs"][1:], ids[1:])]
    assert cool == pytest.approx(reference(own, ids, 1, temperature=0.5)[0], abs=1e-5)
    # chat: the whole rendered context scored, beside the choices; prompt_logprobs 0: each token alone
    context, scored = chat["prompt_token_ids"], chat["prompt_logprobs"]
    assert len(scored) == len(context) == chat["usage"]["prompt_tokens"] and scored[0] is None
    assert [list(entry) for entry in scored[1:]] == [[str(t)] for t in context[1:]]
    got = [entry[str(t)]["logprob"] for entry, t in zip(scored[1:], context[1:])]
    assert got == pytest.approx(reference(own, context, 1)[0], abs=1e-5)


def test_sequence_logprobs_match_the_reference_on_both_head_paths(monkeypatch):
    """rlx.logprobs.sequence_logprobs: the head on the hidden states a few positions at a time, or the model's own
    logits where its head is not a plain linear map, both equal the reference; one token has nothing to score."""
    model, _ = random_chat_model()
    ids = [1, 20, 7, 33, 5, 9, 14]
    logprobs, ranks, top = reference(model, ids, 3, temperature=0.7)
    for weight_of in (rlx.logprobs.lm_head_weight, lambda model: None):
        monkeypatch.setattr(rlx.logprobs, "lm_head_weight", weight_of)
        got = rlx.logprobs.sequence_logprobs(model, torch.tensor(ids), 0.7, 3, torch.float32, chunk=4)
        assert got[0].tolist() == pytest.approx(logprobs, abs=1e-5) and got[1].tolist() == ranks
        assert got[3].tolist() == [[t for t, _ in row] for row in top]
        torch.testing.assert_close(got[2], torch.tensor([[lp for _, lp in row] for row in top]), atol=1e-5, rtol=0)
    alone = rlx.logprobs.sequence_logprobs(model, torch.tensor([5]), 1.0, 2, torch.float32)
    assert [tuple(t.shape) for t in alone] == [(0,), (0,), (0, 2), (0, 2)]


def test_prompt_logprobs_refusals_name_the_field_and_the_engine():
    """More than 20 alternatives, a negative count (vLLM's -1: the whole vocabulary), prompt_logprobs in a stream (a
    chunk has no place for them, as on vLLM), and an engine that does not score prompts (vllm here): 400 naming the
    field (echo, for echo with logprobs) and the engine."""
    sampling = SamplingParams(max_new_tokens=8)
    able = Limits(sampling, "rlx", has_prompt_logprobs=True, engine="hf")
    unable = Limits(sampling, "rlx", has_prompt_logprobs=False, engine="vllm")
    for body, limits, param, words in [
        ({"prompt": "x", "prompt_logprobs": 21}, able, "prompt_logprobs", "at most 20"),
        ({"prompt": "x", "prompt_logprobs": -1}, able, "prompt_logprobs", ">= 0"),
        ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, able, "prompt_logprobs", "not with stream"),
        ({"prompt": "x", "prompt_logprobs": 1}, unable, "prompt_logprobs", r"engine \(vllm\)"),
        ({"prompt": "x", "echo": True, "logprobs": 0}, unable, "echo", r"engine \(vllm\)"),
        ({"messages": HI, "prompt_logprobs": 0}, unable, "prompt_logprobs", r"engine \(vllm\)"),
    ]:
        with pytest.raises(RequestError, match=words) as refused:
            (read_chat if "messages" in body else read_completion)(body, limits)
        assert refused.value.status == 400 and refused.value.param == param, body
    # echo with logprobs streams (the prompt's logprobs go in the first chunk); echo alone asks no scoring
    assert read_completion({"prompt": "x", "echo": True, "logprobs": 1, "stream": True}, able).settings.prompt_top == 1
    assert read_completion({"prompt": "x", "echo": True}, unable).settings.prompt_top is None


CHAT_KEYS = ["id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage",
             "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params", "ec_transfer_params",
             "metrics"]  # fmt: skip
"""vLLM's ChatCompletionResponse, serialized whole (non-streamed)."""
COMPLETION_KEYS = ["id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage",
                   "kv_transfer_params", "ec_transfer_params", "metrics"]  # fmt: skip


def test_non_streamed_replies_carry_every_key_vllms_do():
    """A client indexing what vLLM always sends (choice logprobs, stop_reason, a message's refusal and reasoning, the
    reply's system_fingerprint, prompt_logprobs, ...) finds it, null or empty where rlx has nothing; the openai client
    reads the reply."""
    server = serve(random_chat_model(), "hf")
    url = f"{server.url}/v1"
    try:
        chat = httpx.post(f"{url}/chat/completions", json={"messages": HI, "max_tokens": 2}, timeout=60).json()
        text = httpx.post(f"{url}/completions", json={"prompt": "1", "max_tokens": 2}, timeout=60).json()
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        parsed = client.chat.completions.create(model="rlx", messages=HI, max_tokens=2)
    finally:
        stop(server)
    assert list(chat) == CHAT_KEYS and list(text) == COMPLETION_KEYS
    [choice] = chat["choices"]
    assert list(choice) == ["index", "message", "logprobs", "finish_reason", "stop_reason", "token_ids",
                            "routed_experts"]  # fmt: skip
    assert choice["message"] == {
        "role": "assistant",
        "content": choice["message"]["content"],
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": None,
        "reasoning_content": None,
    }  # fmt: skip (no tool_calls: vLLM leaves an empty list out)
    assert chat["usage"]["prompt_tokens_details"] is None and chat["prompt_logprobs"] is None
    assert list(text["choices"][0]) == ["index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids",
                                        "prompt_logprobs", "prompt_token_ids", "routed_experts"]  # fmt: skip
    assert all(text["choices"][0][k] is None for k in ("logprobs", "token_ids", "prompt_logprobs", "prompt_token_ids"))
    assert parsed.choices[0].logprobs is None and parsed.choices[0].message.tool_calls is None
