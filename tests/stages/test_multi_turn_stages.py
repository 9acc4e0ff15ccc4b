"""Multi-turn through the stage commands: `rlx rollout --env` -> `rlx score` -> `rlx train-step` with every
estimator and policy loss, environment tokens out of every loss and metric (a batch whose environment positions
are changed trains to the same weights), `rlx serve` driven by the real openai client, torchrun 2 ranks == 1,
the calculator recipe's shell pipeline == `rlx ppo`, and `rlx report` with turns and environment reward."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

from rlx.algorithms.advantages import ESTIMATORS
from rlx.algorithms.losses import POLICY_LOSSES
from rlx.models.loading import read_weights
from tests.agent_helpers import random_chat_model
from tests.conftest import REPO, cli, cli_env, cli_ok, read_jsonl, torchrun
from tests.stages.test_ppo import assert_same_weights, stable

TURNS_ENV = '''
class Turns:
    """Up to three turns; each step's reward depends on the reply's length, so samples differ."""

    def __init__(self, record):
        self.question, self.turns = record["prompt"], 0

    def reset(self):
        return [{"role": "user", "content": self.question}]

    def step(self, message):
        self.turns += 1
        reward = (len(message["content"]) % 3) / 2
        if self.turns == 3:
            return [], reward, True
        return [{"role": "tool", "content": str(self.turns)}, {"role": "user", "content": "more"}], reward, False
'''

ROLLOUT = ["--n", "2", "--max-new-tokens", "10", "--temperature", "1.0", "--seed", "4", "--max-total-tokens", "200"]


@pytest.fixture(scope="module")
def chat(tmp_path_factory) -> Path:
    """A random tiny chat model on disk, a prompts file, the Turns environment and one multi-turn rollouts file."""
    root = tmp_path_factory.mktemp("chat")
    model, tokenizer = random_chat_model(stop_bias=0.5)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    (root / "envs.py").write_text(TURNS_ENV)
    (root / "prompts.jsonl").write_text(
        "".join(json.dumps({"id": f"p{i}", "prompt": f"hi {i}"}) + "\n" for i in range(4))
    )
    cli_ok(*rollout_args(root, root / "rollouts.jsonl"))
    cli_ok("shard", "--role", "critic", "--model", root / "model", "--out", root / "critic")
    return root


def rollout_args(root: Path, out: Path) -> list:
    return ["rollout", "--model", root / "model", "--prompts", root / "prompts.jsonl", "--out", out,
            "--env", f"{root}/envs.py:Turns", *ROLLOUT]  # fmt: skip


def score(root: Path, out: Path, *extra) -> dict[str, torch.Tensor]:
    cli_ok("score", "--rollouts", root / "rollouts.jsonl", "--actor", root / "model", "--ref", root / "model",
           "--reward", "env", "--out", out, *extra)  # fmt: skip
    return load_file(out / "batch.safetensors")


def test_rollouts_hold_several_turns_with_environment_tokens(chat):
    records = read_jsonl(chat / "rollouts.jsonl")
    assert len(records) == 8 and any(r["num_turns"] > 1 for r in records)
    assert any(0 in r["loss_mask"] for r in records)  # environment tokens inside the responses
    assert len({r["env_reward"] for r in records}) > 1


@pytest.mark.parametrize("estimator", sorted(set(ESTIMATORS) - {"remax"}))
def test_every_estimator_leaves_environment_tokens_out(chat, tmp_path, estimator):
    extra = ["--critic", chat / "critic"] if estimator == "gae" else []
    batch = score(chat, tmp_path, "--estimator", estimator, "--kl-coef", "0.1", *extra)
    env_tokens = batch["response_mask"] & ~batch["loss_mask"]
    assert env_tokens.any() and batch["advantages"][batch["loss_mask"]].abs().sum() > 0
    for name in ("advantages", "returns", "rollout_logprobs"):  # old/ref: the models' logprobs, never read there
        assert not batch[name][env_tokens].any(), name


def test_remax_needs_greedy_baselines(chat, tmp_path):
    out = cli("score", "--rollouts", chat / "rollouts.jsonl", "--actor", chat / "model", "--reward", "env",
              "--estimator", "remax", "--out", tmp_path)  # fmt: skip
    assert out.exit_code == 1 and "remax" in out.stderr.lower()


@pytest.mark.parametrize("loss", sorted(POLICY_LOSSES))
def test_environment_positions_do_not_change_the_update(chat, tmp_path, loss):
    """Every value a batch holds at environment positions (advantages, returns, all logprobs, values) is changed:
    the update and every train metric stay the same; the same change at one model token changes the weights."""
    batch = score(chat, tmp_path / "scored", "--estimator", "grpo", "--kl-coef", "0.05")
    args = ["--lr", "1e-2", "--policy-loss", loss, "--kl-loss-coef", "0.1", "--entropy-coef", "0.01",
            "--rollout-is", "token", "--seed", "1"]  # fmt: skip

    def train(name: str, tensors: dict) -> tuple[Path, dict]:
        path = tmp_path / f"{name}.safetensors"
        save_file(tensors, path, metadata=load_meta(tmp_path / "scored" / "batch.safetensors"))
        out, metrics = tmp_path / name, tmp_path / f"{name}.jsonl"
        cli_ok("train-step", "--checkpoint", chat / "model", "--batch", path, "--out", out, "--metrics", metrics, *args)
        line = {k: v for k, v in read_jsonl(metrics)[-1].items() if not k.startswith(("timing/", "perf/", "time"))}
        return out, line

    env_tokens = batch["response_mask"] & ~batch["loss_mask"]
    changed = {k: v.clone() for k, v in batch.items()}
    noise = torch.Generator().manual_seed(0)
    for name in ("advantages", "returns", "old_logprobs", "ref_logprobs", "rollout_logprobs"):
        changed[name][env_tokens] = torch.randn(int(env_tokens.sum()), generator=noise) - 3.0
    same, metrics = train("same", batch)
    other, other_metrics = train("env_changed", changed)
    assert_same_weights(same, other)
    assert metrics == other_metrics
    row, col = (batch["loss_mask"]).nonzero()[0].tolist()
    changed["advantages"][row, col] += 5.0
    moved, _ = train("model_token_changed", changed)
    assert any(not torch.equal(a, b) for a, b in zip(read_weights(same).values(), read_weights(moved).values()))


def load_meta(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.metadata()


@pytest.mark.slow
def test_serve_command_records_the_openai_clients_trajectory(chat, tmp_path):
    """~20 s (a process start-up): `rlx serve` in its own process, two chat turns of one sample through the
    openai client; the trajectory it writes on exit holds the conversation, the tool message out of the mask."""
    out = tmp_path / "served.jsonl"
    command = [sys.executable, "-m", "rlx", "serve", "--model", chat / "model", "--port", "0", "--max-requests",
               "2", "--out", out, "--max-new-tokens", "8", "--seed", "2"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([str(c) for c in command], stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        url = wait_for_url(proc)
        client = openai.OpenAI(base_url=f"{url}/s/p0%2F0/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "hi"}]
        first = client.chat.completions.create(model="rlx", messages=messages).choices[0].message
        messages += [first.model_dump(exclude_none=True), {"role": "tool", "content": "42"}]
        second = client.chat.completions.create(model="rlx", messages=messages).choices[0].message
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
    finally:
        proc.kill()
    (record,) = read_jsonl(out)
    assert record["id"] == "p0/0" and record["num_turns"] == 2 and record["prompt"] == [messages[0]]
    assert [m["content"] for m in record["messages"]] == ["hi", first.content, "42", second.content]
    mask = record["loss_mask"]
    assert 0 in mask and mask[0] == 1 and len(mask) == len(record["response_ids"])


def wait_for_url(proc: subprocess.Popen) -> str:
    for line in proc.stderr:
        if " on http://" in line:
            return line.split(" on ", 1)[1].split("/v1", 1)[0]
    raise AssertionError(f"rlx serve exited ({proc.wait()}) without printing its URL")


def test_serve_refuses_bad_settings(chat):
    out = cli("serve", "--model", chat / "model", "--port", "70000")
    assert out.exit_code == 1 and "--port must be in [0, 65535]" in out.stderr


@pytest.mark.slow
def test_two_ranks_give_the_records_of_one(chat, tmp_path):
    """~25 s: each rank runs the episodes of its share of the prompts; the gathered records are the same."""
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    cli_ok(*rollout_args(chat, one))
    args = [str(a) for a in rollout_args(chat, two)]
    args[args.index("--n")] = "--num-samples"  # torchrun's own parser takes --n
    torchrun(2, *args)
    ones, twos = read_jsonl(one), read_jsonl(two)
    assert len(ones) == len(twos) == 8
    for a, b in zip(ones, twos):  # batches differ per rank: logprobs agree up to float error
        la, lb = a.pop("rollout_logprobs"), b.pop("rollout_logprobs")
        assert a == b and len(la) == len(lb) and all(abs(x - y) < 1e-5 for x, y in zip(la, lb))


def assert_same_records(ours: list[dict], theirs: list[dict], name: str) -> None:
    """The same records: every field equal, but float lists (logprobs) to 1e-5. Episodes' turns are batched as their
    environments answer, so the decode batches, and a CPU matmul's rounding with them, depend on timing."""
    assert len(ours) == len(theirs), name
    for a, b in zip(ours, theirs, strict=True):
        assert sorted(a) == sorted(b), name
        for key, value in a.items():
            floats = isinstance(value, float) or (isinstance(value, list) and all(isinstance(x, float) for x in value))
            if floats and value:
                assert value == pytest.approx(b[key], abs=1e-5), (name, a["id"], key)
            else:
                assert value == b[key], (name, a["id"], key)


@pytest.mark.slow
def test_calculator_shell_pipeline_equals_ppo(tmp_path):
    """~55 s: recipes/calculator.sh (two [sft] steps, one RL step) gives the SFT metrics and step-0 weights, the
    rollouts, scores, metrics and weights of `rlx ppo`; then `rlx report` shows the turns per sample and the
    environment reward."""
    env = cli_env(STEPS="1", SEED="2", PROMPTS_PER_STEP="4", N="2", OMP_NUM_THREADS="1", SFT_MAX_STEPS="2")
    script = REPO / "recipes" / "calculator.sh"
    done = subprocess.run(["bash", str(script), str(tmp_path / "sh")], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    recipe = REPO / "recipes" / "calculator.toml"
    small = ["--set", "data.prompts_per_step=4", "--set", "rollout.sampling.n=2", "--set", "save_every=1"]
    cli_ok("ppo", recipe, "--out", tmp_path / "ppo", "--set", "steps=1", "--set", "seed=2", "--set", "sft.max_steps=2",
           *small)  # fmt: skip
    sh, ppo = tmp_path / "sh", tmp_path / "ppo"
    for step in (0, 1):
        assert_same_weights(sh / "checkpoints" / f"step_00000{step}", ppo / "checkpoints" / f"step_00000{step}")
    for name in ("sft_metrics.jsonl", "metrics.jsonl"):
        assert stable(read_jsonl(sh / name)) == stable(read_jsonl(ppo / name)), name
    assert len(read_jsonl(ppo / "sft_metrics.jsonl")) == 2
    for name in ("rollouts.jsonl", "scores.jsonl"):
        assert_same_records(read_jsonl(sh / "step_000001" / name), read_jsonl(ppo / "step_000001" / name), name)
    summary = cli_ok("report", ppo).stdout
    text = Path(summary.strip().splitlines()[-1]).read_text()
    assert "turns per sample" in text and "environment reward" in text


def test_calculator_recipes_load_and_chat_prompts_keep_the_system_message(tmp_path):
    from rlx.ppo.config import load_recipe
    from rlx.tasks.calculator import SYSTEM, CalculatorEnv

    for name, env in (("calculator.toml", "ToolChoiceCalculatorEnv"), ("smollm2_calculator.toml", "CalculatorEnv")):
        recipe = load_recipe(REPO / "recipes" / name)
        assert recipe.rollout.agent.env == f"rlx.tasks.calculator:{env}" and recipe.score.reward == ["env"]
    record = read_jsonl(REPO / "recipes" / "data" / "calculator_chat.jsonl")[0]
    env = CalculatorEnv(record)
    assert env.reset() == record["prompt"] and record["prompt"][0] == {"role": "system", "content": SYSTEM}
    a, b = record["prompt"][-1]["content"].split("*")
    call = {"id": "c", "function": {"name": "calculator", "arguments": json.dumps({"expression": f"{a}*{b}"})}}
    (reply,), reward, done = env.step({"role": "assistant", "content": "", "tool_calls": [call]})
    assert reply["content"] == record["ground_truth"] == str(int(a) * int(b)) and not done
    assert env.step({"role": "assistant", "content": f"It is {reply['content']}."})[1:] == (1.0, True)


def test_ppo_with_a_critic_on_the_calculator_environment(tmp_path):
    """`rlx ppo` multi-turn with GAE and a critic: two steps, the turns and environment reward on the metrics line,
    the critic's values read over the model's tokens only."""
    recipe = REPO / "recipes" / "calculator.toml"
    small = ["--set", "data.prompts_per_step=2", "--set", "rollout.sampling.n=2",
             "--set", "rollout.sampling.max_new_tokens=12",
             "--set", "sft.max_steps=1"]  # fmt: skip
    gae = ["--set", "score.estimator=gae", "--set", "critic.train.optim.lr=1e-3"]
    cli_ok("ppo", recipe, "--out", tmp_path / "run", "--set", "steps=2", *small, *gae)
    lines = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    merged = stable(lines)
    assert sorted(merged) == [1, 2]
    for step in merged.values():
        assert step["rollout/turns_mean"] >= 1 and "env/reward_mean" in step and "critic/vf_loss" in step
    assert (tmp_path / "run" / "checkpoints" / "step_000002" / "critic").is_dir()
