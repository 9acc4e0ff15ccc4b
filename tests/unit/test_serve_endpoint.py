"""The endpoint made safe: hostile image references, API key, body limit, many concurrent clients, sessions by
header (kept apart, never merged), streaming equal to non-streamed, every chat-completions field honoured or refused
by name, SIGTERM -> 143 with the output written."""

from __future__ import annotations

import base64
import http.server
import json
import os
import re
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import httpx
import openai
import pytest

from rlx.chat.tool_calls import parse_json_list, parser_for_template
from rlx.errors import UserError
from rlx.models.vision.images import ImageError, read_image_bytes
from rlx.rollout.agent_config import AgentConfig
from rlx.rollout.config import RolloutConfig, SamplingParams
from rlx.serve.api import CHAT_FIELDS, METADATA_FIELDS
from rlx.serve.config import EndpointConfig
from rlx.serve.request_images import ImagePolicy
from rlx.serve.server import AgentServer
from rlx.serve.stream import StreamWorker
from rlx.stages.serve import session_record
from rlx.tasks.calculator import CALCULATOR_TOOL
from tests.agent_helpers import CALC_PIECES, CALC_SCRIPT, bigram_chat_model, random_chat_model, token_engine
from tests.conftest import cli, read_jsonl

SAMPLING = RolloutConfig(sampling=SamplingParams(max_new_tokens=6, temperature=1.0, seed=3))
HI = [{"role": "user", "content": "hi"}]


def start(model=None, sampling: RolloutConfig = SAMPLING, strict: bool = False, **endpoint) -> AgentServer:
    model, tokenizer = model or random_chat_model()
    engine, cfg = token_engine(model, tokenizer), AgentConfig(max_total_tokens=500)
    worker = StreamWorker(engine, sampling.sampling, cfg.max_total_tokens)
    server = AgentServer(
        worker, tokenizer, engine.stop_ids, sampling.sampling, cfg, endpoint=EndpointConfig(**endpoint),
        strict=strict,
    )  # fmt: skip
    return server.start()


def stop(server: AgentServer) -> None:
    server.close()
    server.worker.close()


def post(url: str, body, headers: dict | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_image_policy_refuses_hostile_references(tmp_path):
    """data: URIs always; files only under the root, regular, bounded; never a device, a FIFO, a symlink out of
    the root; an outside path is refused in the same words whether or not it exists."""
    root = tmp_path / "root"
    root.mkdir()
    (root / "ok.png").write_bytes(b"png bytes")
    (root / "big.png").write_bytes(b"x" * 200)
    os.mkfifo(root / "fifo.png")
    (root / "out.png").symlink_to("/etc/hostname")
    (tmp_path / "secret.png").write_bytes(b"secret")
    policy = ImagePolicy.of(str(root), max_bytes=100)
    assert policy.read(policy.ref("ok.png", "m"), "s") == b"png bytes"
    assert policy.read(policy.ref(f"file://{root}/ok.png", "m"), "s") == b"png bytes"
    assert policy.read(policy.ref("data:image/png;base64," + base64.b64encode(b"abc").decode(), "m"), "s") == b"abc"
    for ref, words in [
        ("fifo.png", "is not a regular file"),
        ("big.png", "is over 100 bytes"),
        ("out.png", "is outside --image-root"),
        ("../secret.png", "is outside --image-root"),
        ("/dev/zero", "is outside --image-root"),
    ]:
        with pytest.raises(UserError, match=words):
            policy.read(policy.ref(ref, "m"), "s")
    messages = []
    for ref in (str(tmp_path / "secret.png"), str(tmp_path / "missing.png")):
        with pytest.raises(UserError) as caught:
            policy.read(policy.ref(ref, "m"), "s")
        messages.append(str(caught.value).replace(ref, "REF"))
    assert messages[0] == messages[1]  # existence outside the root is not revealed
    with pytest.raises(UserError, match="is not a regular file"):  # /dev under a root that holds it
        everything = ImagePolicy.of("/", max_bytes=100)
        everything.read(everything.ref("/dev/zero", "m"), "s")
    for ref in ("zip://a.png::http://127.0.0.1:1/x.zip", "s3://bucket/a.png", "memory://a.png", "http://x/a.png"):
        with pytest.raises(UserError, match="is refused: a request may name images only as data: URIs"):
            policy.ref(ref, "m")
    with pytest.raises(UserError, match="start it with --image-root DIR"):
        ImagePolicy().ref(str(root / "ok.png"), "m")
    # prompt files keep their fsspec URLs, with the regular-file rule and the size limit
    with pytest.raises(ImageError, match="is not a regular file"):
        read_image_bytes(str(root / "fifo.png"))
    with pytest.raises(ImageError, match="is not a regular file"):
        read_image_bytes("/dev/zero")
    with pytest.raises(ImageError, match="is over 100 bytes"):
        read_image_bytes(str(root / "big.png"), max_bytes=100)


class _Counter(http.server.BaseHTTPRequestHandler):
    hits = 0

    def do_GET(self):
        type(self).hits += 1
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_requests_never_reach_the_network_or_other_file_systems(tmp_path):
    listener = http.server.HTTPServer(("127.0.0.1", 0), _Counter)
    threading.Thread(target=listener.serve_forever, daemon=True).start()
    port = listener.server_address[1]
    server = start(image_root=str(tmp_path))
    try:
        for ref in (f"zip://a.png::http://127.0.0.1:{port}/a.zip", f"http://127.0.0.1:{port}/a.png", "/dev/zero"):
            content = [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": ref}}]
            status, reply = post(
                f"{server.url}/v1/chat/completions", {"messages": [{"role": "user", "content": content}]}
            )
            assert status == 400, reply
            assert "Errno" not in reply["error"]["message"]
        assert _Counter.hits == 0
        assert post(f"{server.url}/v1/chat/completions", {"messages": HI, "max_tokens": 1})[0] == 200  # still up
    finally:
        stop(server)
        listener.shutdown()


def test_api_key_body_limit_models_and_routes():
    out = cli("serve", "--model", "nowhere", "--backlog", "128")
    assert out.exit_code == 1 and "--backlog: must be at least 2048, got 128" in out.stderr
    server = start(api_key="sekret", max_request_mib=0.001)
    url = f"{server.url}/v1"
    try:
        assert post(f"{url}/chat/completions", {"messages": HI})[0] == 401
        assert post(f"{url}/chat/completions", {"messages": HI}, {"Authorization": "Bearer wrong"})[0] == 401
        key = {"Authorization": "Bearer sekret"}
        status, reply = post(f"{url}/chat/completions", {"messages": HI, "max_tokens": 1}, key)
        assert status == 200 and reply["usage"]["completion_tokens"] == 1
        status, reply = post(f"{url}/chat/completions", {"messages": [{"role": "user", "content": "x" * 5000}]}, key)
        assert status == 413 and "--max-request-mib" in reply["error"]["message"]
        client = openai.OpenAI(base_url=url, api_key="sekret", max_retries=0)
        assert client.models.retrieve("rlx").id == "rlx"
        with pytest.raises(openai.NotFoundError, match="this server serves 'rlx'"):
            client.models.retrieve("gpt-4o")
        with pytest.raises(openai.NotFoundError, match="model 'gpt-4o' does not exist"):
            client.chat.completions.create(model="gpt-4o", messages=HI)
        status, reply = post(f"{url}/responses", {"input": "hi", "max_output_tokens": 1}, key)
        assert status == 200 and reply["object"] == "response" and reply["usage"]["output_tokens"] == 1
        assert post(f"{url}/embeddings", {}, key)[0] == 404
    finally:
        stop(server)


def test_64_concurrent_clients_are_all_answered_and_kept_apart():
    """64 clients at once, each its own X-Session-ID (one with '/' in it, sent in the path too): all answered, each
    sample holds its own conversation; a second request for a sample still generating is 409."""
    server = start()
    results: dict[int, tuple[int, dict]] = {}

    def ask(i: int) -> None:
        messages = [{"role": "user", "content": f"q{i}"}]
        results[i] = post(f"{server.url}/v1/chat/completions", {"messages": messages, "max_tokens": 2},
                          {"X-Session-ID": f"client/{i}"})  # fmt: skip

    try:
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results) == list(range(64)) and all(status == 200 for status, _ in results.values())
        assert len(server.sessions) == 64
        assert all(server.sessions[f"client/{i}"].segments[0].trajectory.messages[0]["content"] == f"q{i}"
                   for i in range(64))  # fmt: skip
        assert server.worker.largest_batch > 1
        more = [{"role": "user", "content": "q5"}, {"role": "user", "content": "again"}]
        status, _ = post(f"{server.base_url('client/5')}/chat/completions", {"messages": more, "max_tokens": 1})
        assert status == 200 and server.sessions["client/5"].num_requests == 2  # %2F in the path: the same sample
        assert post(f"{server.url}/s/client/5/v1/chat/completions", {"messages": more, "max_tokens": 1})[0] == 200
        session = server.sessions["client/7"]
        with session.lock:  # a request of client/7 is generating
            status, reply = post(f"{server.url}/v1/chat/completions", {"messages": HI}, {"X-Session-ID": "client/7"})
        assert status == 409 and "'client/7' is still answering its request 2 while request 3" in str(reply)
        assert session.num_requests == 1 and len(session.segments) == 1  # nothing merged into it
        sent = []
        hooks = httpx.Client(event_hooks={"request": [sent.append]})
        client = openai.OpenAI(base_url=server.base_url("client/7"), api_key="k", max_retries=2, http_client=hooks)
        with session.lock, pytest.raises(openai.ConflictError, match="still answering"):
            client.chat.completions.create(model="rlx", messages=HI)
        assert len(sent) == 1 and session.num_requests == 1  # the client did not retry into the busy sample
    finally:
        stop(server)


def test_sessions_are_evicted_and_every_segment_is_kept():
    server = start(max_sessions=2)
    try:
        for name in ("a", "b", "c"):
            post(f"{server.base_url(name)}/chat/completions", {"messages": HI, "max_tokens": 1})
        post(f"{server.base_url('c')}/chat/completions", {"messages": [{"role": "user", "content": "new"}]})
        assert list(server.sessions) == ["b", "c"] and [s.sample_id for s in server.closed] == ["a"]
        assert "least recently used of 2 sessions" in session_record(server.closed[0], 1.0).extra["evicted"]
        record = session_record(server.sessions["c"], 1.0)
        assert record.extra["num_segments"] == 2 and record.extra["segments"][0]["reason"] == "first request"
        assert record.extra["segments"][0]["turn_settings"][0]["max_tokens"] == 1
    finally:
        stop(server)
    idle = start(session_idle_s=0.05)
    try:
        post(f"{idle.base_url('old')}/chat/completions", {"messages": HI, "max_tokens": 1})
        time.sleep(0.2)
        post(f"{idle.base_url('new')}/chat/completions", {"messages": HI, "max_tokens": 1})
        assert [s.sample_id for s in idle.closed] == ["old"] and "idle for more than" in idle.closed[0].evicted
    finally:
        stop(idle)


def _stream_text(stream) -> tuple[str, list, dict | None, str | None]:
    text, calls, usage, finish = "", {}, None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            delta = getattr(choice, "delta", None)
            text += (delta.content or "") if delta is not None else choice.text
            for call in (delta.tool_calls or []) if delta is not None else []:  # as clients add up the deltas
                known = calls.setdefault(call.index, ["", "", ""])
                known[0] += call.id or ""
                known[1] += call.function.name or ""
                known[2] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return text, [tuple(calls[i]) for i in sorted(calls)], usage, finish


@pytest.mark.parametrize("endpoint", ["chat", "completions", "tools"])
def test_streaming_equals_non_streamed(endpoint):
    """The openai client's stream (text, tool-call deltas, usage, finish) and the recorded trajectory equal the same
    request answered without streaming on a second server of the same model and seed."""
    model = bigram_chat_model(CALC_SCRIPT, extra_tokens=CALC_PIECES) if endpoint == "tools" else random_chat_model()
    sampling = RolloutConfig(sampling=SamplingParams(max_new_tokens=16, temperature=1.0, seed=3))
    servers = [start(model, sampling), start(model, sampling)]
    try:
        clients = [openai.OpenAI(base_url=s.base_url("x/0"), api_key="k", max_retries=0) for s in servers]
        if endpoint == "completions":
            plain = clients[0].completions.create(model="rlx", prompt="12+3=", max_tokens=6, echo=True).choices[0]
            stream = clients[1].completions.create(model="rlx", prompt="12+3=", max_tokens=6, stream=True,
                                                   stream_options={"include_usage": True})  # fmt: skip
            assert plain.text.startswith("12+3=")  # echo
            expected = (plain.text[len("12+3=") :], [], plain.finish_reason)
        else:
            kwargs = {"tools": [CALCULATOR_TOOL]} if endpoint == "tools" else {}
            messages = [{"role": "user", "content": "12*34"}]
            plain = clients[0].chat.completions.create(model="rlx", messages=messages, **kwargs).choices[0]
            stream = clients[1].chat.completions.create(model="rlx", messages=messages, stream=True,
                                                        stream_options={"include_usage": True}, **kwargs)  # fmt: skip
            calls = [(c.function.name, c.function.arguments) for c in plain.message.tool_calls or []]
            expected = (plain.message.content or "", calls, plain.finish_reason)
        text, calls, usage, finish = _stream_text(stream)
        ids = [call[0] for call in calls]  # each server's own random ids, as OpenAI's
        assert all(re.fullmatch("call_[0-9a-f]{24}", i) for i in ids) and len(set(ids)) == len(ids)
        assert (text, [call[1:] for call in calls], finish) == expected
        if endpoint == "tools":
            assert finish == "tool_calls" and calls
        trajectories = [s.sessions["x/0"].current.trajectory.to_json() for s in servers]
        for trajectory in trajectories:  # the tool calls' ids are each server's own
            for message in trajectory.get("messages", []):
                for call in message.get("tool_calls", []):
                    call["id"] = "same"
        assert trajectories[0] == trajectories[1]
        assert usage.completion_tokens == len(servers[1].sessions["x/0"].current.trajectory.response_ids)
    finally:
        for server in servers:
            stop(server)


def test_tool_calls_are_read_only_where_tools_are_offered():
    """A model that writes a tool call every turn: offered the tool, the reply is a tool call; offered none (as
    smolagents' last request, which asks for a final answer in text), the reply is the text the model wrote,
    streamed or not, and a client never gets a call of a function it did not offer."""
    model = bigram_chat_model(CALC_SCRIPT, extra_tokens=CALC_PIECES)
    server = start(model, RolloutConfig(sampling=SamplingParams(max_new_tokens=16, temperature=1.0, seed=3)))
    try:
        client = openai.OpenAI(base_url=server.base_url("t"), api_key="k", max_retries=0)
        messages = [{"role": "user", "content": "12*34"}]
        offered = client.chat.completions.create(model="rlx", messages=messages, tools=[CALCULATOR_TOOL]).choices[0]
        assert offered.finish_reason == "tool_calls" and offered.message.tool_calls[0].function.name == "calculator"
        for kwargs in ({}, {"tool_choice": "auto"}):
            client = openai.OpenAI(base_url=server.base_url(f"n{len(kwargs)}"), api_key="k", max_retries=0)
            plain = client.chat.completions.create(model="rlx", messages=messages, **kwargs).choices[0]
            written = CALC_SCRIPT.removeprefix("\n").removesuffix("<|im_end|>")
            assert (plain.message.content, plain.message.tool_calls, plain.finish_reason) == (written, None, "stop")
            streamed = client.chat.completions.create(model="rlx", messages=messages, stream=True, **kwargs)
            assert _stream_text(streamed)[:2] == (written, [])
    finally:
        stop(server)


HONOURED = {
    "model": "rlx", "max_tokens": 2, "max_completion_tokens": 2, "seed": 11, "stop": ["\n\n"], "stream": False,
    "temperature": 0.7, "top_p": 0.9, "top_k": 5, "logprobs": True, "return_token_ids": True, "n": 2,
    "tool_choice": "none", "user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
    "safety_identifier": "s", "prompt_cache_key": "p", "prompt_cache_retention": "24h", "parallel_tool_calls": True,
    "response_format": {"type": "text"}, "modalities": ["text"], "frequency_penalty": 0, "presence_penalty": 0.0,
    "logit_bias": {}, "top_logprobs": 0, "tools": [CALCULATOR_TOOL], "prompt_logprobs": 1,
}  # fmt: skip
REFUSED = {
    "temperature": -0.5, "top_p": 1.5, "top_k": 2.5, "max_tokens": 10_000, "max_completion_tokens": 10_000, "n": 17,
    "top_logprobs": 21, "tool_choice": "required", "response_format": {"type": "grammar"},
    "frequency_penalty": 0.5, "presence_penalty": 1.0, "logit_bias": {"5": 10}, "audio": {"voice": "x"},
    "modalities": ["text", "audio"], "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low",
    "verbosity": "low", "web_search_options": {}, "functions": [{"name": "f"}], "function_call": {"name": "f"},
    "parallel_tool_calls": False, "stream_options": {"include_usage": True}, "messages": [], "tools": "x",
    "stop": [1], "seed": -1, "logprobs": "yes", "stream": "yes", "return_token_ids": 1, "model": "other",
    "unknown_field": 1, "prompt_logprobs": 21,
}  # fmt: skip


def test_per_request_sampling_overrides_the_servers():
    """A request's temperature 0 or top_k 1 answers as a greedy server does; a seeded request with its own
    temperature is reproducible (a second server, the same sample), and its seed and temperature are the ones used."""
    model = random_chat_model(stop_bias=-10.0)  # replies run to max_tokens: long enough to tell draws apart
    greedy_server = start(model, RolloutConfig(sampling=SamplingParams(max_new_tokens=6, temperature=0.0, seed=3)))
    servers = [start(model), start(model)]

    def tokens(server, sample: str, **asked) -> list[int]:
        body = {"messages": HI, "return_token_ids": True, **asked}
        status, reply = post(f"{server.url}/v1/chat/completions", body, {"X-Session-ID": sample})
        assert status == 200, reply
        return reply["choices"][0]["token_ids"]

    try:
        greedy = tokens(greedy_server, "g")
        assert tokens(servers[0], "t0", temperature=0) == greedy == tokens(servers[0], "k1", top_k=1)
        assert servers[0].sessions["t0"].current.turn_settings[0]["temperature"] == 0
        hot = [tokens(s, "s", temperature=1.5, seed=7) for s in servers]
        assert hot[0] == hot[1] != greedy
        assert tokens(servers[0], "r", temperature=1.5, seed=8) != tokens(servers[1], "r", temperature=1.5, seed=7)
        # the same draws at another temperature: the logprobs are each turn's own temperature's
        tokens(servers[0], "u", seed=7), tokens(servers[1], "u", temperature=1.5, seed=7)
        logprobs = [s.sessions["u"].current.trajectory.rollout_logprobs for s in servers]
        assert logprobs[0] != pytest.approx(logprobs[1], abs=1e-3)
    finally:
        for server in (greedy_server, *servers):
            stop(server)


def test_every_chat_completions_field_is_honoured_or_refused_by_name():
    """Each field of OpenAI's chat-completions request: a neutral or supported value is answered (and shows its
    effect), any other is HTTP 400 (404 for another model) naming the field; under an RL run's agents the run's
    seed governs."""
    assert set(HONOURED) | {"messages", "stream_options"} >= CHAT_FIELDS - {"audio", "prediction", "reasoning_effort",
        "verbosity", "web_search_options", "functions", "function_call"}  # fmt: skip
    assert set(REFUSED) | set(METADATA_FIELDS) >= CHAT_FIELDS  # metadata changes no token: recorded, never refused
    server = start()
    url = f"{server.url}/v1/chat/completions"
    try:
        for name, value in HONOURED.items():
            status, reply = post(url, {"messages": HI, name: value}, {"X-Session-ID": f"ok-{name}"})
            assert status == 200, (name, reply)
        _, reply = post(url, {"messages": HI, **HONOURED}, {"X-Session-ID": "all"})
        choice = reply["choices"][0]
        assert len(choice["token_ids"]) <= 2
        assert reply["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in reply["choices"])
        assert len(choice["logprobs"]["content"]) == len(choice["token_ids"]) and reply["prompt_token_ids"]
        assert len(reply["prompt_logprobs"]) == len(reply["prompt_token_ids"])
        assert [c["index"] for c in reply["choices"]] == [0, 1]  # n = 2: choice 1 is sample 'all~1'
        assert server.sessions["all~1"].num_requests == server.sessions["all"].num_requests == 1
        assert reply["choices"][1]["token_ids"] == server.sessions["all~1"].current.trajectory.response_ids
        turn = server.sessions["all"].current.turn_settings[0]
        assert turn["seed"] == 11 and turn["stop"] == ["\n\n"] and turn["tool_choice"] == "none"
        assert (turn["temperature"], turn["top_p"], turn["top_k"]) == (0.7, 0.9, 5)  # the request's own sampling
        assert {k: turn[k] for k in METADATA_FIELDS} == {k: HONOURED[k] for k in METADATA_FIELDS}
        events = httpx.post(url, json={"messages": HI, "n": 2, "stream": True}, timeout=60).text.split("\n\n")
        chunks = [json.loads(e.removeprefix("data: ")) for e in events if e.startswith("data: {")]
        assert events[-2:] == ["data: [DONE]", ""] and {c["choices"][0]["index"] for c in chunks} == {0, 1}
        status, reply = post(url, b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}")
        assert status == 400 and "nested too deeply" in reply["error"]["message"]
        for name, value in REFUSED.items():
            status, reply = post(url, {"messages": HI, name: value}, {"X-Session-ID": f"no-{name}"})
            assert status in (400, 404) and f"'{name}'" in reply["error"]["message"].replace("model 'other'", "'model'")
            assert reply["error"]["param"] == name or name in ("messages",), (name, reply)
    finally:
        stop(server)
    strict = start(strict=True)
    try:
        status, reply = post(f"{strict.url}/v1/chat/completions", {"messages": HI, "seed": 11})
        assert status == 400 and "'seed': this rollout samples with the run's seed" in reply["error"]["message"]
        status, reply = post(f"{strict.url}/v1/chat/completions", {"messages": HI, "n": 2})
        assert status == 400 and reply["error"]["param"] == "n"
        for name, value in {"temperature": 0.5, "top_p": 0.9, "top_k": 5}.items():  # the run's sampling governs
            status, reply = post(f"{strict.url}/v1/chat/completions", {"messages": HI, name: value})
            assert status == 400 and reply["error"]["param"] == name and "the run's" in reply["error"]["message"]
        body = {"messages": HI, "temperature": 1.0, "top_p": 1.0, "top_k": -1}  # the run's own values pass
        assert post(f"{strict.url}/v1/chat/completions", body)[0] == 200
    finally:
        stop(strict)


def test_sigterm_exits_143_after_writing_the_output(tiny_ckpt, tmp_path):
    """`rlx serve` on SIGTERM: the samples' trajectories are written, then exit code 143."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    answered = []

    def client():
        deadline = time.monotonic() + 120
        while not answered and time.monotonic() < deadline:
            try:
                body = {"prompt": "1+1=", "max_tokens": 2}
                reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
                answered.append(reply.status_code)
            except httpx.TransportError:
                time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=client)
    thread.start()
    try:
        out = cli("serve", "--model", tiny_ckpt, "--port", str(port), "--out", tmp_path / "o.jsonl",
                  "--max-new-tokens", "2")  # fmt: skip
    finally:
        thread.join()
    assert answered == [200] and out.exit_code == 143, out
    [record] = read_jsonl(Path(tmp_path / "o.jsonl"))
    assert record["id"] == "default/0" or record["prompt_id"] == "default"


PLAIN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LIST_TEMPLATE = (
    '{% if tools %}<|im_start|>system\nCall tools as <tool_call>[{"name": ..., "arguments": ...}]</tool_call>'
    "\n{{ tools | tojson }}<|im_end|>\n{% endif %}" + PLAIN_TEMPLATE
)


def test_tool_parser_follows_the_template_and_tools_a_template_drops_are_refused():
    """--tool-parser auto: a template asking for a JSON list in <tool_call> (SmolLM2's form) reads such lists; a
    request with tools on a template that never renders them is HTTP 400 naming 'tools'."""
    model, tokenizer = random_chat_model()
    assert parser_for_template(tokenizer.chat_template) == "qwen"
    assert parser_for_template(LIST_TEMPLATE) == "smollm2"
    calls = '[{"name": "add", "arguments": {"a": 1}}, {"name": "neg", "arguments": "{\\"x\\": 2}"}]'
    text = f"ok <tool_call>{calls}</tool_call>"
    parsed = parse_json_list(text, 3)
    assert not parsed.errors and parsed.message["content"] == "ok"
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in
            parsed.message["tool_calls"]] == [("call_3_0", "add", {"a": 1}), ("call_3_1", "neg", {"x": 2})]  # fmt: skip
    bad = parse_json_list("<tool_call>[1]</tool_call>", 0)
    assert bad.errors == ['tool call 1 must be a JSON object with a "name" string']
    tokenizer.chat_template = LIST_TEMPLATE
    server = start((model, tokenizer))
    try:
        session = server.session("s")
        assert session.parse is parse_json_list
        status, reply = post(f"{server.url}/v1/chat/completions", {"messages": HI, "tools": [CALCULATOR_TOOL]})
        assert status == 200, reply
    finally:
        stop(server)
    tokenizer.chat_template = PLAIN_TEMPLATE
    server = start((model, tokenizer))
    try:
        status, reply = post(f"{server.url}/v1/chat/completions", {"messages": HI, "tools": [CALCULATOR_TOOL]})
        assert status == 400 and reply["error"]["param"] == "tools" and "does not render tools" in str(reply)
        assert post(f"{server.url}/v1/chat/completions", {"messages": HI, "max_tokens": 1})[0] == 200
    finally:
        stop(server)


def test_responses_api_continues_the_sample_by_previous_response_id_or_full_input():
    """/v1/responses through the openai client: text and function tools; a follow-up by previous_response_id or by
    the full input extends the same trajectory token-exactly, streamed or not (the SDK's stream helper rebuilds the
    response from the events); what it cannot do is refused by name."""
    model = bigram_chat_model(CALC_SCRIPT, extra_tokens=CALC_PIECES)
    server = start(model, RolloutConfig(sampling=SamplingParams(max_new_tokens=16, temperature=1.0, seed=3)))
    client = openai.OpenAI(base_url=server.base_url("r/0"), api_key="k", max_retries=0)
    tool = {"type": "function", **CALCULATOR_TOOL["function"]}
    try:
        first = client.responses.create(model="rlx", input="12*34", tools=[tool])
        [call] = [item for item in first.output if item.type == "function_call"]
        assert call.name == CALCULATOR_TOOL["function"]["name"] and first.status == "completed"
        second = client.responses.create(
            model="rlx", previous_response_id=first.id, tools=[tool],
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "408"}],
        )  # fmt: skip
        session = server.sessions["r/0"]
        assert len(session.segments) == 1 and session.current.trajectory.num_turns == 2
        assert session.current.trajectory.messages[2] == {
            "role": "tool",
            "tool_call_id": call.call_id,
            "content": "408",
        }
        full = [{"role": "user", "content": "12*34"}, call.model_dump(exclude_none=True),
                {"type": "function_call_output", "call_id": call.call_id, "output": "408"}]  # fmt: skip
        full += [item.model_dump(exclude_none=True) for item in second.output]
        full.append({"role": "user", "content": [{"type": "input_text", "text": "thanks"}]})
        third = client.responses.create(model="rlx", input=full, tools=[tool], max_output_tokens=2)
        assert len(session.segments) == 1 and session.current.trajectory.num_turns == 3  # the same segment
        before = len(session.segments), session.current.trajectory.num_turns
        more = {"previous_response_id": third.id, "input": "more", "tools": [tool], "max_output_tokens": 2}
        with client.responses.stream(model="rlx", **more) as stream:
            events = list(stream)  # (cut at 2 tokens: the SDK's get_final_response waits for 'completed' only)
        kinds, streamed = [event.type for event in events], events[-1].response
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
        assert "response.output_item.added" in kinds and "response.output_item.done" in kinds
        text = "".join(item.content[0].text for item in streamed.output if item.type == "message")
        calls = [item.arguments for item in streamed.output if item.type == "function_call"]
        assert text == "".join(streamed.output_text) and streamed.usage.output_tokens == 2 and (text or calls)
        assert (len(session.segments), session.current.trajectory.num_turns) == (before[0], before[1] + 1)
        refused = [
            ({"tools": [{"type": "web_search"}]}, "tools"),
            ({"text": {"format": {"type": "json_object"}}}, "text"),
            ({"background": True}, "background"),
        ]
        for kwargs, name in refused:
            with pytest.raises(openai.BadRequestError, match=f"'{name}'"):
                client.responses.create(model="rlx", input="x", **kwargs)
        with pytest.raises(openai.NotFoundError, match="previous_response_id|no response"):
            client.responses.create(model="rlx", input="x", previous_response_id="resp_nope")
    finally:
        stop(server)


def test_the_path_names_the_sample_and_x_session_id_is_kept_as_the_clients_label(tmp_path):
    """A request to /s/<id>/v1 belongs to <id> whatever its X-Session-ID says (verifiers names each rollout by it while
    `--agent` names the sample by the path): the header is kept, distinct and in order, in the sample's record; without
    a path the header names the sample and is no label; a label that cannot be an id is refused."""
    server = start()
    try:
        url = f"{server.base_url('p/0')}/chat/completions"
        status, reply = post(url, {"messages": HI, "max_tokens": 1}, {"X-Session-ID": "trace-a"})
        assert status == 200
        more = [*HI, reply["choices"][0]["message"], {"role": "user", "content": "more"}]
        for label in ("trace-a", "trace-b"):
            assert post(url, {"messages": more, "max_tokens": 1}, {"X-Session-ID": label})[0] == 200
        assert post(f"{server.url}/v1/chat/completions", {"messages": HI}, {"X-Session-ID": "p/1"})[0] == 200
        status, reply = post(url, {"messages": HI}, {"X-Session-ID": "x" * 600})
        assert status == 400 and "X-Session-ID" in reply["error"]["message"]
        assert sorted(server.sessions) == ["p/0", "p/1"] and "trace-a" not in server.sessions
        session = server.sessions["p/0"]
        assert session.client_session_ids == ["trace-a", "trace-b"] and session.num_requests == 3
        assert server.sessions["p/1"].client_session_ids == []
        record = session_record(session, 1.0)
        assert record.extra["client_session_ids"] == ["trace-a", "trace-b"]
    finally:
        stop(server)
