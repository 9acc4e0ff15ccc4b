"""An openai-agents Agent with a function tool trained by `rlx ppo`: the agent rlx.agent.openai_agents_agent:
OpenAIAgentsAgent runs the user's Agent of recipes/openai_agents_add.py (an `add` tool that notes its calls in the run's
context, the prompt record) for each sample with its model pointed at the sample's own base URL, through openai-agents'
own Runner and OpenAIChatCompletionsModel (Responses model and streaming in the rollout tests). Every record is the
token-exact trajectory of its run (tool results out of the loss), its reward is the recipe's reward function of the
run's final output. Skipped where openai-agents is not installed (pip install 'rlx[agents]')."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from rlx.errors import UserError
from rlx.rollout.agent_config import AgentConfig, OpenAIAgentsConfig
from tests.agent_helpers import bigram_chat_model
from tests.conftest import REPO, cli, read_jsonl

pytest.importorskip("agents", reason="openai-agents is not installed (pip install 'rlx[agents]')")

AGENT = "rlx.agent.openai_agents_agent:OpenAIAgentsAgent"
RECIPE = REPO / "recipes" / "openai_agents_add.toml"
USER_CODE = REPO / "recipes" / "openai_agents_add.py"
CASES = Path(__file__).parent / "workers" / "openai_agents_cases.py"
ADD_PIECES = ('{"name": ', '"add"', ', "arguments": ', '{"a": 1, "b": 2', "}}")
CALL = "<tool_call>" + "".join(ADD_PIECES) + "</tool_call><|im_end|>"
ANSWER = "3<|im_end|>"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny model whose every turn is, at even odds, the answer '3' or a call of add(1, 2): a bigram model over
    the call's tokens whose first token (after the template's 'assistant\\n') may also be '3'."""
    model, tokenizer = bigram_chat_model("\n" + CALL, extra_tokens=ADD_PIECES)
    (newline,) = tokenizer("\n", add_special_tokens=False)["input_ids"]
    (three,) = tokenizer("3", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        model.lm_head.weight[three, newline + 1] = 10.0  # as high as the call's opening
    path = tmp_path_factory.mktemp("oa") / "model"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def turns_of(record: dict, tokenizer) -> list[str]:
    """The sampled turns of a record: each run of loss-mask-1 tokens, decoded."""
    turns, current = [], []
    for token, mask in zip(record["response_ids"], record["loss_mask"]):
        if mask:
            current.append(token)
        elif current:
            turns.append(current)
            current = []
    return [tokenizer.decode(t) for t in [*turns, current] if t]


def test_ppo_trains_an_openai_agents_agent_with_its_tool_and_reward(tmp_path, model_dir):
    """2 steps x 3 prompts x 2 samples, max_turns 2: a run either answers '3' (reward 1 where the question's answer
    is 3), or calls add, whose result goes back, then answers or calls again (then it stops at max_turns: output None,
    reward 0). Each record is one segment: sampled turns exactly the model's, the tool's result between them out of
    the loss, prompt tokens the template over the agent's instructions, the question and its tool."""
    sets = [f"model.path={model_dir}", "model.init=pretrained", "steps=2", "rollout.sampling.n=2",
            "rollout.sampling.max_new_tokens=16", "rollout.agent.max_turns=2", "train.mini_batch_size=6",
            "train.micro_batch_size=6", f"rollout.agent.openai_agents.agent={USER_CODE}:agent",
            f"rollout.agent.openai_agents.reward={USER_CODE}:reward"]  # fmt: skip
    done = cli("ppo", RECIPE, "--out", tmp_path / "run", *[a for s in sets for a in ("--set", s)])
    assert done.exit_code == 0, done.stderr[-3000:]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    records = [r for step in (1, 2) for r in read_jsonl(tmp_path / "run" / f"step_00000{step}" / "rollouts.jsonl")]
    assert len(records) == 12
    num_calls = 0
    for record in records:
        assert record["num_segments"] == 1 and "env_error" not in record
        system, asked, *rest = record["messages"]
        assert system["content"].startswith("Use the add tool")
        assert asked == {"role": "user", "content": record["prompt"]}
        assert [t["function"]["name"] for t in record["tools"]] == ["add"]
        rendered = tokenizer.apply_chat_template([system, asked], tools=record["tools"], add_generation_prompt=True)
        assert record["prompt_ids"] == rendered["input_ids"]
        turns = turns_of(record, tokenizer)
        assert len(turns) == record["num_turns"] <= 2 and set(turns) <= {CALL, ANSWER}
        assert all(t == CALL for t in turns[:-1])  # a run goes on only after a tool call
        # each call but a last one (the run stopped at max_turns) had its result sent back, before the next turn
        assert [m["content"] for m in rest if m["role"] == "tool"] == ["3"] * (len(turns) - 1)
        env_text = tokenizer.decode([t for t, m in zip(record["response_ids"], record["loss_mask"]) if not m])
        assert env_text.count("<tool_response>\n3\n</tool_response>") == len(turns) - 1
        if len(turns) == 2:  # between the turns: the template's rendering of the tool result, as the request sent it
            request = tokenizer.apply_chat_template(
                record["messages"][:-1], tools=record["tools"], add_generation_prompt=True, tokenize=False
            )
            assert env_text.startswith("\n<|im_start|>user\n<tool_response>") and request.endswith(env_text)
        answered = turns[-1] == ANSWER
        assert record["env_reward"] == float(answered and record["ground_truth"] == "3")
        assert len(record["rollout_logprobs"]) == len(record["response_ids"])
        num_calls += turns.count(CALL)
    assert num_calls > 0 and any(r["num_turns"] == 2 for r in records) and any(r["env_reward"] == 1.0 for r in records)
    assert any(r["env_reward"] == 0.0 for r in records)
    metrics = [m for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "step" in m]
    assert sorted({m["step"] for m in metrics}) == [1, 2]
    assert (tmp_path / "run" / "checkpoints" / "step_000002").is_dir()


def rollout(tmp_path: Path, model_dir: Path, agent: str, reward: str, *more: str):
    prompts = REPO / "recipes" / "data" / "openai_agents_add.jsonl"
    return cli("rollout", "--model", model_dir, "--prompts", prompts, "--out", tmp_path / "rollouts.jsonl", "--n", "1",
               "--max-new-tokens", "16", "--seed", "1", "--agent", AGENT, "--max-turns", "2",
               "--openai-agents-agent", agent, "--openai-agents-reward", reward, *more)  # fmt: skip


def test_openai_agents_rollout_streams_on_both_models_and_names_failures(tmp_path, model_dir):
    """Streamed runs (Runner.run_streamed) on the Responses model give the same kind of records; a reward function
    that raises, or a run that fails in the SDK, stops the run naming the sample and the cause (--on-env-error raise)
    or scores that sample 0 with the error kept in its record (zero); a request the server refuses (the agent's own
    temperature) names the field; a function that gives no Agent says so."""
    streamed = rollout(tmp_path / "s", model_dir, f"{USER_CODE}:agent", f"{USER_CODE}:reward",
                       "--openai-agents-api", "responses", "--openai-agents-stream")  # fmt: skip
    assert streamed.exit_code == 0, streamed.stderr[-3000:]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for record in read_jsonl(tmp_path / "s" / "rollouts.jsonl"):
        turns = turns_of(record, tokenizer)
        assert record["num_segments"] == 1 and set(turns) <= {CALL, ANSWER} and "env_error" not in record
        assert record["env_reward"] == float(turns[-1] == ANSWER and record["ground_truth"] == "3")

    picky = f"{CASES}:picky_reward"
    raised = rollout(tmp_path / "r", model_dir, f"{USER_CODE}:agent", picky)
    assert raised.exit_code == 1
    assert (f"sample 'add-1/0': the reward function {picky} raised ValueError: no reward for add-1 "
            "(--on-env-error zero scores such samples 0 instead)") in raised.stderr  # fmt: skip
    zero = rollout(tmp_path / "z", model_dir, f"{USER_CODE}:agent", picky, "--on-env-error", "zero")
    assert zero.exit_code == 0, zero.stderr[-3000:]
    by_id = {r["prompt_id"]: r for r in read_jsonl(tmp_path / "z" / "rollouts.jsonl")}
    assert [by_id[p]["env_reward"] for p in ("add-0", "add-1", "add-2")] == [1.0, 0.0, 1.0]
    assert "no reward for add-1" in by_id["add-1"]["env_error"] and "env_error" not in by_id["add-0"]

    # a run the SDK fails (the model calls a tool the agent lacks): its record is kept, scored 0, with the error
    without = f"{CASES}:without_add"
    failed = rollout(tmp_path / "f", model_dir, without, f"{USER_CODE}:reward")
    why = f"sample 'add-0/0': the openai-agents run of {without} failed: ModelBehaviorError: Tool add not found"
    assert failed.exit_code == 1 and why in failed.stderr
    kept = rollout(tmp_path / "k", model_dir, without, f"{USER_CODE}:reward", "--on-env-error", "zero")
    assert kept.exit_code == 0, kept.stderr[-3000:]
    for record in read_jsonl(tmp_path / "k" / "rollouts.jsonl"):
        called = turns_of(record, tokenizer) == [CALL]
        assert record["env_reward"] == 0.0 and ("env_error" in record) == called
        assert record["finish_reason"] == ("env_done" if called else "stop")
    errors = [r.get("env_error", "") for r in read_jsonl(tmp_path / "k" / "rollouts.jsonl")]
    assert any("Tool add not found in agent mul only" in e for e in errors)

    colder = rollout(tmp_path / "c", model_dir, f"{CASES}:colder", f"{USER_CODE}:reward")
    assert colder.exit_code == 1
    assert f"sample 'add-0/0': the openai-agents run of {CASES}:colder failed: HTTP 400:" in colder.stderr
    assert "temperature" in colder.stderr
    wrong = rollout(tmp_path / "w", model_dir, f"{CASES}:not_an_agent", f"{USER_CODE}:reward")
    assert wrong.exit_code == 1 and "returned str for prompt 'add-0', expected an agents.Agent" in wrong.stderr


def test_openai_agents_table_goes_with_its_agent():
    """The shipped recipe reads as documented; the table and the agent come together."""
    from rlx.ppo.config import load_recipe

    agent = load_recipe(RECIPE).rollout.agent
    assert agent.agent == AGENT and agent.openai_agents.agent == "recipes/openai_agents_add.py:agent"
    assert agent.openai_agents.api == "chat" and agent.max_turns == 3
    with pytest.raises(UserError, match=f"agent = '{AGENT}'"):
        AgentConfig(agent="a.py:f", openai_agents=OpenAIAgentsConfig(agent="a.py:x", reward="a.py:r"))
    with pytest.raises(UserError, match="needs its table"):
        AgentConfig(agent=AGENT)
    with pytest.raises(UserError, match="reward"):
        OpenAIAgentsConfig(agent="a.py:x", reward="nothing")


def test_openai_agents_agent_set_up_errors_are_one_line(monkeypatch):
    """Without openai-agents, or with an `agent` that is neither an Agent nor a function: a UserError naming it."""
    from rlx.agent.openai_agents_agent import OpenAIAgentsAgent

    def config(agent: str) -> AgentConfig:
        table = OpenAIAgentsConfig(agent=agent, reward=f"{USER_CODE}:reward")
        return AgentConfig(agent=AGENT, openai_agents=table)

    with pytest.raises(UserError, match=r"rollout.agent.openai_agents.agent '.*:__doc__': expected an agents.Agent"):
        OpenAIAgentsAgent(config(f"{CASES}:__doc__"))
    with pytest.raises(UserError, match="no such file"):
        OpenAIAgentsAgent(config("no/such/file.py:agent"))
    monkeypatch.setitem(sys.modules, "agents", None)  # as if not installed
    with pytest.raises(UserError, match=r"cannot import openai-agents .*pip install 'rlx\[agents\]'"):
        OpenAIAgentsAgent(config(f"{USER_CODE}:agent"))
