"""score.filter_groups (DAPO dynamic sampling) with an environment (rollout.agent.env): the synchronous loop and [async]
keep only informative groups of token-exact episodes, and at max_staleness 0 the asynchronous run is the
synchronous one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlx.models.tiny_chat import build_chat_tokenizer
from tests.conftest import REPO, read_jsonl
from tests.distributed.test_async import check_staleness, ppo_one_process, ppo_torchrun, read_steps
from tests.stages.test_ppo import assert_same_weights

ENV = '''
class Parity:
    """Up to two assistant turns; the reward is 1 when the first reply has an even number of characters, else 0."""

    def __init__(self, record):
        self.question, self.turns = record["prompt"], 0

    def reset(self):
        return [{"role": "user", "content": self.question}]

    def step(self, message):
        self.turns += 1
        if self.turns == 1:
            return [{"role": "user", "content": "again"}], float(len(message["content"]) % 2 == 0), False
        return [], 0.0, True
'''


def write_recipe(folder: Path, async_table: str | None) -> Path:
    (folder / "envs.py").write_text(ENV)
    recipe = f"""
seed = 0
steps = 3
save_every = 1
keep_checkpoints = 0
[model]
path = "{REPO / "recipes" / "tiny-chat"}"
init = "random"
[data]
prompts = "{REPO / "recipes" / "data" / "calculator.jsonl"}"
prompts_per_step = 4
max_gen_batches = 0
[rollout.agent]
env = "{folder / "envs.py"}:Parity"
max_turns = 2
max_total_tokens = 320
[rollout.sampling]
n = 2
max_new_tokens = 6
[score]
reward = "env"
filter_groups = true
[train]
mini_batch_size = 128
[train.optim]
lr = 1e-3
"""
    path = folder / "recipe.toml"
    path.write_text(recipe + (f"[async]\n{async_table}\n" if async_table is not None else ""))
    return path


def check_episodes(run: Path, steps: int) -> list[float]:
    """Every step trains 4 informative groups (different rewards within each) of whole episodes: the loss mask
    marks the model's turns, which decode to the assistant messages, and the reward is the environment's verdict on
    the first one (the environment steps after a finished turn). Returns the steps' dynamic_sampling/gen_batches."""
    tokenizer = build_chat_tokenizer("qwen2.5")
    metrics, num_turns = read_jsonl(run / "metrics.jsonl"), []
    for records, scores in zip(read_steps(run, steps), read_steps(run, steps, "scores.jsonl"), strict=True):
        groups = {}
        for s in scores:
            groups.setdefault(s["prompt_id"], []).append(s["reward"])
        assert len(groups) == 4 and all(len(g) == 2 and len(set(g)) == 2 for g in groups.values()), groups
        for r in records:
            assert len(r["loss_mask"]) == len(r["response_ids"]) == len(r["rollout_logprobs"]) and r["num_turns"] >= 1
            num_turns.append(r["num_turns"])
            turns, start = [], None
            for i, on in enumerate([*r["loss_mask"], 0]):
                if on and start is None:
                    start = i
                elif not on and start is not None:
                    turns.append(tokenizer.decode(r["response_ids"][start:i], skip_special_tokens=True))
                    start = None
            replies = [m["content"] for m in r["messages"] if m["role"] == "assistant"]
            assert len(turns) == len(replies) == r["num_turns"]
            for turn, reply in zip(turns, replies):  # a turn with a malformed tool call is an error message
                assert turn == reply or "<tool_call>" in turn, (turn, reply)
            # the environment steps after a turn that ends with <|im_end|>; one cut at max_new_tokens ends the episode
            assert r["env_reward"] == (float(len(replies[0]) % 2 == 0) if r["num_turns"] == 2 else 0.0)
    assert all(m["dynamic_sampling/kept_groups"] == 4 for m in metrics)
    assert max(num_turns) == 2  # some episodes have the environment's tokens (loss mask 0) between two turns
    return [m["dynamic_sampling/gen_batches"] for m in metrics]


@pytest.mark.slow
def test_dynamic_sampling_of_episodes_sync_and_async(tmp_path):
    """The synchronous loop draws batches of episodes until 4 informative groups are kept; 1 rollout rank + 1
    trainer at max_staleness 0 trains exactly those samples (weights, records, scores, data positions); at
    max_staleness 1 with 2 rollout ranks every step still keeps informative whole episodes within the bound."""
    (tmp_path / "sync").mkdir()
    sync = tmp_path / "sync" / "run"
    ppo_one_process(write_recipe(tmp_path / "sync", None), sync)
    assert max(check_episodes(sync, 3)) > 1
    run = tmp_path / "async"
    ppo_torchrun(2, write_recipe(tmp_path, "max_staleness = 0"), run)
    assert check_staleness(run, 3, 0) == [0, 0, 0]
    assert_same_weights(sync / "checkpoints" / "step_000003", run / "checkpoints" / "step_000003")
    for ours, theirs in zip(read_steps(run, 3), read_steps(sync, 3), strict=True):
        # the same samples; their logprobs to float rounding (the rollout rank batches them otherwise: 4.8e-7 seen)
        skip = ("policy_version", "rollout_restarts", "rollout_logprobs")
        assert [{k: v for k, v in r.items() if k not in skip} for r in ours] == [
            {k: v for k, v in r.items() if k not in skip} for r in theirs
        ]
        for a, b in zip(ours, theirs, strict=True):
            assert len(a["rollout_logprobs"]) == len(b["rollout_logprobs"])
            assert max(abs(x - y) for x, y in zip(a["rollout_logprobs"], b["rollout_logprobs"])) < 1e-5, a["id"]
    assert read_steps(run, 3, "scores.jsonl") == read_steps(sync, 3, "scores.jsonl")
    for a, b in zip(read_jsonl(sync / "metrics.jsonl"), read_jsonl(run / "metrics.jsonl"), strict=True):
        for key in ("reward/mean", "actor/pg_loss", "dynamic_sampling/gen_batches", "rollout/turns_mean"):
            assert a[key] == b[key], key
    for step in (1, 2, 3):
        metas = [json.loads((r / "checkpoints" / f"step_{step:06d}" / "rlx.json").read_text()) for r in (sync, run)]
        assert metas[0]["data_position"] == metas[1]["data_position"]
    lag = tmp_path / "lag1"
    (tmp_path / "lag").mkdir()
    ppo_torchrun(3, write_recipe(tmp_path / "lag", "max_staleness = 1\nrollout_ranks = 2"), lag)
    check_episodes(lag, 3)
    check_staleness(lag, 3, 1)
