"""`rlx serve`'s streams as vLLM's OpenAI server sends them: each chunk carries the logprobs and token ids of the
tokens that wrote its text (their concatenation is the non-streamed reply's), tool calls as a delta of id, type and
name then one of arguments, usage per chunk (continuous_usage_stats) and in a last chunk without choices, one id,
created and model in every chunk, stream_options the server cannot honour refused by name, failures mid-stream as an
error event before `[DONE]`."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
import pytest

from rlx.chat.tool_calls import call_id, parse_qwen
from rlx.rollout.agent_config import AgentConfig
from rlx.rollout.config import SamplingParams
from rlx.serve.deltas import covered, token_pieces
from rlx.serve.live import LiveReply
from rlx.serve.server import AgentServer
from rlx.serve.sessions import SampleSession
from rlx.serve.stream import StreamWorker
from rlx.serve.tool_stream import CallStream
from rlx.tasks.calculator import CALCULATOR_TOOL
from tests.agent_helpers import CALC_PIECES, CALC_SCRIPT, bigram_chat_model, random_chat_model, token_engine

HI = [{"role": "user", "content": "hi"}]
USAGE = {"include_usage": True, "continuous_usage_stats": True}


def serve(model_and_tokenizer, engine: str, max_new_tokens: int = 16) -> AgentServer:
    model, tokenizer = model_and_tokenizer
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=3)
    built = token_engine(model, tokenizer, engine, **({"kv_cache_gib": 0.01} if engine == "native" else {}))
    cfg = AgentConfig(max_total_tokens=500)
    worker = StreamWorker(built, sampling, cfg.max_total_tokens)
    return AgentServer(worker, tokenizer, built.stop_ids, sampling, cfg).start()


def paced(server: AgentServer, monkeypatch) -> list[dict]:
    """Keep `server`'s chat, completion and Responses streams in step with its engine: after handing a streamed reply
    a choice's tokens so far, the engine's worker waits (up to 10 s) until the reply has read them, so each update is
    read alone and a stream is cut where its tokens were sampled. Unpaced, a reply behind the engine (a loaded
    machine) reads several updates at once, as it should, and which chunks a stream is cut into depends on timing
    (`read_late`: all at once). Returns the chunks the replies made from updates (each before the engine's next step:
    while the turn was generated), as sent (a Responses stream's: each a list of its events)."""
    read, live = threading.Semaphore(0), []
    submit, next_chunks = server.worker.submit, LiveReply._next

    def submit_paced(request, on_tokens=None):
        def heard(sampled):
            on_tokens(sampled)
            read.acquire(timeout=10)

        return submit(request, heard if on_tokens is not None else None)

    async def next_paced(reply: LiveReply, index: int) -> list[dict]:
        if reply.server is not server:
            return await next_chunks(reply, index)
        try:
            chunks = await next_chunks(reply, index)
            live.extend(json.loads(json.dumps(chunk)) for chunk in chunks)
            return chunks
        finally:
            read.release()

    monkeypatch.setattr(server.worker, "submit", submit_paced)
    monkeypatch.setattr(LiveReply, "_next", next_paced)
    return live


def read_late(server: AgentServer, monkeypatch) -> None:
    """Make `server`'s chat and completion streams fall as far behind its engine as they can: a reply reads the
    tokens handed to it only once the engine has generated every turn submitted so far, so all of them in one update
    (the last before the turn finished)."""
    submitted, submit, next_chunks = [], server.worker.submit, LiveReply._next

    def submit_noted(request, on_tokens=None):
        submitted.append(submit(request, on_tokens))
        return submitted[-1]

    async def next_late(reply: LiveReply, index: int) -> list[dict]:
        if reply.server is server:
            await asyncio.wait([asyncio.wrap_future(f) for f in submitted])
        return await next_chunks(reply, index)

    monkeypatch.setattr(server.worker, "submit", submit_noted)
    monkeypatch.setattr(LiveReply, "_next", next_late)


def stop(*servers: AgentServer) -> None:
    for server in servers:
        server.close()
        server.worker.close()


def events(url: str, body: dict) -> list[dict | str]:
    """The server-sent events of a streamed request: each `data:` JSON object, and '[DONE]'."""
    with httpx.stream("POST", url, json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines]


def by_choice(chunks: list[dict]) -> dict[int, list[dict]]:
    choices: dict[int, list[dict]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            choices.setdefault(choice["index"], []).append(choice)
    return choices


def joined_completion_logprobs(choices: list[dict]) -> dict:
    joined = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for choice in choices:
        for key in joined:
            joined[key] += (choice["logprobs"] or {}).get(key) or []
    return joined


def check_stream_protocol(chunks: list, kind: str, plain: dict, continuous: bool) -> None:
    """One id, created and model in every chunk; with continuous usage each chunk's completion tokens are its
    choice's so far; a last chunk without choices has the non-streamed reply's usage; then [DONE]."""
    assert chunks[-1] == "[DONE]" and all(isinstance(c, dict) for c in chunks[:-1])
    chunks = chunks[:-1]
    assert {(c["id"], c["created"], c["model"], c["object"]) for c in chunks} == {
        (chunks[0]["id"], chunks[0]["created"], "rlx", kind)
    }
    assert chunks[0]["id"].startswith("chatcmpl-" if kind == "chat.completion.chunk" else "cmpl-")
    # vLLM's usage chunk leaves out the null fields its non-streamed usage has (prompt_tokens_details)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        k: v for k, v in plain["usage"].items() if v is not None
    }
    if continuous:
        sent: dict[int, int] = {}
        for chunk in chunks[:-1]:
            [choice] = chunk["choices"]
            sent[choice["index"]] = sent.get(choice["index"], 0) + len(choice.get("token_ids", []))
            assert chunk["usage"]["completion_tokens"] == sent[choice["index"]]
            assert chunk["usage"]["total_tokens"] == chunk["usage"]["prompt_tokens"] + sent[choice["index"]]


@pytest.mark.parametrize("engine", ["hf", "native"])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_each_chunk_carries_its_tokens_logprobs_and_they_add_up_to_the_non_streamed_ones(engine, endpoint):
    """Two choices, seeded, with alternatives and token ids: every chunk with text has the logprobs and ids of its
    own tokens (on the native engine, as they are sampled: several chunks a choice); per choice, their concatenation
    is the non-streamed reply's (a second server of the same model and seed), as are the text and the prompt's ids."""
    model = random_chat_model(stop_bias=-10.0)  # every turn runs to max_tokens
    servers = [serve(model, engine), serve(model, engine)]
    common = {"n": 2, "seed": 7, "max_tokens": 8, "return_token_ids": True}
    if endpoint == "chat":
        body, kind = {"messages": HI, "logprobs": True, "top_logprobs": 2, **common}, "chat.completion.chunk"
    else:
        body, kind = {"prompt": "12+3=", "logprobs": 2, **common}, "text_completion"
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    try:
        plain = httpx.post(servers[0].url + path, json=body, timeout=120).json()
        streamed = events(servers[1].url + path, {**body, "stream": True, "stream_options": USAGE})
    finally:
        stop(*servers)
    check_stream_protocol(streamed, kind, plain, continuous=True)
    for index, choices in by_choice(streamed[:-1]).items():
        expected = plain["choices"][index]
        assert [c["finish_reason"] for c in choices][-1] == expected["finish_reason"] == "length"
        assert [t for c in choices for t in c.get("token_ids", [])] == expected["token_ids"]
        with_text = [c for c in choices if (c["delta"].get("content") if endpoint == "chat" else c["text"])]
        assert all(c["logprobs"] and len(c["token_ids"]) >= 1 for c in with_text)
        if engine == "native":  # sampled live: the text came in several chunks, each with its tokens
            assert len(with_text) > 1
        if endpoint == "chat":
            assert choices[0]["delta"] == {"role": "assistant", "content": ""} and choices[0]["logprobs"] is None
            assert "".join(c["delta"].get("content") or "" for c in choices) == expected["message"]["content"]
            content = [e for c in choices for e in (c["logprobs"] or {}).get("content", [])]
            assert content == expected["logprobs"]["content"] and len(content) == 8
            assert all(len(e["top_logprobs"]) == 2 for e in content)
            prompt_ids = [c["prompt_token_ids"] for c in streamed[:-2]
                          if c["choices"][0]["index"] == index and "prompt_token_ids" in c]  # fmt: skip
        else:
            assert "".join(c["text"] for c in choices) == expected["text"]
            assert joined_completion_logprobs(choices) == expected["logprobs"]
            prompt_ids = [c["prompt_token_ids"] for c in choices if "prompt_token_ids" in c]
        # once, on the choice's first chunk; non-streamed, vLLM has a chat reply's beside its choices, a completion's in
        # each choice
        assert prompt_ids == [plain["prompt_token_ids"] if endpoint == "chat" else expected["prompt_token_ids"]]


@pytest.mark.parametrize("engine", ["hf", "native"])
def test_text_held_back_before_a_stop_string_sends_its_tokens_later_and_none_is_lost(engine):
    """A stop string inside a token: the text stops before it, the tokens up to the one completing it are the
    reply's (those past it are cut); the streamed chunks' logprobs and ids still add up to the non-streamed reply's,
    and tokens and text never disagree. Sent as sampled (native), a token goes with the chunk its whole text reached
    (the one completing the stop string: with the finish_reason); cut from the finished reply (hf), with the piece
    its text begins."""
    model = bigram_chat_model(CALC_SCRIPT, extra_tokens=CALC_PIECES)
    servers = [serve(model, engine), serve(model, engine)]
    body = {"messages": HI, "stop": ["calc"], "logprobs": True, "return_token_ids": True, "seed": 1}
    try:
        plain = httpx.post(f"{servers[0].url}/v1/chat/completions", json=body, timeout=120).json()
        streamed = events(f"{servers[1].url}/v1/chat/completions", {**body, "stream": True})
    finally:
        stop(*servers)
    expected, choices = plain["choices"][0], by_choice(streamed[:-1])[0]
    assert expected["message"]["content"].endswith('{"name": "') and expected["finish_reason"] == "stop"
    assert "".join(c["delta"].get("content") or "" for c in choices) == expected["message"]["content"]
    assert [t for c in choices for t in c.get("token_ids", [])] == expected["token_ids"]
    assert [e for c in choices for e in (c["logprobs"] or {}).get("content", [])] == expected["logprobs"]["content"]
    text, tokens = "", ""
    for choice in choices:  # so far, the tokens' texts and the content sent are one the other's start
        text += choice["delta"].get("content") or ""
        tokens += "".join(e["token"] for e in (choice["logprobs"] or {}).get("content", []))
        assert text.startswith(tokens) or tokens.startswith(text), (text, tokens)
    # sent as sampled, the tokens went with the text they wrote, all but the last (whose text is cut)
    before_finish = sum(len(c.get("token_ids", [])) for c in choices[:-1])
    assert before_finish == len(expected["token_ids"]) - (engine == "native")
    holder = choices[-1] if engine == "native" else next(c for c in choices if c["delta"].get("content") == '"')
    assert holder["logprobs"]["content"][-1]["token"] == '"calculator"'
    assert all(c["logprobs"] is None and c["token_ids"] == [] for c in choices[1:] if c is not holder and not
               c["delta"].get("content"))  # fmt: skip


@pytest.mark.parametrize("engine", ["hf", "native"])
def test_a_tool_call_streams_as_vllm_streams_it(engine, monkeypatch):
    """The role delta, then a delta of the call's index, id, type and name, then its arguments: in pieces as they are
    sampled on the native engine (a token a piece: `paced`; whole where the reply reads its tokens late), whole once
    the turn is generated on hf, adding up to the non-streamed arguments exactly; no content beside them; then the
    finish_reason 'tool_calls' and stop_reason null (the turn ended at the tokenizer's EOS). Each delta has the
    logprobs and ids of the tokens that wrote it (read late too: the name its own), and all of them add up to the
    non-streamed reply's; the openai client rebuilds the same call, with the id the record holds, so the conversation
    continued with it extends the same segment."""
    model = bigram_chat_model(CALC_SCRIPT, extra_tokens=CALC_PIECES)
    servers = [serve(model, engine), serve(model, engine)]
    live = paced(servers[1], monkeypatch)
    read_late(servers[0], monkeypatch)
    body = {"messages": HI, "tools": [CALCULATOR_TOOL], "logprobs": True, "return_token_ids": True}
    try:
        plain = httpx.post(f"{servers[0].url}/v1/chat/completions", json=body, timeout=120).json()
        late = events(f"{servers[0].url}/s/late/v1/chat/completions", {**body, "stream": True})
        streamed = events(f"{servers[1].url}/v1/chat/completions", {**body, "stream": True})
        client = openai.OpenAI(base_url=servers[1].base_url("sdk"), api_key="k", max_retries=0)
        with client.chat.completions.stream(model="rlx", messages=HI, tools=[CALCULATOR_TOOL]) as stream:
            final = stream.get_final_completion().choices[0]
        rebuilt = final.message.model_dump(include={"role", "content", "tool_calls"}, exclude_none=True)
        result = {"role": "tool", "tool_call_id": final.message.tool_calls[0].id, "content": "408"}
        client.chat.completions.create(model="rlx", messages=[*HI, rebuilt, result], tools=[CALCULATOR_TOOL])
    finally:
        stop(*servers)
    expected, choices = plain["choices"][0], by_choice(streamed[:-1])[0]
    [call] = expected["message"]["tool_calls"]
    assert expected["message"]["content"] is None and expected["finish_reason"] == "tool_calls"
    assert expected["stop_reason"] is None
    deltas = [c["delta"] for c in choices]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[-1] == {}
    [named] = deltas[1]["tool_calls"]
    assert named == {"index": 0, "id": named["id"], "type": "function", "function": {"name": "calculator"}}
    assert named["id"].startswith("call_") and named["id"] != call["id"]  # each server's own random ids
    pieces = [delta["tool_calls"] for delta in deltas[2:-1]]
    arguments = [piece[0]["function"]["arguments"] for piece in pieces]
    assert pieces == [[{"index": 0, "function": {"arguments": piece}}] for piece in arguments]
    assert "".join(arguments) == call["function"]["arguments"] == '{"expression": "12*34"}'
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["tool_calls"]
    assert "stop_reason" not in choices[-2] and choices[-1]["stop_reason"] is None  # vLLM's: with the finish_reason
    assert [t for c in choices for t in c.get("token_ids", [])] == expected["token_ids"]
    logprobs = [e for c in choices for e in (c["logprobs"] or {}).get("content", [])]
    assert logprobs == expected["logprobs"]["content"]
    late = by_choice(late[:-1])[0]  # the stream of a reply reading its tokens late: the same tokens
    assert [e for c in late for e in (c["logprobs"] or {}).get("content", [])] == logprobs
    if engine == "native":  # as sampled (paced): the name with the tokens that wrote it, then the arguments a token
        # at a time, each piece with its tokens, while the turn was generated; the call's end with the finish_reason
        assert [[e["token"] for e in c["logprobs"]["content"]] for c in choices[1:]] == [
            ["<tool_call>", '{"name": ', '"calculator"'], [', "arguments": ', '{"expression": '], ['"12*34"'], ["}}"],
            ["</tool_call>", "<|im_end|>"],
        ]  # fmt: skip
        assert arguments == ['{"expression": ', '"12*34"', "}"] and live[:4] == streamed[1:5]
        # read late, all at once (a reply behind the engine): the name still with its own tokens, the arguments whole
        assert [[e["token"] for e in c["logprobs"]["content"]] for c in late[1:]] == [
            ["<tool_call>", '{"name": ', '"calculator"'], [', "arguments": ', '{"expression": ', '"12*34"', "}}"],
            ["</tool_call>", "<|im_end|>"],
        ]  # fmt: skip
        assert late[2]["delta"]["tool_calls"][0]["function"]["arguments"] == call["function"]["arguments"]
    else:
        assert len(arguments) == 1 and choices[1]["token_ids"] == expected["token_ids"]
    assert final.finish_reason == "tool_calls" and final.message.tool_calls[0].function.name == "calculator"
    assert final.message.tool_calls[0].function.arguments == call["function"]["arguments"]
    session = servers[1].sessions["sdk"]
    assert final.message.tool_calls[0].id == session.segments[0].trajectory.messages[1]["tool_calls"][0]["id"]
    assert len(session.segments) == 1 and session.num_requests == 2  # the rebuilt call continued the segment


@pytest.mark.parametrize("engine", ["hf", "native"])
def test_echo_streams_the_prompt_first_then_the_completion(engine, monkeypatch):
    """A completion with echo streams as vLLM's: each choice's first chunk begins with the prompt's text (with the
    prompt's ids, and only the sampled ids as its `token_ids`), the pieces add up to the non-streamed text (the prompt,
    then the completion), a token a chunk (on the native engine as sampled: `paced`), and every chunk has a
    stop_reason (null until the choice's last)."""
    model = random_chat_model(stop_bias=-10.0)  # every turn runs to max_tokens
    servers = [serve(model, engine), serve(model, engine)]
    live = paced(servers[1], monkeypatch)
    body = {"prompt": "12+3=", "echo": True, "n": 2, "seed": 7, "max_tokens": 6, "return_token_ids": True}
    try:
        plain = httpx.post(servers[0].url + "/v1/completions", json=body, timeout=120).json()
        streamed = events(servers[1].url + "/v1/completions", {**body, "stream": True})
    finally:
        stop(*servers)
    for index, choices in by_choice(streamed[:-1]).items():
        expected = plain["choices"][index]
        assert expected["text"].startswith("12+3=") and len(expected["text"]) > len("12+3=")
        assert choices[0]["text"].startswith("12+3=") and not any(c["text"].startswith("12+3=") for c in choices[1:])
        assert "".join(c["text"] for c in choices) == expected["text"]
        # a token a chunk: on the native engine as sampled (paced), on hf cut where the tokens' texts end
        assert [c["token_ids"] for c in choices] == [[t] for t in expected["token_ids"]] + [[]]
        assert [c.get("prompt_token_ids") for c in choices] == [expected["prompt_token_ids"]] + [None] * (
            len(choices) - 1
        )
        assert [c["stop_reason"] for c in choices] == [None] * len(choices)  # cut at max_tokens: null throughout
        if engine == "native":  # the prompt went with the first token sampled, while the turn was generated
            assert by_choice(live)[index] == choices[:-2]  # all but the last token's (it ended the turn) and finish's


def test_tool_call_ids_are_the_records_and_a_call_the_turn_does_not_read_still_gives_its_text():
    """Streamed calls carry the id their turn's record gives them (under `rlx rollout --agent`, `call_<turn>_<i>`
    as an environment's rollout names them). A call whose block the turn does not finish (cut at max_tokens) was
    streamed as it was sampled, as vLLM streams it, and cannot be taken back: the reply then has the block's text as
    its content too, as the non-streamed reply has it (no tool calls there), and its finish_reason."""
    model = bigram_chat_model(CALC_SCRIPT, extra_tokens=CALC_PIECES)
    tokenizer, sampling = model[1], SamplingParams(max_new_tokens=16, temperature=1.0, seed=3)
    worker = StreamWorker(token_engine(*model, "native", kv_cache_gib=0.01), sampling, 500)
    strict = AgentServer(worker, tokenizer, worker.engine.stop_ids, sampling, AgentConfig(), strict=True).start()
    servers = [serve(model, "native"), serve(model, "native")]
    body = {"messages": HI, "tools": [CALCULATOR_TOOL], "max_tokens": 5}
    try:
        agent = by_choice(events(f"{strict.url}/v1/chat/completions", {**body, "max_tokens": 16, "stream": True})[:-1])
        plain = httpx.post(f"{servers[0].url}/v1/chat/completions", json=body, timeout=120).json()
        streamed = by_choice(events(f"{servers[1].url}/v1/chat/completions", {**body, "stream": True})[:-1])[0]
    finally:
        stop(strict, *servers)
    assert agent[0][1]["delta"]["tool_calls"][0]["id"] == "call_0_0"
    assert strict.sessions["default"].current.trajectory.messages[-1]["tool_calls"][0]["id"] == "call_0_0"
    message = plain["choices"][0]["message"]
    assert "tool_calls" not in message and plain["choices"][0]["finish_reason"] == "length"
    assert message["content"] == '<tool_call>{"name": "calculator", "arguments": {"expression": '
    deltas = [c["delta"] for c in streamed]
    assert deltas[1]["tool_calls"][0]["function"] == {"name": "calculator"}
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    assert streamed[-1]["finish_reason"] == plain["choices"][0]["finish_reason"] == "length"


def test_call_stream_pieces_add_up_to_the_finished_arguments():
    """Fed the text as it grows (here a character at a time), the pieces of each call's arguments are the parser's
    json.dumps of them exactly, whatever the sampled spacing, escapes (split anywhere, a surrogate pair included) and
    numbers, with the arguments before the name or other keys beside them; the name comes once known, first; a block
    that stops being a call's JSON stops the stream (nothing more is sent); a key given twice is sent twice (as
    sampled: the same object as the parser's)."""
    blocks = [
        '{"name":"f","arguments":{"a":1.50,"b" : [true,null, -0, 1E3],"s": "x\\u00e9\\n\\ud83d\\ude00\\"\\/é","c":{}}}',
        '{ "arguments" : {"k": "v"}, "id": 3, "name": "g" }',  # the arguments before the name: sent once it is known
        '{"name": "h", "arguments": "{\\"a\\": 1}"}',  # arguments as a string of JSON: read once finished
    ]
    text = "Sure. " + "".join(f"<tool_call>\n{block}\n</tool_call>" for block in blocks)
    calls = parse_qwen(text, 0).message["tool_calls"]
    stream, names, pieces = CallStream(), {}, {}
    for end in range(len(text) + 1):
        for delta in stream.feed(text[:end]):
            if delta.name is not None:
                assert delta.number not in names and delta.arguments == ""
                names[delta.number] = delta.name
                continue
            assert delta.number in names and delta.end <= end
            pieces.setdefault(delta.number, []).append(delta.arguments)
    assert names == {0: "f", 1: "g", 2: "h"} and not stream.is_stopped
    assert "".join(pieces[0]) == calls[0]["function"]["arguments"] and len(pieces[0]) > 10
    assert calls[0]["function"]["arguments"] == '{"a": 1.5, "b": [true, null, 0, 1000.0], "s": "xé\\n😀\\"/é", "c": {}}'
    assert pieces[1] == [calls[1]["function"]["arguments"]] and 2 not in pieces  # h's: once the turn is generated
    twice = '<tool_call>{"name": "f", "arguments": {"a": 1, "b": 2, "a": 3}}</tool_call>'
    [call] = parse_qwen(twice, 0).message["tool_calls"]
    stream = CallStream()
    sent = "".join(d.arguments for end in range(len(twice) + 1) for d in stream.feed(twice[:end]))
    assert sent == '{"a": 1, "b": 2, "a": 3}' and json.loads(sent) == json.loads(call["function"]["arguments"])
    broken = CallStream()
    assert [d.name for d in broken.feed('<tool_call>{"name": "f", "arguments": {"a": 1')] == ["f", None]
    assert broken.feed('<tool_call>{"name": "f", "arguments": {"a": 1 2}') == [] and broken.is_stopped


def test_a_call_after_a_malformed_one_has_the_id_it_was_streamed_under():
    """A call's id counts every block of its turn, read or not: a block the parser cannot read (here one of JSON but
    not a call's shape, which the stream reads past) does not shift the id of a readable call after it from the one
    its stream sent (`call_<turn>_<number>`, as under `rlx rollout --agent`)."""
    good = '<tool_call>\n{"name": "g", "arguments": {"x": 1}}\n</tool_call>'
    for bad in ('{"tool": "f"}', '{"name": "f", "arguments": [1]}'):
        text = f"<tool_call>\n{bad}\n</tool_call>\n{good}"
        named = [d for d in CallStream().feed(text) if d.name == "g"]
        parsed = parse_qwen(text, 2)
        assert len(parsed.errors) == 1 and [c["function"]["name"] for c in parsed.message["tool_calls"]] == ["g"]
        assert len(named) == 1 and parsed.message["tool_calls"][0]["id"] == call_id(2, named[0].number) == "call_2_1"


def test_stream_options_are_honoured_or_refused_by_name():
    """include_usage and continuous_usage_stats (vLLM's) are honoured; another option, a value that is not a
    boolean, continuous stats without include_usage (vLLM would send none) or options without stream: 400 naming
    the option."""
    server = serve(random_chat_model(), "hf", max_new_tokens=4)
    url = f"{server.url}/v1/chat/completions"
    try:
        for options, param in [
            ({"include_usage": True, "include_obfuscation": True}, "stream_options.include_obfuscation"),
            ({"include_usage": "yes"}, "stream_options.include_usage"),
            ({"continuous_usage_stats": True}, "stream_options.continuous_usage_stats"),
            ([True], "stream_options"),
        ]:
            reply = httpx.post(url, json={"messages": HI, "stream": True, "stream_options": options}, timeout=60)
            assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
        reply = httpx.post(url, json={"messages": HI, "stream_options": {"include_usage": True}}, timeout=60)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "stream_options"
        assert httpx.post(url, json={"messages": HI, "stream_options": {}}, timeout=60).status_code == 200
        chunks = events(url, {"messages": HI, "stream": True, "stream_options": {"include_usage": True}})
        assert all("usage" not in c for c in chunks[:-2]) and chunks[-2]["choices"] == []  # usage only at the end
        completion = events(f"{server.url}/v1/completions", {"prompt": "1", "stream": True, "stream_options": USAGE})
        assert all("usage" in c for c in completion[:-1]) and completion[-2]["choices"] == []
    finally:
        stop(server)


def test_a_failure_mid_stream_is_an_error_event_before_done(monkeypatch, capsys):
    """A turn that fails after its stream began: one `data: {"error": ...}` event naming the failure, then
    `[DONE]`; the openai client raises it, the traceback is on the server's stderr, and the server keeps serving; an
    engine failure mid-stream is told in the engine's words (503's code)."""
    server = serve(random_chat_model(), "hf", max_new_tokens=4)
    url = f"{server.url}/v1/chat/completions"
    real = SampleSession.commit

    def failing(self, *args, **kwargs):
        if self.sample_id.startswith("bad"):
            raise RuntimeError("the record could not be written")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(SampleSession, "commit", failing)
    try:
        chunks = events(f"{server.url}/s/bad/v1/chat/completions", {"messages": HI, "stream": True})
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""} and chunks[-1] == "[DONE]"
        error = chunks[-2]["error"]
        assert error["type"] == "server_error" and "RuntimeError: the record could not be written" in error["message"]
        client = openai.OpenAI(base_url=server.base_url("bad2"), api_key="k", max_retries=0)
        with pytest.raises(openai.APIError, match="the record could not be written"):
            list(client.chat.completions.create(model="rlx", messages=HI, stream=True))
        assert "Traceback" in capsys.readouterr().err
        assert httpx.post(url, json={"messages": HI}, timeout=60).status_code == 200
        # the engine itself failing mid-stream: its own words, as every later request then hears them (503)
        monkeypatch.setattr(type(server.worker.engine.open_stream(server.sampling, 64, 1)), "step", broken)
        chunks = events(f"{server.url}/s/engine/v1/completions", {"prompt": "1", "stream": True})
        error = chunks[-2]["error"]
        assert chunks[-1] == "[DONE]" and error["code"] == "service_unavailable"
        assert "the engine failed (RuntimeError: the device fell over); restart the server" in error["message"]
        assert httpx.post(url, json={"messages": HI}, timeout=60).status_code == 503
    finally:
        stop(server)


def broken(self):
    raise RuntimeError("the device fell over")


def test_covered_tokens_and_token_pieces():
    """Which tokens a sent text was written with: a character cut across tokens belongs with the token completing it;
    a finished content cut where its tokens' texts end (a token of no text goes with the next piece)."""
    pieces = [b"a", b"\xc3", b"\xa9", b"b", b"!"]  # "aéb!" with é split over two tokens

    def decode(ids: list[int]) -> str:
        return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

    ids = list(range(5))
    assert covered(decode, ids, 0, "a") == 1  # the first byte of é alone wrote nothing sent
    assert covered(decode, ids, 1, "aé") == 3 and covered(decode, ids, 0, "aéb!") == 5
    assert covered(decode, ids, 3, "aéb") == 4 and covered(decode, ids, 0, "") == 0
    assert token_pieces("ab c", ["a", "", "b", " c", "<|im_end|>"]) == [("a", 0, 1), ("b", 1, 3), (" c", 3, 4)]
    assert token_pieces("ab", ["a", "b "]) == [("a", 0, 1), ("b", 1, 2)]  # the content is the texts' start
    assert token_pieces("b", ["\n", "b"]) is None  # stripped: the texts do not begin it
