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
from tests.conftest import REPO, cli, read_jsonl

CLIENT_PYTHON = REPO / ".venv-verifiers" / "bin" / "python"
TASKSETS = Path(__file__).parent / "workers"
ANSWERS = {"What is 1+2?": "3", "What is 2+2?": "4", "What is 3+4?": "7"}  # verifiers_arith's questions
AGENT = "rlx.agent.verifiers_agent:VerifiersAgent"
RECIPE = REPO / "recipes" / "verifiers_arith.toml"

needs_client = pytest.mark.skipif(
    not CLIENT_PYTHON.exists(), reason="verifiers' client venv is absent (make setup-test makes it)"
)


def ppo(root: Path, *sets: str):
    """`rlx ppo` on the shipped recipe for 2 steps of 3 tasks x 2 samples, on a tiny model that answers '3' to anything
    (saved under `root` once); `sets` are more overrides."""
    if not (root / "model").is_dir():
        model, tokenizer = bigram_chat_model("\n3<|im_end|>")
        model.save_pretrained(root / "model")
        tokenizer.save_pretrained(root / "model")
    defaults = [f"model.path={root / 'model'}", "model.init=pretrained", "steps=2", "rollout.sampling.n=2",
                "rollout.sampling.max_new_tokens=4", "train.mini_batch_size=6", "train.micro_batch_size=6",
                f"rollout.agent.verifiers.python={CLIENT_PYTHON}",
                f"rollout.agent.verifiers.python_path={json.dumps([str(TASKSETS)])}"]  # fmt: skip
    return cli("ppo", RECIPE, "--out", root / "run", *[a for s in [*defaults, *sets] for a in ("--set", s)])


@needs_client
@pytest.mark.slow
def test_ppo_trains_a_verifiers_environment_with_its_rewards(tmp_path):
    """~1 min (one verifiers worker for the run, 2 steps x 3 tasks x 2 samples): each sample's record holds the one
    rollout verifiers played under its base URL (its trace id kept from X-Session-ID), its reward is verifiers' (1
    where the reply holds the task's answer), prompt tokens are the chat template over the task's question, sampled
    tokens decode to the reply."""
    done = ppo(tmp_path)
    assert done.exit_code == 0, done.stderr[-3000:]
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    records = [r for step in (1, 2) for r in read_jsonl(tmp_path / "run" / f"step_00000{step}" / "rollouts.jsonl")]
    assert len(records) == 12 and {r["prompt_id"] for r in records} == {"arith-0", "arith-1", "arith-2"}
    trace_ids = set()
    for record in records:
        (asked,) = record["messages"][:1]
        question = asked["content"]
        assert asked["role"] == "user" and question == list(ANSWERS)[int(record["prompt_id"][-1])]
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
    """~70 s (three workers start): no such venv, a taskset verifiers cannot find, prompts that do not name their task,
    a verifiers episode that fails (its client asks for another temperature than the run's): one line each."""
    missing = ppo(tmp_path / "a", f"rollout.agent.verifiers.python={tmp_path / 'none' / 'python'}")
    assert missing.exit_code == 1 and "rollout.agent.verifiers.python: no such file" in missing.stderr
    unknown = ppo(tmp_path / "b", "rollout.agent.verifiers.env=no-such-taskset")
    assert unknown.exit_code == 1
    assert "cannot load 'no-such-taskset': taskset 'no-such-taskset' not found" in unknown.stderr
    untold = ppo(tmp_path / "c", "rollout.agent.verifiers.task_key=task")
    assert untold.exit_code == 1
    assert "prompt 'arith-0': field 'task' must be the index of a task of 'verifiers-arith' (0 to 2), got None" in (
        untold.stderr
    )
    args = ["--env.agent.harness.id", "null", "--env.agent.runtime.type", "subprocess", "--sampling.temperature", "0.5"]
    colder = ppo(tmp_path / "d", f"rollout.agent.verifiers.args={json.dumps(args)}")
    assert (
        colder.exit_code == 1
        and "sample 'arith-0/0': the verifiers episode of task 0 of 'verifiers-arith' failed" in (colder.stderr)
    )
    assert "this rollout samples with the run's temperature = 1.0 (--temperature), got 0.5" in colder.stderr


def test_verifiers_table_goes_with_its_agent():
    """The shipped recipe reads as documented; the table and the agent come together; rlx's own options are refused."""
    from rlx.ppo.config import load_recipe

    agent = load_recipe(RECIPE).rollout.agent
    assert agent.agent == AGENT and agent.verifiers.env == "verifiers-arith"
    assert agent.verifiers.args[:2] == ["--env.agent.harness.id", "null"]
    with pytest.raises(UserError, match="agent = 'rlx.agent.verifiers_agent:VerifiersAgent'"):
        AgentConfig(agent="a.py:f", verifiers=VerifiersConfig(env="x"))
    with pytest.raises(UserError, match="needs its table"):
        AgentConfig(agent=AGENT)
    with pytest.raises(UserError, match="--model is set by rlx"):
        VerifiersConfig(env="x", args=["--model", "m"])
