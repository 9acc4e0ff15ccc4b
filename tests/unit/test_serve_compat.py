"""`rlx serve` where a client written for vLLM's OpenAI server expects vLLM's behaviour: a bad token id is that
request's 400 (the engine never sees it, the server keeps serving), a seed makes a reply reproducible on any sample,
clients that name no sample are answered side by side, ids and error types are OpenAI's, /health answers probes."""

from __future__ import annotations

import json
import re
import socket
import urllib.error
import urllib.request

import openai
import pytest

from rlx.rollout.agent_config import AgentConfig
from rlx.rollout.config import RolloutConfig, SamplingParams
from rlx.rollout.requests import TokenRequest
from rlx.serve.server import AgentServer
from rlx.serve.stream import StreamWorker
from tests.agent_helpers import bigram_chat_model, random_chat_model, token_engine
from tests.conftest import cli
from tests.unit.test_serve_endpoint import HI, SAMPLING, post, start, stop
from tests.unit.test_serve_stream import events


def get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_token_id_outside_the_vocabulary_is_refused_and_the_server_keeps_serving():
    server = start()
    url, vocab = f"{server.url}/v1", server.worker.vocab_size
    try:
        assert vocab > 0 and get(f"{server.url}/health") == 200
        for prompt in ([vocab], [5, -1]):
            status, reply = post(f"{url}/completions", {"prompt": prompt, "max_tokens": 2})
            assert status == 400 and reply["error"]["param"] == "prompt", reply
            assert "out of vocabulary" in reply["error"]["message"]
        status, reply = post(f"{server.url}/inference/v1/generate", {"token_ids": [3, vocab + 7]})
        assert status == 400 and f"token id {vocab + 7} is out of vocabulary" in reply["error"]["message"]
        # below the API, the worker fails such a request alone (inside the engine it would end the stream)
        bad = server.worker.submit(TokenRequest("bad", [1, vocab], 2))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            bad.result(timeout=60)
        status, reply = post(f"{url}/completions", {"prompt": [5, 6], "max_tokens": 2})
        assert status == 200 and reply["id"].startswith("cmpl-") and get(f"{server.url}/health") == 200
    finally:
        stop(server)


def test_an_engine_failure_is_logged_then_every_request_is_503_and_health_says_so(monkeypatch, capsys):
    model, tokenizer = random_chat_model()
    engine = token_engine(model, tokenizer)
    stream_class = type(engine.open_stream(SAMPLING.sampling, 64, 4))

    def broken(self):
        raise RuntimeError("the device fell over")

    monkeypatch.setattr(stream_class, "step", broken)
    worker = StreamWorker(engine, SAMPLING.sampling, 500)
    server = AgentServer(worker, tokenizer, engine.stop_ids, SAMPLING.sampling, AgentConfig()).start()
    try:
        status, reply = post(f"{server.url}/v1/chat/completions", {"messages": HI})
        assert status == 503 and reply["error"]["type"] == "server_error", reply
        status, reply = post(f"{server.url}/v1/chat/completions", {"messages": HI})
        assert status == 503 and "the engine failed (RuntimeError: the device fell over); restart" in str(reply)
        assert get(f"{server.url}/health") == 503
        assert "the device fell over" in capsys.readouterr().err  # the traceback is on the server's stderr
    finally:
        stop(server)


def test_a_seed_gives_the_same_reply_on_any_sample_and_unnamed_clients_are_answered_side_by_side():
    server = start()
    url = f"{server.url}/v1"
    body = {"messages": HI, "max_tokens": 6, "seed": 42, "return_token_ids": True}
    try:
        replies = [post(f"{url}/chat/completions", body, {"X-Session-ID": name})[1] for name in ("a", "b", "b")]
        replies.append(post(f"{url}/chat/completions", body)[1])
        assert len({tuple(r["choices"][0]["token_ids"]) for r in replies}) == 1, replies
        two = post(f"{url}/chat/completions", {**body, "n": 2})[1]["choices"]
        assert two[0]["token_ids"] == replies[0]["choices"][0]["token_ids"]  # choice 1 draws its own stream
        # a request naming no sample while 'default' answers another goes to the next free sample, not a 409
        busy = server.session("default")
        busy.lock.acquire()
        try:
            status, reply = post(f"{url}/chat/completions", {"messages": HI, "max_tokens": 2})
            assert status == 200 and reply["id"].startswith("chatcmpl-")
            assert server.sessions["default@2"].num_requests == 1
            status, reply = post(f"{url}/chat/completions", {"messages": HI}, {"X-Session-ID": "default"})
            assert status == 409  # a named sample still answers one request at a time
        finally:
            busy.lock.release()
    finally:
        stop(server)


def test_vllm_shaped_refusals_ids_and_fields():
    server = start(sampling=RolloutConfig(sampling=SamplingParams(max_new_tokens=400, temperature=1.0, seed=3)))
    url = f"{server.url}/v1"
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    try:
        assert client.models.list().data[0].created > 1_700_000_000
        # max_tokens the context has no room for: 400 naming the room, as vLLM answers (not cut silently)
        long = [{"role": "user", "content": "y" * 300}]
        with pytest.raises(openai.BadRequestError, match=r"exceed the limit of 500 tokens .*; ask at most \d+"):
            client.chat.completions.create(model="rlx", messages=long, max_tokens=300)
        for messages, param in (([{"role": "user"}], "messages[0].content"),
                                ([*HI, {"role": "assistant", "content": None}], "messages[1].content")):  # fmt: skip
            status, reply = post(f"{url}/chat/completions", {"messages": messages})
            assert status == 400 and reply["error"]["param"] == param, reply
        status, reply = post(f"{url}/responses", {"input": []})
        assert status == 400 and reply["error"]["param"] == "input"
        status, reply = post(f"{url}/responses", {"input": "hi", "max_output_tokens": 1})
        assert status == 200 and reply["output"][0]["status"] == reply["status"]  # a message cut at the limit is
        # 'incomplete' as its response is (or both 'completed' where the one token ended the turn)
        reply = client.completions.create(model="rlx", prompt="12+3=", max_tokens=6, logprobs=0, stop=["a", "b"])
        offsets, texts = reply.choices[0].logprobs.text_offset, reply.choices[0].logprobs.tokens
        assert offsets == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    finally:
        stop(server)


def test_the_command_refuses_bad_flags_before_loading_the_model(tmp_path):
    out = cli("serve", "--model", "nowhere", "--max-requests", "-1")
    assert out.exit_code == 1 and "--max-requests must be >= 0" in out.stderr
    with socket.create_server(("127.0.0.1", 0)) as taken:  # the port, before the model path is even read
        out = cli("serve", "--model", "nowhere", "--port", str(taken.getsockname()[1]))
        assert out.exit_code == 1 and re.search(r"cannot listen on 127\.0\.0\.1:\d+", out.stderr), out.stderr
    out = cli("serve", "--model", "nowhere", "--max-prompt-length", "10")  # a rollout's flag, not the server's
    assert out.exit_code == 2 and "No such option" in out.stderr


def test_stop_reason_names_the_stop_string_or_token_that_ended_a_choice_as_vllm_does():
    """vLLM's `stop_reason` in every choice: the stop string that ended it (the request's or the server's --stop), the
    stop token that did unless it is the tokenizer's EOS, else null (EOS, max_tokens). Streamed: a chat choice's with
    its finish_reason only, a completion choice's in every chunk (null until the last); the token-in/token-out route
    has it too."""
    model, tokenizer = bigram_chat_model("\nok</tool_response>")  # any other token is followed by EOS
    extra = tokenizer.convert_tokens_to_ids("</tool_response>")
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, extra]  # a second end token (Qwen's <|endoftext|>)
    server = start((model, tokenizer))
    stopping = start((model, tokenizer), RolloutConfig(sampling=SamplingParams(max_new_tokens=6, stop=["k"])))
    url = f"{server.url}/v1"
    try:
        assert extra in server.stop_ids and extra != tokenizer.eos_token_id
        for body, finish, reason in [
            ({"messages": HI}, "stop", extra),
            ({"messages": HI, "stop": ["k<", "k"]}, "stop", "k"),
            ({"messages": HI, "max_tokens": 1}, "length", None),
            ({"messages": [{"role": "user", "content": "x"}], "stop": ["x"]}, "stop", extra),
        ]:
            status, reply = post(f"{url}/chat/completions", body, {"X-Session-ID": json.dumps(body)})
            assert status == 200 and reply["choices"][0]["finish_reason"] == finish, reply
            assert reply["choices"][0]["stop_reason"] == reason, (body, reply)
        status, reply = post(f"{url}/completions", {"prompt": "x", "max_tokens": 3}, {"X-Session-ID": "c"})
        assert reply["choices"][0]["text"] == "" and reply["choices"][0]["stop_reason"] is None  # x: then EOS
        status, reply = post(f"{stopping.url}/v1/chat/completions", {"messages": HI})
        assert reply["choices"][0]["message"]["content"] == "o" and reply["choices"][0]["stop_reason"] == "k"
        status, reply = post(f"{server.url}/inference/v1/generate", {"token_ids": tokenizer("\n")["input_ids"]})
        assert reply["choices"][0]["stop_reason"] == extra, reply
        chat = [c["choices"][0] for c in events(f"{url}/chat/completions", {"messages": HI, "stream": True})[:-1]]
        assert [c.get("stop_reason", "absent") for c in chat] == ["absent"] * (len(chat) - 1) + [extra]
        text = [c["choices"][0] for c in events(f"{url}/completions", {"prompt": "\n", "stream": True})[:-1]]
        assert [c["stop_reason"] for c in text] == [None] * (len(text) - 1) + [extra] and len(text) > 1
    finally:
        stop(server)
        stop(stopping)


def test_prompt_token_ids_go_where_vllm_puts_them_and_echo_streams_through_the_openai_client():
    """return_token_ids: a completion's prompt ids are in each of its choices, a chat reply's beside its choices, as
    vLLM places them. echo streams (the openai client's pieces begin with the prompt's text; echo with logprobs:
    test_serve_prompt_logprobs.py)."""
    server = start()
    url = f"{server.url}/v1"
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    try:
        status, reply = post(f"{url}/completions", {"prompt": "12+3=", "n": 2, "return_token_ids": True})
        assert status == 200 and "prompt_token_ids" not in reply
        assert [c["prompt_token_ids"] for c in reply["choices"]] == [server.tokenizer("12+3=")["input_ids"]] * 2
        status, reply = post(f"{url}/chat/completions", {"messages": HI, "return_token_ids": True})
        assert reply["prompt_token_ids"] and "prompt_token_ids" not in reply["choices"][0]
        pieces = client.completions.create(model="rlx", prompt=[5, 6, 7], max_tokens=3, echo=True, stream=True)
        assert "".join(p.choices[0].text for p in pieces).startswith(server.tokenizer.decode([5, 6, 7]))
    finally:
        stop(server)
