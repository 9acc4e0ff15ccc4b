"""The OpenAI-compatible server: agents written with the real `openai` client give the same trajectories as
the equivalent Python environment, history rewrites start segments, completions extend token-exactly,
concurrent requests are batched, and bad requests or agents get clear errors."""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request

import openai
import pytest

from rlx.agent.agents import AgentRollout
from rlx.agent.driver import EnvRollout
from rlx.errors import UserError
from rlx.formats.records import PromptRecord
from rlx.rollout.agent_config import AgentConfig
from rlx.rollout.config import RolloutConfig, SamplingParams
from rlx.rollout.requests import TokenRequest
from rlx.serve.server import AgentServer
from rlx.serve.sessions import normalize_message
from rlx.serve.stream import StreamWorker
from rlx.tasks.calculator import CALCULATOR_TOOL, evaluate
from tests.agent_helpers import (
    CALC_PIECES,
    CALC_SCRIPT,
    ENVS,
    QUESTIONS,
    bigram_chat_model,
    random_chat_model,
    spans,
    token_engine,
)

AGENT = '''
from openai import OpenAI


def echo_agent(record, base_url):
    """The Echo environment's conversation, driven from the agent's side through the OpenAI client."""
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": record["prompt"]}]
    for turn in range(1, 4):
        choice = client.chat.completions.create(model="rlx", messages=messages, max_tokens=12).choices[0]
        messages.append(choice.message.model_dump(exclude_none=True))
        if choice.finish_reason == "length":
            return 0.25 * (turn - 1)
        if turn < 3:
            messages += [{"role": "tool", "content": str(turn)}, {"role": "user", "content": "again"}]
    return 1.5
'''

SAMPLING = RolloutConfig(sampling=SamplingParams(n=2, max_new_tokens=12, temperature=1.0, seed=3))


@pytest.fixture
def files(tmp_path):
    (tmp_path / "envs.py").write_text(ENVS)
    (tmp_path / "agent.py").write_text(AGENT)
    return tmp_path


def serve(model_and_tokenizer, sampling: RolloutConfig = SAMPLING, **agent) -> tuple[AgentServer, StreamWorker]:
    model, tokenizer = model_and_tokenizer
    engine, cfg = token_engine(model, tokenizer), AgentConfig(**agent)
    worker = StreamWorker(engine, sampling.sampling, cfg.max_total_tokens)
    return AgentServer(worker, tokenizer, engine.stop_ids, sampling.sampling, cfg).start(), worker


@pytest.mark.parametrize(
    ("style", "temperature", "stop_bias"), [("qwen2.5", 1.0, 0.3), ("qwen3", 1.0, 0.3), ("qwen2.5", 0.0, 0.05)]
)
def test_openai_agent_matches_the_python_environment(files, style, temperature, stop_bias, monkeypatch):
    """Same tokens, mask, logprobs, messages and reward, sampled (each turn's random stream is keyed by
    sample and turn) or greedy; with the Qwen3-style template the history the agent sends back
    re-renders without the generation prompt's think block, and rlx must not care. (The worker's gathering window
    is widened to 0.2 s so that the four agents' first requests meet in one batch on a loaded machine too: with
    the default 5 ms the batching check failed once in a full suite run.)"""
    monkeypatch.setattr(StreamWorker.__init__, "__defaults__", (64, 0.2))
    model, tokenizer = random_chat_model(style, stop_bias=stop_bias)
    engine = token_engine(model, tokenizer)
    sampling = SamplingParams(n=2, max_new_tokens=12, temperature=temperature, seed=3)
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}} if style == "qwen3" else {}
    cfg = AgentConfig(env=f"{files}/envs.py:Echo", max_total_tokens=400, **kwargs)
    from_env = EnvRollout(engine, tokenizer, sampling, cfg).generate(QUESTIONS).records
    result = AgentRollout(engine, tokenizer, sampling, cfg, f"{files}/agent.py:echo_agent").generate(QUESTIONS)
    from_agent = result.records
    assert [r.id for r in from_agent] == [r.id for r in from_env]
    for env_rec, agent_rec in zip(from_env, from_agent):
        assert agent_rec.prompt_ids == env_rec.prompt_ids
        assert agent_rec.response_ids == env_rec.response_ids
        assert agent_rec.loss_mask == env_rec.loss_mask
        assert all(
            math.isclose(a, b, abs_tol=1e-5) for a, b in zip(agent_rec.rollout_logprobs, env_rec.rollout_logprobs)
        )
        assert agent_rec.messages == [normalize_message(m) for m in env_rec.messages]
        assert agent_rec.num_turns == env_rec.num_turns
        assert agent_rec.env_reward == env_rec.env_reward
        assert agent_rec.response == env_rec.response
        assert {"env_done": "stop"}.get(env_rec.finish_reason, env_rec.finish_reason) == agent_rec.finish_reason
        assert agent_rec.extra["num_segments"] == 1 and agent_rec.extra["segment_reason"] == "first request"
    if style == "qwen3":  # the drift the server sidesteps: a re-render of the history is not what was sampled
        rec = max(from_agent, key=lambda r: r.num_turns)
        rerendered = tokenizer.apply_chat_template(rec.messages, tokenize=False)
        assert tokenizer.decode(rec.prompt_ids + rec.response_ids).count("<think>") == rec.num_turns > 1
        assert rerendered.count("<think>") == 1  # only the last assistant turn keeps it
    assert result.stats.episodes.serve_largest_batch > 1  # 4 agents at once: their requests were batched


def calculator_agent(record, base_url):
    """The calculator task as an OpenAI-client agent: runs the tool calls it gets back, for two turns."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": record["prompt"]}]
    for _ in range(2):
        choice = client.chat.completions.create(model="rlx", messages=messages, tools=[CALCULATOR_TOOL]).choices[0]
        messages.append(choice.message.model_dump(exclude_none=True))
        if choice.finish_reason != "tool_calls":
            return float(choice.message.content == record["ground_truth"])
        for call in choice.message.tool_calls:
            value = evaluate(json.loads(call.function.arguments)["expression"])
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(value)})
    return 0.0


def test_tool_calls_in_replies_match_the_python_environment():
    model, tokenizer = bigram_chat_model(CALC_SCRIPT, extra_tokens=CALC_PIECES)
    engine = token_engine(model, tokenizer)
    sampling = SamplingParams(n=1, max_new_tokens=16, temperature=1.0)
    cfg = AgentConfig(env="rlx.tasks.calculator:CalculatorEnv", max_turns=2)
    question = [PromptRecord(id="c", prompt="12*34", ground_truth="408")]
    [from_env] = EnvRollout(engine, tokenizer, sampling, cfg).generate(question).records
    [from_agent] = AgentRollout(engine, tokenizer, sampling, cfg, calculator_agent).generate(question).records
    assert from_agent.num_turns == 2  # both replies came back with finish_reason 'tool_calls'
    assert from_agent.prompt_ids == from_env.prompt_ids and from_agent.response_ids == from_env.response_ids
    assert from_agent.loss_mask == from_env.loss_mask
    assert from_agent.messages == from_env.messages[:-1]  # the env's last reply is not sent
    assert from_agent.messages[2] == {"role": "tool", "tool_call_id": "call_0_0", "content": "408"}


def test_a_stop_string_is_cut_from_replies_as_from_environment_messages(files):
    """rollout.sampling.stop through the server: the agent reads the reply up to the stop string, as the Python
    environment does, and the trajectories are the same."""
    model, tokenizer = bigram_chat_model("\nabXYcd<|im_end|>")
    engine = token_engine(model, tokenizer)
    sampling = SamplingParams(n=1, max_new_tokens=12, temperature=0.0, stop=("XY",))
    cfg = AgentConfig(env=f"{files}/envs.py:Echo", max_total_tokens=400)
    [from_env] = EnvRollout(engine, tokenizer, sampling, cfg).generate(QUESTIONS[:1]).records
    [from_agent] = (
        AgentRollout(engine, tokenizer, sampling, cfg, f"{files}/agent.py:echo_agent").generate(QUESTIONS[:1]).records
    )
    assert [m["content"] for m in from_agent.messages if m["role"] == "assistant"] == ["ab"] * 3
    assert from_agent.messages == [normalize_message(m) for m in from_env.messages]
    assert from_agent.response_ids == from_env.response_ids and from_agent.loss_mask == from_env.loss_mask


def test_rewritten_history_starts_a_new_segment():
    server, worker = serve(random_chat_model())
    client = openai.OpenAI(base_url=server.base_url("a/0"), api_key="unused", max_retries=0)
    try:
        messages = [{"role": "user", "content": "hi"}]
        first = client.chat.completions.create(model="rlx", messages=messages).choices[0].message
        messages += [first.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        client.chat.completions.create(model="rlx", messages=messages)
        session = server.sessions["a/0"]
        [segment] = session.segments
        traj = segment.trajectory
        assert traj.num_turns == 2 and [m["role"] for m in traj.messages] == ["user", "assistant", "user", "assistant"]
        # the second context is the first request's tokens verbatim, then the new message's template tokens
        (a, b, _), (_, c, inserted), _ = spans(traj.loss_mask)
        assert (
            inserted == 0 and server.tokenizer.decode(traj.response_ids[a:b], skip_special_tokens=True) == first.content
        )
        closing = "" if traj.response_ids[b - 1] == server.tokenizer.eos_token_id else "<|im_end|>"
        expected = closing + "\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
        assert server.tokenizer.decode(traj.response_ids[b:c]) == expected
        messages[1]["content"] = "something else"  # the agent edits the model's reply
        client.chat.completions.create(model="rlx", messages=messages)
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
        client.chat.completions.create(model="rlx", messages=messages[:1], tools=tools)
        assert [s.reason for s in session.segments] == [
            "first request",
            "history rewritten",
            "tools changed",
        ]
        assert (
            session.segments[2].trajectory.prompt_ids
            == server.tokenizer.apply_chat_template(
                messages[:1], tools=tools, add_generation_prompt=True, return_dict=True
            )["input_ids"]
        )
    finally:
        server.close()
        worker.close()


def test_completions_extend_token_exactly():
    server, worker = serve(random_chat_model())
    client = openai.OpenAI(base_url=server.base_url("c/0"), api_key="unused", max_retries=0)
    tokenizer = server.tokenizer
    try:
        first = client.completions.create(model="rlx", prompt="12+3=", max_tokens=5).choices[0]
        second = client.completions.create(model="rlx", prompt="12+3=" + first.text + " ok", max_tokens=5).choices[0]
        [segment] = server.sessions["c/0"].segments
        traj = segment.trajectory
        assert traj.prompt_ids == tokenizer("12+3=")["input_ids"]
        (a, b, one), (_, c, zero), (_, d, one_again) = spans(traj.loss_mask)
        assert (one, zero, one_again, c - b, d) == (1, 0, 1, 3, len(traj.response_ids))
        assert tokenizer.decode(traj.response_ids[b:c]) == " ok"
        assert tokenizer.decode(traj.response_ids[c:d], skip_special_tokens=True) == second.text
        ids = traj.token_ids()
        client.completions.create(model="rlx", prompt=ids, max_tokens=3)  # token ids extend too
        assert len(server.sessions["c/0"].segments) == 1 and segment.trajectory.num_turns == 3
        client.completions.create(model="rlx", prompt="something else", max_tokens=3)
        assert [s.reason for s in server.sessions["c/0"].segments] == ["first request", "history rewritten"]
        assert server.sessions["c/0"].num_requests == 4
    finally:
        server.close()
        worker.close()


def test_worker_batches_concurrent_requests():
    model, tokenizer = random_chat_model()
    engine = token_engine(model, tokenizer)
    prompts = [tokenizer(f"{i}+{i}=", add_special_tokens=False)["input_ids"] for i in range(6)]
    requests = [TokenRequest(f"r{i}", ids, 8) for i, ids in enumerate(prompts)]
    worker = StreamWorker(engine, SAMPLING.sampling, 64, gather_s=1.0)
    try:
        futures = [worker.submit(r) for r in requests]
        together = [f.result() for f in futures]
    finally:
        worker.close()
    assert worker.num_steps == 1 and worker.largest_batch == 6  # the hf engine: one batch
    alone = [engine.generate_tokens([r], SAMPLING.sampling)[0] for r in requests]
    assert [g.response_ids for g in together] == [g.response_ids for g in alone]


def _post(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_bad_requests_get_openai_style_errors():
    server, worker = serve(random_chat_model(), max_total_tokens=20)
    client = openai.OpenAI(base_url=server.base_url("b/0"), api_key="unused", max_retries=0)
    try:
        assert [m.id for m in client.models.list()] == ["rlx"]
        with pytest.raises(openai.BadRequestError, match="'n': at most 16 choices per request, got 17"):
            client.chat.completions.create(model="rlx", messages=[{"role": "user", "content": "hi"}], n=17)
        long = [{"role": "user", "content": "x" * 40}]
        with pytest.raises(openai.BadRequestError, match=r"the limit of 20 tokens \(--max-total-tokens\)") as caught:
            client.chat.completions.create(model="rlx", messages=long)
        assert caught.value.code == "context_length_exceeded" and server.sessions["b/0"].hit_token_limit
        status, reply = _post(f"{server.url}/v1/chat/completions", b"{not json")
        assert status == 400 and "not JSON" in reply["error"]["message"]
        status, reply = _post(f"{server.url}/v1/embeddings", b"{}")
        assert status == 404 and reply["error"]["code"] == "not_found"
        status, reply = _post(f"{server.url}/v1/chat/completions", json.dumps({"messages": []}).encode())
        assert status == 400 and "'messages' must be a non-empty list" in reply["error"]["message"]
        client = openai.OpenAI(base_url=server.base_url("b/1"), api_key="unused", max_retries=0)
        text = {"type": "text", "text": ""}  # the template alone is 19 of the 20 tokens
        picture = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
        with pytest.raises(openai.BadRequestError, match="has image parts, but model type 'llama' is a text"):
            client.chat.completions.create(model="rlx", messages=[{"role": "user", "content": [text, picture]}])
        sound = {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}
        with pytest.raises(openai.BadRequestError, match="content parts of type 'input_audio' are not supported"):
            client.chat.completions.create(model="rlx", messages=[{"role": "user", "content": [text, sound]}])
        reply = client.chat.completions.create(
            model="rlx", messages=[{"role": "user", "content": [text]}], max_tokens=1
        )
        assert reply.choices[0].message.role == "assistant"  # text parts alone are read
    finally:
        server.close()
        worker.close()


def test_agent_errors_name_the_sample():
    model = random_chat_model()
    engine = token_engine(*model)
    sampling = SamplingParams(n=1, max_new_tokens=4, temperature=1.0)

    def run(agent, **cfg):
        return AgentRollout(engine, model[1], sampling, AgentConfig(**cfg), agent).generate(QUESTIONS).records

    def silent(record, base_url):
        return 1.0

    def chat_once(record, base_url):
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        client.chat.completions.create(model="rlx", messages=[{"role": "user", "content": record["prompt"]}])
        return "high" if record["id"] == "q1" else 0.5

    with pytest.raises(UserError, match="agent silent for sample q0/0: it never called its base_url"):
        run(silent)
    with pytest.raises(UserError, match="agent chat_once for sample q1/0 returned 'high', expected a finite number"):
        run(chat_once)
    records = run(chat_once, on_env_error="zero")
    assert [r.env_reward for r in records] == [0.5, 0.0]
    assert "env_error" not in records[0].extra and "returned 'high'" in records[1].extra["env_error"]
    assert records[1].finish_reason == "env_done"

    def sleepy(record, base_url):
        chat_once(record, base_url)
        time.sleep(2.0)

    with pytest.raises(UserError, match="agent sleepy for sample q0/0 timed out after 0.3 s"):
        run(sleepy, agent_timeout_s=0.3)
    with pytest.raises(UserError, match="--agent 'nowhere.py:agent': no such file"):
        run("nowhere.py:agent")
