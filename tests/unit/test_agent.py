"""Multi-turn rollouts: tool-call parsing, token-exact trajectories (Qwen2.5/Qwen3-style templates),
the environment driver over the hf engine, limits, environment errors, and the calculator task."""

from __future__ import annotations

import json
import math

import pytest

from rlx.agent.driver import EnvRollout
from rlx.agent.environment import EnvironmentFactory
from rlx.chat.tool_calls import get_tool_call_parser, parse_qwen, tool_error_messages
from rlx.chat.trajectory import ChatRenderer, Trajectory
from rlx.config import ConfigError, from_dict
from rlx.errors import UserError
from rlx.formats.records import PromptRecord
from rlx.models.tiny_chat import build_chat_tokenizer
from rlx.rollout.agent_config import AgentConfig
from rlx.rollout.config import RolloutConfig, SamplingParams
from rlx.rollout.requests import TokenRequest
from rlx.scoring.rewards import RewardFunctions
from rlx.tasks import calculator
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
from tests.conftest import cli, cli_ok


@pytest.fixture
def envs_file(tmp_path):
    path = tmp_path / "envs.py"
    path.write_text(ENVS)
    return path


def rollout(
    model_and_tokenizer, env: str, sampling: RolloutConfig | None = None, engine: str = "hf", **agent
) -> EnvRollout:
    model, tokenizer = model_and_tokenizer
    sampling = sampling or RolloutConfig(sampling=SamplingParams(n=2, max_new_tokens=12, temperature=1.0, seed=3))
    return EnvRollout(
        token_engine(model, tokenizer, engine), tokenizer, sampling.sampling, AgentConfig(env=env, **agent)
    )


# ----------------------------------------------------------------------------------------------- tool calls


def test_qwen_parser_reads_several_calls_and_strips_them_from_content():
    text = (
        'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "lookup", "arguments": "{\\"key\\": \\"x\\"}"}\n</tool_call>'
    )
    parsed = parse_qwen(text, turn=2)
    assert parsed.errors == []
    assert parsed.message["content"] == "Let me compute."
    first, second = parsed.message["tool_calls"]
    assert first == {
        "id": "call_2_0",
        "type": "function",
        "function": {"name": "calculator", "arguments": '{"expression": "12*34"}'},
    }
    assert second["id"] == "call_2_1" and json.loads(second["function"]["arguments"]) == {"key": "x"}
    assert parse_qwen("  no calls here\n", 0).message == {"role": "assistant", "content": "  no calls here\n"}


def test_qwen_parser_reports_malformed_calls_instead_of_raising():
    text = '<tool_call>{"name": "f", "arguments": {}</tool_call> ok <tool_call>[1]</tool_call><tool_call>{"name"'
    parsed = parse_qwen(text, 0)
    assert "tool_calls" not in parsed.message and parsed.message["content"] == "ok"
    assert len(parsed.errors) == 3
    assert parsed.errors[0].startswith("tool call 1 is not valid JSON")
    assert "tool call 2 must be a JSON object" in parsed.errors[1]
    assert "not closed" in parsed.errors[2]
    replies = tool_error_messages(parsed.errors)
    assert [m["role"] for m in replies] == ["tool"] * 3 and "not valid JSON" in replies[0]["content"]
    args = parse_qwen('<tool_call>{"name": "f", "arguments": 5}</tool_call>', 0).errors
    assert args == ['tool call 1 ("f"): "arguments" must be a JSON object']


def test_parser_registry():
    assert get_tool_call_parser("hermes") is parse_qwen
    plain = "<tool_call>{}</tool_call>"
    assert get_tool_call_parser("none")(plain, 0).message["content"] == plain
    with pytest.raises(UserError, match="unknown tool parser 'xml'"):
        get_tool_call_parser("xml")
    with pytest.raises(ConfigError, match="tool_parser"):
        AgentConfig(tool_parser="xml")


def test_agent_config_checks_values():
    with pytest.raises(ConfigError, match="max_turns"):
        AgentConfig(max_turns=0)
    with pytest.raises(ConfigError, match="env: expected path/file.py:NAME"):
        AgentConfig(env="envs.py")
    with pytest.raises(ConfigError, match="agent.on_env_error"):
        from_dict(AgentConfig, {"on_env_error": "ignore"}, prefix="agent")
    with pytest.raises(ConfigError, match="unknown key"):
        from_dict(AgentConfig, {"max_turn": 3})
    assert from_dict(AgentConfig, {"chat_template_kwargs": {"enable_thinking": False}}).chat_template_kwargs == {
        "enable_thinking": False
    }


def test_chat_template_kwargs_reach_single_turn_prompts():
    """chat_template_kwargs apply to every prompt an engine encodes, not only to multi-turn episodes."""
    model, tokenizer = random_chat_model("qwen3")
    record = PromptRecord(id="p", prompt="2*3")
    plain, _ = token_engine(model, tokenizer).encoder.encode(record)
    off, _ = token_engine(model, tokenizer, chat_template_kwargs={"enable_thinking": False}).encoder.encode(record)
    assert off[: len(plain)] == plain and tokenizer.decode(off[len(plain) :]) == "<think>\n\n</think>\n\n"


# ------------------------------------------------------------------------------ trajectories by hand


def model_turn(tokenizer, text: str) -> tuple[list[int], list[float]]:
    """A turn as the model would emit it: the text's tokens and <|im_end|>, with made-up logprobs."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return ids, [-0.5 - i / 100 for i in range(len(ids))]


def calculator_episode(style: str, first: str, second: str, **template_kwargs):
    """Two turns of the calculator task built from the real parts: renderer, parser, environment."""
    tokenizer = build_chat_tokenizer(style)
    env = calculator.CalculatorEnv({"prompt": "12*34", "ground_truth": "408"})
    renderer = ChatRenderer(tokenizer, {tokenizer.eos_token_id}, env.tools, template_kwargs)
    opening = env.reset()
    traj = Trajectory(renderer.opening_ids(opening), list(opening))
    rewards = []
    for k, text in enumerate([first, second]):
        ids, logprobs = model_turn(tokenizer, text)
        traj.add_model_turn(ids, logprobs)
        parsed = parse_qwen(tokenizer.decode(ids, skip_special_tokens=True), k)
        traj.messages.append(parsed.message)
        replies, reward, done = env.step(parsed.message)
        rewards.append(reward)
        if not done:
            traj.add_inserted(renderer.turn_end_ids(ids) + renderer.message_ids(replies))
            traj.messages += replies
    return tokenizer, renderer, traj, rewards


CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'


def test_trajectory_decodes_to_the_conversation_qwen25():
    tokenizer, renderer, traj, rewards = calculator_episode("qwen2.5", "I will use it.\n" + CALL, "It is 408.")
    assert rewards == [0.0, 1.0]
    function = {"name": "calculator", "arguments": '{"expression": "12*34"}'}
    assert traj.messages[1]["tool_calls"][0]["function"] == function
    assert traj.messages[2] == {"role": "tool", "tool_call_id": "call_0_0", "content": "408"}
    text = tokenizer.decode(traj.token_ids())
    assert text + "\n" == renderer.render_text(traj.messages, add_generation_prompt=False)
    # mask 1 exactly on the two model turns, logprobs 0 elsewhere
    first, _ = model_turn(tokenizer, "I will use it.\n" + CALL)
    second, second_logprobs = model_turn(tokenizer, "It is 408.")
    (a, b, one), (_, c, zero), (_, d, one_again) = spans(traj.loss_mask)
    assert (one, zero, one_again) == (1, 0, 1) and d == len(traj.response_ids)
    assert traj.response_ids[a:b] == first and traj.response_ids[c:d] == second
    assert traj.rollout_logprobs[c:d] == second_logprobs and not any(traj.rollout_logprobs[b:c])
    inserted = tokenizer.decode(traj.response_ids[b:c])
    assert inserted == "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_trajectory_keeps_the_think_blocks_a_qwen3_template_drops():
    think1, think2 = "<think>\nneed a tool\n</think>\n\n", "<think>\nread it\n</think>\n\n"
    tokenizer, renderer, traj, _ = calculator_episode("qwen3", think1 + CALL, think2 + "408")
    text = tokenizer.decode(traj.token_ids())
    assert text.count("need a tool") == 1 and text.count("read it") == 1  # both turns exactly as sampled
    opening = renderer.render_text(traj.messages[:1], add_generation_prompt=True)
    tool_turn = "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert text == opening + think1 + CALL + "<|im_end|>" + tool_turn + think2 + "408<|im_end|>"
    # after a new user message the template drops every earlier thought: re-rendering the history is
    # no longer an extension of what the model saw, but the trajectory's next tokens only append
    follow_up = [{"role": "user", "content": "and 2*3?"}]
    rerendered = renderer.render_ids([*traj.messages, *follow_up], add_generation_prompt=True)
    assert rerendered[: traj.num_tokens] != traj.token_ids()
    assert "need a tool" not in tokenizer.decode(rerendered)
    appended = renderer.turn_end_ids(traj.response_ids) + renderer.message_ids(follow_up)
    assert tokenizer.decode(appended) == "\n<|im_start|>user\nand 2*3?<|im_end|>\n<|im_start|>assistant\n"


STRICT_TEMPLATE = (  # no system role, roles must alternate (as some model families' templates insist)
    "{%- for m in messages %}{%- if m.role == 'system' %}{{ raise_exception('System role not supported') }}"
    "{%- endif %}{%- if (m.role == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('roles must alternate') }}"
    "{%- endif %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_new_message_tokens_under_other_templates():
    tokenizer = build_chat_tokenizer("qwen2.5")
    tokenizer.chat_template = STRICT_TEMPLATE
    renderer = ChatRenderer(tokenizer, {tokenizer.eos_token_id})
    more = renderer.message_ids([{"role": "user", "content": "more"}])
    assert tokenizer.decode(more) == "<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(renderer.closing_ids) == "<|im_end|>\n"
    tokenizer.chat_template = "{%- for m in messages | reverse %}{{- m.role + ':' + m.content + '\\n' }}{%- endfor %}"
    with pytest.raises(UserError, match=r"cannot add messages with roles \[user\] token-exactly: they do not extend"):
        ChatRenderer(tokenizer, {tokenizer.eos_token_id}).message_ids([{"role": "user", "content": "more"}])


def test_tokenizer_without_chat_template_is_a_clear_error(envs_file):
    tokenizer = build_chat_tokenizer(None)
    with pytest.raises(UserError, match="need a tokenizer with a chat template"):
        ChatRenderer(tokenizer, {tokenizer.eos_token_id})
    with pytest.raises(UserError, match="chat template"):
        rollout(random_chat_model(None), f"{envs_file}:Echo").generate(QUESTIONS)


# ------------------------------------------------------------------------- episodes over the hf engine


@pytest.mark.parametrize("style", ["qwen2.5", "qwen3"])
def test_env_rollout_is_token_exact(envs_file, style):
    """Each model turn is what the engine generates from exactly the tokens before it in the record; the
    inserted tokens are the template's text of the environment's reply; the text is the conversation."""
    model, tokenizer = random_chat_model(style)
    kwargs = {"enable_thinking": False} if style == "qwen3" else {}
    runner = rollout((model, tokenizer), f"{envs_file}:Echo", max_total_tokens=400, chat_template_kwargs=kwargs)
    result = runner.generate(QUESTIONS)
    records = [r.to_json() for r in result.records]
    assert [r["id"] for r in records] == ["q0/0", "q0/1", "q1/0", "q1/1"]
    gen_prompt = "<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if style == "qwen3" else "")
    turns, requests = [], []  # every model turn, generated again from the tokens before it (one batch)
    for rec in records:
        ids, mask, logprobs = rec["response_ids"], rec["loss_mask"], rec["rollout_logprobs"]
        assert len(ids) == len(mask) == len(logprobs) and all(lp == 0 for lp, m in zip(logprobs, mask) if not m)
        assert rec["finish_reason"] in ("env_done", "length")
        spans_one = [(lo, hi) for lo, hi, value in spans(mask) if value]
        assert len(spans_one) == rec["num_turns"] == sum(m["role"] == "assistant" for m in rec["messages"])
        for k, (lo, hi) in enumerate(spans_one):
            turns.append((ids[lo:hi], logprobs[lo:hi]))
            requests.append(TokenRequest(f"{rec['id']}/{k}", rec["prompt_ids"] + ids[:lo], 12))
    for (ids, logprobs), again in zip(turns, runner.engine.generate_tokens(requests, runner.sampling)):
        assert again.response_ids == ids
        assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(again.logprobs, logprobs))
    for rec in records:
        ids, mask = rec["response_ids"], rec["loss_mask"]
        for n, (lo, hi, _) in enumerate(s for s in spans(mask) if not s[2]):
            assert tokenizer.decode(ids[lo:hi]) == (
                f"\n<|im_start|>user\n<tool_response>\n{n + 1}\n</tool_response><|im_end|>\n"
                f"<|im_start|>user\nagain<|im_end|>\n{gen_prompt}"
            )
        expected_reward = 1.5 if rec["finish_reason"] == "env_done" else 0.25 * (rec["num_turns"] - 1)
        assert rec["env_reward"] == expected_reward
        assert rec["response"] == rec["messages"][-1]["content"]
        text = tokenizer.decode(rec["prompt_ids"] + ids).replace(gen_prompt, "<|im_start|>assistant\n")
        rendered = build_chat_tokenizer("qwen2.5").apply_chat_template(rec["messages"], tokenize=False)
        assert rendered.startswith(text) and rendered[len(text) :] in ("\n", "<|im_end|>\n")
    assert result.stats.episodes.finish_env_done + result.stats.episodes.finish_length == 4
    assert result.stats.tokens == sum(sum(r["loss_mask"]) for r in records)


def test_limits_end_episodes(envs_file):
    model = random_chat_model()
    capped = rollout(model, f"{envs_file}:Echo", max_turns=2).generate(QUESTIONS).records
    for rec in capped:
        assert rec.finish_reason in ("max_turns", "length") and rec.num_turns <= 2
        if rec.finish_reason == "max_turns":  # the last reply is in the messages, not in the tokens
            assert rec.messages[-1] == {"role": "user", "content": "again"}
            assert rec.loss_mask[-1] == 1 and rec.env_reward == 0.5  # both turns were stepped
    short = rollout(model, f"{envs_file}:Echo", max_total_tokens=60).generate(QUESTIONS).records
    assert {r.finish_reason for r in short} == {"length"}
    assert all(len(r.prompt_ids) + len(r.response_ids) <= 60 for r in short)
    one_token = RolloutConfig(sampling=SamplingParams(n=1, max_new_tokens=1, temperature=1.0, seed=0))
    cut = rollout(random_chat_model(stop_bias=-10.0), f"{envs_file}:Echo", one_token).generate(QUESTIONS).records
    assert [(r.finish_reason, len(r.response_ids)) for r in cut] == [("length", 1), ("length", 1)]
    reward = RewardFunctions(["env"]).compute(capped[0])
    assert reward.error is None and reward.score == capped[0].env_reward > 0
    with pytest.raises(UserError, match="opening prompt has .* not below max_total_tokens = 10"):
        rollout(model, f"{envs_file}:Echo", max_total_tokens=10).generate(QUESTIONS)


def test_malformed_tool_call_goes_back_to_the_model(envs_file):
    """A model whose every turn is `<tool_call>x</tool_call>`: each gets a tool error message, the
    environment is never stepped, and the episode ends at max_turns."""
    model, tokenizer = bigram_chat_model("\n<tool_call>x</tool_call><|im_end|>")
    sampling = RolloutConfig(sampling=SamplingParams(n=1, max_new_tokens=8, temperature=0.0))
    runner = rollout((model, tokenizer), f"{envs_file}:NeverStepped", sampling, max_turns=2)
    [rec] = runner.generate(QUESTIONS[:1]).records
    assert rec.finish_reason == "max_turns" and rec.num_turns == 2 and rec.env_reward == 0
    roles = [m["role"] for m in rec.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "tool"]
    error = rec.messages[3]["content"]
    assert error.startswith("Error: tool call 1 is not valid JSON")
    inserted = [rec.response_ids[lo:hi] for lo, hi, value in spans(rec.loss_mask) if not value]
    assert tokenizer.decode(inserted[0]) == (
        f"\n<|im_start|>user\n<tool_response>\n{error}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_tool_calls_reach_the_environment():
    """A model whose every turn calls the calculator: the calls are parsed, run by CalculatorEnv, and its
    results enter the trajectory as inserted tokens; the model's own tokens stay as it wrote them."""
    model, tokenizer = bigram_chat_model(CALC_SCRIPT, extra_tokens=CALC_PIECES)
    sampling = RolloutConfig(sampling=SamplingParams(n=1, max_new_tokens=16, temperature=1.0))
    question = PromptRecord(id="c", prompt="12*34", ground_truth="408")
    runner = rollout((model, tokenizer), "rlx.tasks.calculator:CalculatorEnv", sampling, max_turns=2)
    [rec] = runner.generate([question]).records
    assert (rec.finish_reason, rec.num_turns, rec.env_reward) == ("max_turns", 2, 0.0)
    call = {"name": "calculator", "arguments": '{"expression": "12*34"}'}
    assert rec.messages[1:] == [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0_0", "type": "function", "function": call}]},
        {"role": "tool", "tool_call_id": "call_0_0", "content": "408"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1_0", "type": "function", "function": call}]},
        {"role": "tool", "tool_call_id": "call_1_0", "content": "408"},  # the reply after the last turn
    ]
    written = "<tool_call>" + "".join(CALC_PIECES) + "</tool_call><|im_end|>"  # no newlines: not the template's
    tool_turn = "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(rec.response_ids) == written + tool_turn + written
    assert [value for _, _, value in spans(rec.loss_mask)] == [1, 0, 1]


# ---------------------------------------------------------------------------------- environment errors


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("Raises", r"sample 'q0/0': step\(\) raised ValueError: boom"),
        ("Slow", r"sample 'q0/0': step\(\) timed out after 0.2 s"),
        ("BadReward", r"sample 'q0/0': step\(\) returned reward '1', expected a finite number"),
    ],
)
def test_failing_environment_steps(envs_file, name, message):
    model = random_chat_model()
    sampling = RolloutConfig(sampling=SamplingParams(n=1, max_new_tokens=4, temperature=1.0))
    with pytest.raises(UserError, match=message):
        rollout(model, f"{envs_file}:{name}", sampling, env_timeout_s=0.2).generate(QUESTIONS)
    runner = rollout(model, f"{envs_file}:{name}", sampling, env_timeout_s=0.2, on_env_error="zero")
    result = runner.generate(QUESTIONS)
    records = result.records
    stepped = [r for r in records if r.finish_reason != "length"]  # a turn cut by max_new_tokens is not stepped
    assert stepped and all(r.finish_reason == "env_done" and r.env_reward == 0 for r in stepped)
    assert all(r.extra["env_error"].startswith(f"environment {envs_file}:{name} for sample") for r in stepped)
    assert result.stats.episodes.env_errors == len(stepped)


def test_failing_environment_start(envs_file):
    model = random_chat_model()
    with pytest.raises(UserError, match=r"sample 'q0/0': reset\(\) returned 'hello', expected a non-empty list"):
        rollout(model, f"{envs_file}:BadReset").generate(QUESTIONS)
    with pytest.raises(UserError, match=r"which has no step\(\) method"):
        rollout(model, f"{envs_file}:NoStep").generate(QUESTIONS)


def test_environment_loading_errors(envs_file, tmp_path):
    with pytest.raises(UserError, match="no such file"):
        EnvironmentFactory(f"{tmp_path}/missing.py:Env")
    with pytest.raises(UserError, match="has no attribute 'Missing'"):
        EnvironmentFactory(f"{envs_file}:Missing")
    with pytest.raises(UserError, match="is not callable"):
        EnvironmentFactory(f"{envs_file}:NOT_CALLABLE")
    with pytest.raises(UserError, match="cannot import module 'no_such_module'"):
        EnvironmentFactory("no_such_module:Env")
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('bad module')\n")
    with pytest.raises(UserError, match="importing .* failed: RuntimeError: bad module"):
        EnvironmentFactory(f"{broken}:Env")
    assert EnvironmentFactory("rlx.tasks.calculator:CalculatorEnv").factory is calculator.CalculatorEnv


# ---------------------------------------------------------------------------------------- calculator task


def test_calculator_tool_reward_and_prompts(tmp_path, monkeypatch):
    assert calculator.evaluate("(12+3)*-4 // 5") == -12
    for bad in ("2**100", "__import__('os')", "1/2", "9" * 40 + "*" + "9" * 40, "1 +"):
        with pytest.raises(ValueError):
            calculator.evaluate(bad)
    assert calculator.score("calculator", "so 12*34 = 408", "408") == 1.0
    assert calculator.score("calculator", "408 or 407", "408") == 0.0
    env = calculator.CalculatorEnv({"prompt": "12*34", "ground_truth": "408"})
    call = parse_qwen(CALL + CALL.replace("calculator", "search"), 0).message
    replies, reward, done = env.step(call)
    assert [r["content"] for r in replies] == ["408", "error: unknown tool 'search'"] and (reward, done) == (0, False)
    assert env.step({"role": "assistant", "content": "408"}) == ([], 1.0, True)
    records = calculator.generate_calculator(5, seed=1, digits=3, ops="*+")
    assert records == calculator.generate_calculator(5, seed=1, digits=3, ops="*+")
    for r in records:
        a, op, b = r["prompt"][:3], r["prompt"][3], r["prompt"][4:]
        assert 100 <= int(a) <= 999 and str(calculator.OPS[op](int(a), int(b))) == r["ground_truth"]
    out = tmp_path / "calc.jsonl"
    monkeypatch.setattr("sys.argv", ["calculator", "--out", str(out), "--num", "3"])
    calculator.main()
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["calc-0", "calc-1", "calc-2"]


def test_echo_calculator_restates_the_expression_and_its_demonstrations_answer_with_the_reply(tmp_path, monkeypatch):
    env = calculator.EchoCalculatorEnv({"prompt": "12*34", "ground_truth": "408"})
    spaced = CALL.replace('"12*34"', '"12 * 34"')
    call = parse_qwen(spaced + CALL.replace("calculator", "search"), 0).message
    replies, reward, done = env.step(call)
    assert [r["content"] for r in replies] == ["12*34=408", "error: unknown tool 'search'"]
    assert (reward, done) == (0, False)
    assert env.step({"role": "assistant", "content": "12*34=408"}) == ([], 1.0, True)
    assert calculator.CalculatorEnv.call(call["tool_calls"][0]) == "408"  # the plain tool is unchanged
    demo = calculator.demonstration({"id": "d", "prompt": "12*34", "ground_truth": "408"}, echo=True)
    assert [m.get("content") for m in demo["messages"][2:]] == ["12*34=408", "12*34=408"]
    demos = calculator.generate_demonstrations(3, digits=2, echo=True)
    assert [d["messages"][0]["content"] for d in demos] == [
        d["messages"][0]["content"] for d in calculator.generate_demonstrations(3, digits=2)
    ]
    out = tmp_path / "demos.jsonl"
    argv = ["calculator", "--demos", "--echo", "--digits", "2", "--num", "3", "--seed", "1", "--out", str(out)]
    monkeypatch.setattr("sys.argv", argv)
    calculator.main()
    assert [json.loads(line) for line in out.read_text().splitlines()] == demos


def test_stage_writes_multi_turn_records(tmp_path):
    model, tokenizer = random_chat_model()
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in calculator.generate_calculator(3, digits=2)))
    out, metrics = tmp_path / "rollouts.jsonl", tmp_path / "metrics.jsonl"
    args = ["rollout", "--model", tmp_path / "model", "--prompts", prompts, "--out", out, "--num-prompts", "2"]
    args += ["--n", "2", "--max-new-tokens", "6", "--temperature", "1.0", "--seed", "5", "--max-turns", "2"]
    cli_ok(*args, "--env", "rlx.tasks.calculator:CalculatorEnv", "--metrics", metrics)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in lines] == ["calc-0/0", "calc-0/1", "calc-1/0", "calc-1/1"]
    for r in lines:
        assert {"loss_mask", "messages", "num_turns", "env_reward", "finish_reason", "rollout_logprobs"} <= r.keys()
        assert r["messages"][0] == {"role": "user", "content": r["prompt"]} and r["data_source"] == "calculator"
        assert r["finish_reason"] in ("env_done", "length", "max_turns") and r["num_turns"] <= 2
        assert tokenizer.decode(r["prompt_ids"]).startswith(
            "<|im_start|>system\nTools:\n<tools>\ncalculator(expression)"
        )
    line = json.loads(metrics.read_text())
    assert line["env/reward_mean"] == sum(r["env_reward"] for r in lines) / 4
    assert line["rollout/tokens"] == sum(sum(r["loss_mask"]) for r in lines)
    both = cli(*args, "--env", "rlx.tasks.calculator:CalculatorEnv", "--agent", "a.py:f")
    assert both.exit_code == 1 and "an environment (env) or an agent, not both" in both.stderr
