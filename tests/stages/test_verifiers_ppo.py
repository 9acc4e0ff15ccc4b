"""A verifiers 0.4 environment trained by `rlx ppo`: the agent rlx.agent.verifiers_agent:VerifiersAgent plays the
in-memory arithmetic taskset (tests/stages/workers/verifiers_arith, verifiers' `null` harness, which streams every
turn and names it by X-Session-ID) for each sample against the sample's own base URL. Every sample's reward is the
one verifiers' rubric gave, its record is token-exact, the step trains. The client lives in its own venv
(.venv-verifiers, made by `make setup-test`); without it the test is skipped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rlx.errors import UserError
from rlx.rollout.agent_config import AgentConfig, VerifiersConfig
from tests.agent_helpers import bigram_chat_model
from tests.conftest import REPO, cli, cli_ok, read_jsonl

CLIENT_PYTHON = REPO / ".venv-verifiers" / "bin" / "python"
TASKSETS = Path(__file__).parent / "workers"
ANSWERS = {"What is 1+2?": "3", "What is 2+2?": "4", "What is 3+4?": "7"}  # verifiers_arith's questions
AGENT = "rlx.agent.verifiers_agent:VerifiersAgent"

needs_client = pytest.mark.skipif(
    not CLIENT_PYTHON.exists(), reason="verifiers' client venv is absent (make setup-test makes it)"
)


def write_recipe(
    root: Path, python: Path = CLIENT_PYTHON, env: str = "verifiers-arith", task_key: str = "verifiers_task"
) -> Path:
    """A two-step recipe on a model that answers '3' to anything; prompts 0-2 name the taskset's three tasks (in their
    field `task_key`)."""
    model, tokenizer = bigram_chat_model("\n3<|im_end|>")
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    lines = [{"id": f"q{i}", "prompt": "(the verifiers task's own)", task_key: i} for i in range(3)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    vf_args = ["--env.agent.harness.id", "null", "--env.agent.runtime.type", "subprocess"]
    recipe = f"""
steps = 2
[model]
path = "model"
[data]
prompts = "prompts.jsonl"
prompts_per_step = 3
[rollout]
engine = "native"
[rollout.sampling]
n = 2
max_new_tokens = 4
temperature = 1.0
[rollout.agent]
agent = "{AGENT}"
max_total_tokens = 64
[rollout.agent.verifiers]
env = "{env}"
python = "{python}"
python_path = ["{TASKSETS}"]
args = {json.dumps(vf_args)}
[score]
reward = "env"
[train]
mini_batch_size = 6
micro_batch_size = 6
[train.optim]
lr = 1e-3
"""
    (root / "recipe.toml").write_text(recipe)
    return root / "recipe.toml"


@needs_client
@pytest.mark.slow
def test_ppo_trains_a_verifiers_environment_with_its_rewards(tmp_path):
    """~1 min (one verifiers worker for the run, 2 steps x 3 tasks x 2 samples): each sample's record holds the one
    rollout verifiers played under its base URL (its trace id kept from X-Session-ID), its reward is verifiers' (1
    where the reply holds the task's answer), prompt tokens are the chat template over the task's question, sampled
    tokens decode to the reply."""
    recipe = write_recipe(tmp_path)
    cli_ok("ppo", recipe, "--out", tmp_path / "run")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    records = [r for step in (1, 2) for r in read_jsonl(tmp_path / "run" / f"step_00000{step}" / "rollouts.jsonl")]
    assert len(records) == 12 and {r["prompt_id"] for r in records} == {"q0", "q1", "q2"}
    trace_ids = set()
    for record in records:
        (asked,) = record["messages"][:1]
        question = asked["content"]
        assert asked["role"] == "user" and question == list(ANSWERS)[int(record["prompt_id"][1:])]
        assert record["env_reward"] == float(ANSWERS[question] in record["response"])
        assert record["num_segments"] == 1 and record["num_turns"] == 1 and "env_error" not in record
        (trace_id,) = record["client_session_ids"]  # verifiers' trace id for the rollout, one per sample
        trace_ids.add(trace_id)
        assert record["prompt_ids"] == tokenizer.apply_chat_template([asked], add_generation_prompt=True)["input_ids"]
        ids = record["response_ids"]
        if record["finish_reason"] == "stop":
            assert ids[-1] == tokenizer.eos_token_id
            ids = ids[:-1]
        assert tokenizer.decode(ids) == record["response"]
        assert len(record["rollout_logprobs"]) == len(record["response_ids"]) == sum(record["loss_mask"])
    assert len(trace_ids) == 12
    assert any(r["env_reward"] == 1.0 for r in records)  # the model answers '3': task 0 is solved
    metrics = [m for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "step" in m]
    assert sorted({m["step"] for m in metrics}) == [1, 2]
    assert (tmp_path / "run" / "checkpoints" / "step_000002").is_dir()


@needs_client
@pytest.mark.slow
def test_verifiers_agent_errors_name_the_problem(tmp_path):
    """~45 s (two workers start): no such venv, a taskset verifiers cannot find, prompts that do not name their task:
    one line each."""
    missing = cli("ppo", write_recipe(tmp_path, python=tmp_path / "none" / "python"), "--out", tmp_path / "a")
    assert missing.exit_code == 1 and "rollout.agent.verifiers.python: no such file" in missing.stderr
    unknown = cli("ppo", write_recipe(tmp_path, env="no-such-taskset"), "--out", tmp_path / "b")
    assert unknown.exit_code == 1 and "cannot load 'no-such-taskset': taskset 'no-such-taskset' not found" in (
        unknown.stderr
    )
    untold = cli("ppo", write_recipe(tmp_path, task_key="task"), "--out", tmp_path / "c")
    assert untold.exit_code == 1
    assert (
        "prompt 'q0': field 'verifiers_task' must be the index of a task of 'verifiers-arith' (0 to 2), got None"
        in (untold.stderr)
    )


def test_verifiers_table_goes_with_its_agent():
    with pytest.raises(UserError, match="agent = 'rlx.agent.verifiers_agent:VerifiersAgent'"):
        AgentConfig(agent="a.py:f", verifiers=VerifiersConfig(env="x"))
    with pytest.raises(UserError, match="needs its table"):
        AgentConfig(agent=AGENT)
    with pytest.raises(UserError, match="--model is set by rlx"):
        VerifiersConfig(env="x", args=["--model", "m"])
