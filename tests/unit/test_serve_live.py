"""Agent clients end to end: replies streamed as the engine samples them (native engine), vLLM's token-in/token-out
route as verifiers' trainer calls it, and the text pieces a stream may send (never one the finished turn takes back).
"""

from __future__ import annotations

import json
import math
import sys
import threading

import httpx
import openai
import pytest

from rlx.rollout.agent_config import AgentConfig
from rlx.rollout.config import SamplingParams
from rlx.rollout.requests import Generated, TokenRequest
from rlx.serve.deltas import TOOL_CALL_OPEN, TextDeltas
from rlx.serve.responses import output_events
from rlx.serve.server import AgentServer
from rlx.serve.stream import StreamWorker
from rlx.tasks.calculator import CALCULATOR_TOOL
from tests.agent_helpers import CALC_PIECES, CALC_SCRIPT, bigram_chat_model, random_chat_model, token_engine
from tests.unit.test_serve_endpoint import post, start
from tests.unit.test_serve_stream import paced, serve, stop

SAMPLING = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3)


def _native_server(model, tokenizer) -> AgentServer:
    engine = token_engine(model, tokenizer, "native", kv_cache_gib=0.01)
    cfg = AgentConfig(max_total_tokens=500)
    worker = StreamWorker(engine, SAMPLING, cfg.max_total_tokens)
    return AgentServer(worker, tokenizer, engine.stop_ids, SAMPLING, cfg).start()


def _held_after_three_decode_steps(server: AgentServer):
    """(release, hook handle): the server's engine waits after its prefill and 3 decode steps until `release` is set
    (or 120 s), so a test can see what a client got while the turn is unfinished."""
    release, forwards = threading.Event(), [0]

    def hold(module, inputs, output):
        forwards[0] += 1
        if forwards[0] == 4:
            release.wait(timeout=120)

    return release, server.worker.engine._runner.model.get_input_embeddings().register_forward_hook(hold)


def _stop(server: AgentServer) -> None:
    server.close()
    server.worker.close()


def test_text_deltas_never_send_what_the_finished_turn_takes_back():
    stops = TextDeltas(("STOP",), hold_whitespace=False)
    assert [stops.feed(t) for t in ("ab", "ab S", "ab STO", "ab STOP and more")] == ["ab", " ", "", ""]
    assert stops.is_closed and stops.finish("ab ") == ""
    tools = TextDeltas((TOOL_CALL_OPEN,), hold_whitespace=True)
    assert [tools.feed(t) for t in ("Hi", "Hi ", "Hi <tool", "Hi <tool_call>{")] == ["Hi", "", "", ""]
    assert tools.finish("Hi") == ""  # the content once the call is parsed out: stripped
    assert TextDeltas((TOOL_CALL_OPEN,), True).feed("\nHi") == ""  # stripped or not depends on later calls
    utf8 = TextDeltas((), hold_whitespace=False)
    assert utf8.feed("caf\ufffd") == "caf" and utf8.feed("café") == "é" and utf8.finish("café!") == "!"


def test_worker_hands_each_request_its_tokens_as_they_are_sampled():
    model, tokenizer = random_chat_model(stop_bias=-10.0)
    engine = token_engine(model, tokenizer, "native", kv_cache_gib=0.01)
    worker = StreamWorker(engine, SAMPLING, 200)
    heard: list[tuple[Generated, bool]] = []
    try:
        request = TokenRequest("s/0", tokenizer("hello")["input_ids"], 8)
        future = None

        def on_tokens(sampled: Generated) -> None:
            heard.append((sampled, future is not None and future.done()))

        future = worker.submit(request, on_tokens)
        generated = future.result(timeout=120)
    finally:
        worker.close()
    assert len(generated.response_ids) == 8
    assert len(heard) >= 2  # several updates before the turn finished
    for sampled, done in heard:  # each a start of the finished turn, its logprobs those the turn keeps
        size = len(sampled.response_ids)
        assert sampled.response_ids == generated.response_ids[:size] and not done
        assert sampled.logprobs == generated.logprobs[:size]
    assert [len(s.response_ids) for s, _ in heard] == sorted({len(s.response_ids) for s, _ in heard})


def test_openai_stream_arrives_while_the_turn_is_generated_and_is_recorded_token_exactly():
    """The engine is held after a few decode steps: the openai client's first content chunk arrives while the turn
    is unfinished and unrecorded; the pieces add up to the recorded reply, usage and token ids match the record."""
    model, tokenizer = random_chat_model(stop_bias=-10.0)  # runs to max_tokens
    server = _native_server(model, tokenizer)
    release, handle = _held_after_three_decode_steps(server)
    try:
        client = openai.OpenAI(base_url=server.base_url("live/0"), api_key="k", max_retries=0)
        stream = client.chat.completions.create(
            model="rlx", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=10, logprobs=True,
            tool_choice="none", stream_options={"include_usage": True}, extra_body={"return_token_ids": True},
        )  # fmt: skip
        pieces, usage, last, ids, logprobs = [], None, None, [], []
        for chunk in stream:
            if chunk.choices:  # each chunk's own tokens
                ids += chunk.choices[0].model_extra.get("token_ids") or []
                own = chunk.choices[0].logprobs
                logprobs += [t.logprob for t in own.content] if own else []
            if chunk.choices and chunk.choices[0].delta.content:
                if not pieces:  # the turn is still being generated: nothing recorded yet
                    assert not release.is_set() and server.sessions["live/0"].num_requests == 0
                    release.set()
                pieces.append(chunk.choices[0].delta.content)
            if chunk.choices and chunk.choices[0].finish_reason:
                last = chunk.choices[0]
            usage = chunk.usage or usage
    finally:
        release.set()
        handle.remove()
        _stop(server)
    session = server.sessions["live/0"]
    trajectory = session.current.trajectory
    assert len(pieces) > 1 and "".join(pieces) == trajectory.messages[-1]["content"]
    assert usage.completion_tokens == len(trajectory.response_ids) == 10
    assert ids == trajectory.response_ids[-10:] and logprobs == pytest.approx(trajectory.rollout_logprobs[-10:])
    assert last.finish_reason == "length"


def test_responses_stream_arrives_while_the_turn_is_generated():
    """/v1/responses with stream: the first text delta arrives while the turn is unfinished and unrecorded; the
    openai SDK's stream helper rebuilds the response from the events, its text is the recorded reply, and it is kept
    for previous_response_id."""
    model, tokenizer = random_chat_model(stop_bias=-10.0)  # runs to max_output_tokens
    server = _native_server(model, tokenizer)
    release, handle = _held_after_three_decode_steps(server)
    try:
        client = openai.OpenAI(base_url=server.base_url("resp/0"), api_key="k", max_retries=0)
        kinds, pieces = [], []
        with client.responses.stream(model="rlx", input="hi", max_output_tokens=10) as stream:
            for event in stream:
                kinds.append(event.type)
                if event.type == "response.output_text.delta":
                    if not pieces:  # the turn is still being generated: nothing recorded yet
                        assert not release.is_set() and server.sessions["resp/0"].num_requests == 0
                        release.set()
                    pieces.append(event.delta)
        final = [e for e in [event] if e.type in ("response.completed", "response.incomplete")][0].response
        follow = client.responses.create(model="rlx", input="more", previous_response_id=final.id, max_output_tokens=2)
    finally:
        release.set()
        handle.remove()
        _stop(server)
    session = server.sessions["resp/0"]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-1] == "response.incomplete" and len(pieces) > 1
    assert "".join(pieces) == final.output[0].content[0].text == session.current.trajectory.messages[1]["content"]
    assert final.usage.output_tokens == 10 and follow.status == "incomplete"
    assert len(session.segments) == 1 and session.current.trajectory.num_turns == 2  # continued the same sample


def test_a_responses_function_call_streams_its_arguments_as_sampled(monkeypatch):
    """/v1/responses with stream and a function tool (native engine): the call's item (name, call_id, no arguments),
    its arguments in pieces as they are sampled (a token a piece: `paced`, made while the turn was generated), their
    done event and the item's, numbered in order; the pieces add up to the done arguments and the non-streamed
    response's exactly, and the SDK's stream helper rebuilds the call with the id the record holds."""
    model = bigram_chat_model(CALC_SCRIPT, extra_tokens=CALC_PIECES)
    servers = [serve(model, "native"), serve(model, "native")]
    live = paced(servers[1], monkeypatch)
    tool = {"type": "function", **CALCULATOR_TOOL["function"]}
    body = {"model": "rlx", "input": "hi", "tools": [tool]}
    try:
        plain = post(f"{servers[0].url}/v1/responses", body)[1]
        with httpx.stream("POST", f"{servers[1].url}/v1/responses", json={**body, "stream": True}) as response:
            sent = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
        client = openai.OpenAI(base_url=servers[1].base_url("sdk"), api_key="k", max_retries=0)
        with client.responses.stream(**body) as stream:
            final = stream.get_final_response()
    finally:
        stop(*servers)
    [expected] = plain["output"]
    assert expected["type"] == "function_call" and expected["arguments"] == '{"expression": "12*34"}'
    kinds = [event["type"] for event in sent]
    deltas = [event for event in sent if event["type"] == "response.function_call_arguments.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     *[d["type"] for d in deltas], "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]  # fmt: skip
    assert [event["sequence_number"] for event in sent] == list(range(len(sent)))
    added, done, finished = sent[2]["item"], sent[-3], sent[-1]["response"]["output"]
    assert added == {**finished[0], "arguments": "", "status": "in_progress"} and added["name"] == "calculator"
    assert all(d["item_id"] == added["id"] == done["item_id"] and d["output_index"] == 0 for d in deltas)
    arguments = "".join(d["delta"] for d in deltas)
    assert arguments == done["arguments"] == finished[0]["arguments"] == expected["arguments"]
    # sent as sampled, before the turn was finished (in both streams: this one, the SDK's)
    made = [e[1]["delta"] for chunk in live for e in chunk if e[0] == "response.function_call_arguments.delta"]
    assert made == [d["delta"] for d in deltas] * 2 and len(deltas) == 3
    [call] = final.output
    record = servers[1].sessions["sdk"].current.trajectory.messages[-1]["tool_calls"][0]
    assert call.type == "function_call" and call.arguments == expected["arguments"] and call.call_id == record["id"]


def test_responses_finish_sends_what_of_each_item_was_not_streamed():
    """Once the turn is generated, an item not yet added is added and sent whole (the hf engine's calls: their
    arguments in one delta); an item streamed sends only the rest of its arguments; either way the done event has
    them all."""
    call = {"type": "function_call", "id": "fc_call_0_0", "call_id": "call_0_0", "name": "calculator",
            "arguments": '{"expression": "12*34"}', "status": "completed"}  # fmt: skip
    response = {"status": "completed", "output": [call]}
    whole = output_events(response)
    assert [kind for kind, _ in whole] == ["response.output_item.added", "response.function_call_arguments.delta",
                                           "response.function_call_arguments.done", "response.output_item.done",
                                           "response.completed"]  # fmt: skip
    assert whole[0][1]["item"]["arguments"] == "" and whole[1][1]["delta"] == whole[2][1]["arguments"]
    rest = output_events(response, {call["id"]: '{"expression": '})
    assert rest[0] == ("response.function_call_arguments.delta", {"item_id": call["id"], "output_index": 0,
                                                                  "delta": '"12*34"}'})  # fmt: skip
    assert rest[1][1]["arguments"] == call["arguments"] and len(rest) == 4


def test_generate_route_is_token_in_token_out_as_verifiers_calls_it():
    """POST /inference/v1/generate (vLLM's route, verifiers 0.4's trainer): token ids in, sampled ids and their
    logprobs out; a second turn extending the first continues the same record; fields it cannot honour are 400."""
    model, tokenizer = random_chat_model()
    server = _native_server(model, tokenizer)
    url, header = f"{server.url}/inference/v1/generate", {"X-Session-ID": "vf/0"}
    stop_ids = sorted(server.stop_ids)
    params = {"temperature": 1.0, "max_tokens": 6, "logprobs": 1, "stop_token_ids": stop_ids,
              "skip_special_tokens": False}  # fmt: skip
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        status, first = post(url, {"model": "rlx", "token_ids": prompt, "sampling_params": params}, header)
        assert status == 200, first
        choice = first["choices"][0]
        assert first["prompt_token_ids"] == prompt and choice["finish_reason"] in ("stop", "length")
        assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in choice["token_ids"]]
        more = tokenizer("\nuser: again\n")["input_ids"]
        status, second = post(url, {"token_ids": prompt + choice["token_ids"] + more, "sampling_params": params},
                              header)  # fmt: skip
        assert status == 200, second
        for bad, name in [({"repetition_penalty": 1.2}, "repetition_penalty"), ({"stop_token_ids": [5]}, "stop")]:
            status, error = post(
                url, {"token_ids": prompt, "sampling_params": {**params, **bad}}, {"X-Session-ID": "x"}
            )
            assert status == 400 and name in error["error"]["message"], error
        status, error = post(url, {"token_ids": prompt, "features": {}}, {"X-Session-ID": "y"})
        assert status == 400 and "features" in error["error"]["message"]
    finally:
        _stop(server)
    session = server.sessions["vf/0"]
    assert len(session.segments) == 1  # the second turn extended the first
    trajectory = session.current.trajectory
    turns = [first["choices"][0], second["choices"][0]]
    assert trajectory.token_ids() == second["prompt_token_ids"] + turns[1]["token_ids"]
    masked = [i for i, m in enumerate(trajectory.loss_mask) if m]
    assert [trajectory.response_ids[i] for i in masked] == [t for turn in turns for t in turn["token_ids"]]
    logprobs = [e["logprob"] for turn in turns for e in turn["logprobs"]["content"]]
    assert [trajectory.rollout_logprobs[i] for i in masked] == pytest.approx(logprobs)


@pytest.mark.parametrize("engine", ["hf", "native"])
def test_top_logprobs_in_openai_format(engine):
    """Chat top_logprobs and completions logprobs=k: greedy, the sampled token is each position's most likely one
    with the same logprob; the alternatives come most likely first; more than OpenAI allows is refused by name."""
    model, tokenizer = random_chat_model(stop_bias=-10.0)
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0, seed=3)
    built = token_engine(model, tokenizer, engine, **({"kv_cache_gib": 0.01} if engine == "native" else {}))
    cfg = AgentConfig(max_total_tokens=500)
    worker = StreamWorker(built, greedy, cfg.max_total_tokens)
    server = AgentServer(worker, tokenizer, built.stop_ids, greedy, cfg).start()
    try:
        client = openai.OpenAI(base_url=server.base_url("top"), api_key="k", max_retries=0)
        chat = client.chat.completions.create(model="rlx", messages=[{"role": "user", "content": "hi"}],
                                              logprobs=True, top_logprobs=3)  # fmt: skip
        content = chat.choices[0].logprobs.content
        assert len(content) == 4
        for entry in content:
            alternatives = [t.logprob for t in entry.top_logprobs]
            assert len(alternatives) == 3 and alternatives == sorted(alternatives, reverse=True)
            assert entry.token == entry.top_logprobs[0].token
            assert entry.logprob == pytest.approx(alternatives[0])
        text = client.completions.create(model="rlx", prompt="12+3=", max_tokens=3, logprobs=2).choices[0].logprobs
        assert len(text.top_logprobs) == 3 and all(1 <= len(top) <= 2 for top in text.top_logprobs)
        assert all(top[token] == pytest.approx(lp) for top, token, lp in
                   zip(text.top_logprobs, text.tokens, text.token_logprobs))  # fmt: skip
        for body, name in [({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"top_logprobs": 2}, "logprobs")]:
            status, error = post(f"{server.url}/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                                        **body})  # fmt: skip
            assert status == 400 and error["error"]["param"] == "top_logprobs" and name in error["error"]["message"]
    finally:
        _stop(server)


SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("engine", ["hf", "native"])
def test_response_format_samples_within_the_json_grammar(engine, monkeypatch):
    """A random model answers json_schema requests with JSON that follows the schema, streamed or not, recorded with
    finite logprobs, and json_object ones with an object; under an RL run's agents, or without llguidance, the request
    is refused naming response_format."""
    model, tokenizer = random_chat_model(stop_bias=-10.0)  # left alone, it would not stop or write JSON
    sampling = SamplingParams(max_new_tokens=24, temperature=1.0, seed=3)
    built = token_engine(model, tokenizer, engine, **({"kv_cache_gib": 0.01} if engine == "native" else {}))
    cfg = AgentConfig(max_total_tokens=500)
    worker = StreamWorker(built, sampling, cfg.max_total_tokens)
    server = AgentServer(worker, tokenizer, built.stop_ids, sampling, cfg).start()
    schema_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    try:
        client = openai.OpenAI(base_url=server.base_url("json"), api_key="k", max_retries=0)
        messages = [{"role": "user", "content": "ok?"}]
        reply = client.chat.completions.create(model="rlx", messages=messages, response_format=schema_format)
        assert reply.choices[0].finish_reason == "stop"
        assert set(json.loads(reply.choices[0].message.content)) == {"ok"}
        other = openai.OpenAI(base_url=server.base_url("s"), api_key="k", max_retries=0)
        stream = other.chat.completions.create(
            model="rlx", messages=messages, stream=True, response_format=schema_format
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert set(json.loads(streamed)) == {"ok"}
        # any object: its keys may run past max_tokens, but it is an object from its first character on
        anything = client.chat.completions.create(
            model="rlx", messages=messages, response_format={"type": "json_object"}
        )
        assert anything.choices[0].message.content.startswith("{")
        trajectory = server.sessions["s"].current.trajectory
        assert trajectory.messages[-1]["content"] == streamed
        assert all(math.isfinite(lp) for lp in trajectory.rollout_logprobs)
        assert server.sessions["json"].segments[0].turn_settings[0]["response_format"] == schema_format
        monkeypatch.setitem(sys.modules, "llguidance", None)  # as if the extra were not installed
        status, error = post(
            f"{server.url}/v1/chat/completions", {"messages": messages, "response_format": schema_format}
        )
        assert (
            status == 400
            and error["error"]["param"] == "response_format"
            and "rlx[grammar]" in error["error"]["message"]
        )
    finally:
        _stop(server)


def test_response_format_is_refused_under_an_rl_runs_agents():
    server = start(strict=True)
    try:
        body = {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}
        status, error = post(f"{server.url}/v1/chat/completions", body)
        assert (
            status == 400
            and error["error"]["param"] == "response_format"
            and "distribution" in error["error"]["message"]
        )
    finally:
        _stop(server)


def _tool(name: str, prop: str, schema: dict) -> dict:
    parameters = {"type": "object", "properties": {prop: schema}, "required": [prop], "additionalProperties": False}
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


FLIP, PICK = _tool("flip", "up", {"type": "boolean"}), _tool("pick", "side", {"enum": ["x", "y"]})


@pytest.mark.parametrize("engine", ["hf", "native"])
def test_tool_choice_required_or_named_samples_one_call_within_the_tools_grammar(engine, monkeypatch):
    """A random model (left alone it writes no call) answers tool_choice 'required' with a call of an offered tool
    and a named function with that function, arguments following its schema, streamed or not, recorded with finite
    logprobs; no tools, an unknown name or an RL run's agents are refused naming tool_choice."""
    model, tokenizer = random_chat_model(stop_bias=-10.0)
    sampling = SamplingParams(max_new_tokens=64, temperature=1.0, seed=3)  # a call of ~50 character tokens
    built = token_engine(model, tokenizer, engine, **({"kv_cache_gib": 0.01} if engine == "native" else {}))
    cfg = AgentConfig(max_total_tokens=500)
    worker = StreamWorker(built, sampling, cfg.max_total_tokens)
    server = AgentServer(worker, tokenizer, built.stop_ids, sampling, cfg).start()
    paced(server, monkeypatch)  # the arguments streamed as sampled (native), whatever the machine's load
    messages = [{"role": "user", "content": "go"}]
    try:
        client = openai.OpenAI(base_url=server.base_url("req"), api_key="k", max_retries=0)
        reply = client.chat.completions.create(model="rlx", messages=messages, tools=[FLIP, PICK],
                                               tool_choice="required").choices[0]  # fmt: skip
        [call] = reply.message.tool_calls
        assert reply.finish_reason == "tool_calls" and call.function.name in ("flip", "pick")
        assert set(json.loads(call.function.arguments)) == ({"up"} if call.function.name == "flip" else {"side"})
        named = {"type": "function", "function": {"name": "pick"}}
        other = openai.OpenAI(base_url=server.base_url("named"), api_key="k", max_retries=0)
        stream = other.chat.completions.create(model="rlx", messages=messages, tools=[FLIP, PICK], tool_choice=named,
                                               stream=True)  # fmt: skip
        chunks = [c.choices[0] for c in stream if c.choices]
        [named], *pieces = [c.delta.tool_calls for c in chunks if c.delta.tool_calls]  # arguments as sampled (native)
        assert all(len(piece) == 1 and piece[0].index == 0 and piece[0].id is None for piece in pieces)
        arguments = "".join(piece[0].function.arguments for piece in pieces)
        assert named.function.name == "pick" and json.loads(arguments)["side"] in ("x", "y")
        assert len(pieces) > 1 if engine == "native" else len(pieces) == 1
        assert chunks[-1].finish_reason == "stop"  # a named function: 'stop', as OpenAI's and vLLM's
        trajectory = server.sessions["named"].current.trajectory
        assert trajectory.messages[-1]["tool_calls"][0]["function"] == {"name": "pick", "arguments": arguments}
        assert all(math.isfinite(lp) for lp in trajectory.rollout_logprobs)
        for body, why in [({"tool_choice": "required"}, "needs 'tools'"),
                          ({"tools": [FLIP], "tool_choice": {"type": "function", "function": {"name": "pick"}}},
                           "does not offer")]:  # fmt: skip
            status, error = post(f"{server.url}/v1/chat/completions", {"messages": messages, **body})
            assert status == 400 and error["error"]["param"] == "tool_choice" and why in error["error"]["message"]
    finally:
        _stop(server)
    strict = start(strict=True)
    try:
        body = {"messages": messages, "tools": [FLIP], "tool_choice": "required"}
        status, error = post(f"{strict.url}/v1/chat/completions", body)
        assert (
            status == 400 and error["error"]["param"] == "tool_choice" and "distribution" in error["error"]["message"]
        )
    finally:
        _stop(strict)
