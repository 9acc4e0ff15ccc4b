"""The memory plan (rlx/ppo/plan.py) and `rlx ppo --plan`, on the CPU with the hardware named: parameter counts by
shape, the 7B calibration (the fast path alone does not fit 4 x 80 GB, sleep + checkpointing does), what the plan
picks as memory shrinks, the recipe's own keys kept, the message when nothing fits, and that `rlx ppo` on CUDA stops
before loading weights when nothing fits."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from rlx.models.tiny import write_tiny_model_dir
from rlx.ppo.defaults import apply_defaults, fast_path_defaults
from rlx.ppo.plan import (
    Host,
    Settings,
    Workload,
    _activation_bytes_per_token,
    estimate,
    host_gib,
    model_shape,
    plan_memory,
    usable_gib,
)
from tests.conftest import cli

H100_GIB = 79.1
QWEN25_7B = dict(  # the issue's model: a Qwen2.5-7B-shaped Llama with q/k/v biases, untied
    model_type="llama", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
    num_key_value_heads=4, vocab_size=152064, attention_bias=True, tie_word_embeddings=False,
)  # fmt: skip
QWEN25_14B = dict(
    model_type="qwen2", hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
    num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False,
)  # fmt: skip
QWEN25_32B = dict(
    model_type="qwen2", hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
    num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False,
)  # fmt: skip
X4_HOST_GIB = 468.0
"""The lent 4 x H100 machine's memory (503 GB)."""
ISSUE_RECIPE = {  # 32 prompts x 8, prompt 128 / response 256, no reference (as bench/grpo_step.py)
    "use_ref": False,
    "model": {"path": "model"},
    "data": {"prompts": "prompts.jsonl", "prompts_per_step": 32},
    "rollout": {"n": 8, "max_prompt_length": 128, "max_new_tokens": 256},
}


def with_fast_path(tree: dict) -> dict:
    values = fast_path_defaults("cuda", tree)
    values.update({k: 6144 for k in values if k.endswith("max_tokens_per_micro_batch")})  # the 7B's budget
    return apply_defaults(tree, values)


def test_parameter_counts_by_shape():
    """Known models' parameter counts from their configs: Qwen2.5-7B (7.62B: GQA, q/k/v biases, untied), Qwen2.5-14B
    (14.77B), a tied 0.5B (0.49B); experts multiply the MLP, only the routed ones count per token."""
    assert model_shape(QWEN25_7B).params == pytest.approx(7.615e9, rel=2e-3)
    assert model_shape(QWEN25_14B).params == pytest.approx(14.77e9, rel=3e-3)
    qwen05 = dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                  tie_word_embeddings=True)  # fmt: skip
    assert model_shape(qwen05).params == pytest.approx(0.494e9, rel=3e-3)
    moe = dict(QWEN25_7B, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=2048)
    shape = model_shape(moe)
    mlp = 3 * 3584 * 2048
    assert shape.layer_params - model_shape(dict(QWEN25_7B, intermediate_size=0)).layer_params == 8 * mlp + 3584 * 8
    assert shape.intermediate == 2 * 2048 and shape.experts_per_token == 2
    # each token's hidden state is kept once per routed expert (gathered in, out, weighted): an MoE's train
    # activations exceed a dense MLP of the same routed width (the 30B-A3B step ran out at a plan without this)
    dense_like = replace(shape, experts_per_token=0, num_experts=0)
    assert _activation_bytes_per_token(shape, False) - _activation_bytes_per_token(dense_like, False) == (
        shape.layers * 6 * 2 * 3584
    )


def test_the_issue_7b_fast_path_does_not_fit_and_sleep_with_checkpointing_does():
    """Calibration (issue 34, 4 x H100 80 GB): the fast path's settings ran out of memory in the first train step,
    rollout.sleep + gradient checkpointing ran."""
    shape, work = model_shape(QWEN25_7B), Workload.from_recipe(with_fast_path(ISSUE_RECIPE))
    fast = Settings(train_tokens=6144, score_tokens=6144, compile=True)
    assert estimate(shape, work, fast, 4, H100_GIB).phases["train"] > usable_gib(H100_GIB)
    ran = Settings(sleep=True, gradient_checkpointing=True, train_tokens=6144, score_tokens=6144, compile=True)
    assert estimate(shape, work, ran, 4, H100_GIB).peak <= usable_gib(H100_GIB)


def test_the_plan_picks_sleep_and_sharded_gradients_for_the_issue_run():
    """The 7B run: the engine sleeps, and micro-batches reduce-scatter their gradients (a whole float32 gradient
    per rank, 28 GiB, is what would not fit) rather than recomputing activations; the recipe's own
    grad_accumulation = "unsharded" makes it checkpoint activations instead."""
    tree = with_fast_path(ISSUE_RECIPE)
    plan = plan_memory(QWEN25_7B, tree, {"use_ref": False}, 4, H100_GIB)
    assert plan.fits
    assert plan.chosen["rollout.sleep"] is True and plan.chosen["train.grad_accumulation"] == "sharded"
    assert "train.gradient_checkpointing" not in plan.chosen and not plan.estimate.parts["accumulated_grads"]
    tree["train"]["grad_accumulation"] = "unsharded"
    kept = plan_memory(QWEN25_7B, tree, {"train.grad_accumulation": "unsharded"}, 4, H100_GIB)
    assert kept.fits and kept.chosen["train.gradient_checkpointing"] is True
    assert "train.param_offload" not in plan.chosen
    assert plan.chosen["rollout.kv_cache_gib"] > 0
    episodes = {**tree, "rollout": {**tree["rollout"], "env": "envs.py:Game"}}  # contexts outgrow the prompt
    assert "rollout.kv_cache_gib" not in plan_memory(QWEN25_7B, episodes, {"use_ref": False}, 4, H100_GIB).chosen
    assert plan.estimate.peak <= usable_gib(H100_GIB)
    assert "fits" in plan.summary() and "rollout.sleep=true" in plan.summary()


def test_what_the_plan_picks_as_memory_shrinks():
    """Plenty of memory: nothing changes; less: the engine sleeps, then gradients reduce every micro-batch, then
    activations are checkpointed (with gradients reduced every micro-batch next), then compile goes with FSDP's CPU
    offload (under a launcher only); the settings only ever get cheaper in memory."""
    tree = with_fast_path(ISSUE_RECIPE)
    big = plan_memory(QWEN25_7B, tree, {}, 8, 1000.0)
    assert big.fits and big.chosen.get("rollout.sleep") is False and "train.gradient_checkpointing" not in big.chosen
    rungs = []
    for gib in (1000.0, 160.0, 80.0, 60.0, 48.0, 40.0):
        plan = plan_memory(QWEN25_7B, tree, {}, 4, gib)
        assert plan.fits, plan.summary()
        keys = ("rollout.sleep", "train.gradient_checkpointing", "train.grad_accumulation", "train.param_offload")
        rungs.append(sum(bool(plan.chosen.get(k)) for k in keys))
    assert rungs == sorted(rungs) and rungs[0] == 0 and rungs[-1] == 3
    assert plan_memory(QWEN25_7B, tree, {}, 4, 40.0).chosen["train.compile"] is False
    assert not plan_memory(QWEN25_7B, tree, {}, 1, 48.0).fits  # offload needs torchrun: not offered to one process
    # keep_gathered (the whole model gathered over a phase) is the first rung to go, and never on one process
    kept = [plan_memory(QWEN25_7B, tree, {}, 4, gib).chosen.get("train.keep_gathered") for gib in (1000.0, 80.0)]
    assert kept == [True, None]
    assert "train.keep_gathered" not in plan_memory(QWEN25_7B, tree, {}, 1, 1000.0).chosen
    with_kept = plan_memory(QWEN25_7B, tree, {}, 4, 1000.0)
    without = estimate(model_shape(QWEN25_7B), Workload.from_recipe(tree), replace(with_kept.settings,
                       keep_gathered=False), 4, 1000.0)  # fmt: skip
    extra = with_kept.estimate.phases["score"] - without.phases["score"]
    assert 10.5 < extra < 12.0  # 7.6B parameters in bfloat16 (14.2 GiB), less a layer and the root gathered otherwise


def test_the_recipe_s_own_keys_are_kept_and_the_message_names_what_fits():
    """A recipe that sets rollout.sleep = false keeps it; when nothing fits, the message names the setting to leave
    out, the reference copy and the number of GPUs that would fit."""
    tree = with_fast_path({**ISSUE_RECIPE, "use_ref": True, "rollout": {**ISSUE_RECIPE["rollout"], "sleep": False}})
    tree["train"]["param_offload"] = False
    tree["rollout"]["tp_degree"] = 1
    user = {"rollout.sleep": False, "train.param_offload": False, "rollout.tp_degree": 1}
    plan = plan_memory(QWEN25_7B, tree, user, 4, H100_GIB)
    assert not plan.fits
    assert "rollout.sleep" not in plan.chosen
    assert "leave out rollout.sleep=false, train.param_offload=false, rollout.tp_degree=1" in plan.message
    assert "use_ref=false" in plan.message
    assert "GPUs of 79 GiB" in plan.message
    assert "DOES NOT FIT" in plan.summary()


def test_14b_needs_more_than_one_gpu():
    tree = with_fast_path({**ISSUE_RECIPE, "model": {"path": "m"}})
    one = plan_memory(QWEN25_14B, tree, {}, 1, H100_GIB)
    assert not one.fits and "GPUs of 79 GiB" in one.message
    assert "checkpoint: about 177.2 GB each" in one.summary()  # 14.8B parameters x 12 bytes
    # 7B on one 80 GB card: full weights do not fit; adapters on a frozen bfloat16 base do
    seven = plan_memory(QWEN25_7B, tree, {}, 1, H100_GIB)
    assert not seven.fits and "would fit: a [lora] table" in seven.message and "2 GPUs of 79 GiB" in seven.message
    assert "`torchrun --nproc_per_node 1 -m rlx ppo ...` with train.param_offload = true" in seven.message
    launched = plan_memory(QWEN25_7B, tree, {}, 1, H100_GIB, launched=True)  # FSDP over one rank: CPU offload
    assert launched.fits and launched.chosen["train.param_offload"] is True
    assert "trained_state" not in launched.summary() and "gathered 8.7" in launched.summary()  # two layers + root
    lora = plan_memory(QWEN25_7B, {**tree, "lora": {"rank": 16}}, {}, 1, H100_GIB)
    assert lora.fits and "checkpoint:" not in lora.summary()
    assert "gathered" not in lora.summary()  # one process: the bfloat16 base is not cast again under autocast
    four = plan_memory(QWEN25_14B, tree, {}, 4, H100_GIB)
    assert four.fits
    # the native engine's whole bfloat16 replica (27.5 GiB) beside the trained state does not fit: the plan splits
    # it over the GPUs (rollout.tp_degree: 4 decodes fastest, a quarter of the weights read per step) and
    # checkpoints activations with sharded gradients, not CPU offload
    assert four.chosen["rollout.tp_degree"] == 4 and four.chosen["train.grad_accumulation"] == "sharded"
    assert "train.param_offload" not in four.chosen
    assert "rollout: tp_degree 4 (predicted decode step ms: tp 1 12.3, tp 2 8.7, tp 4 7.7)" in four.summary()


def test_a_smaller_kv_cache_where_only_it_fits_and_the_fewest_gpus_named():
    """The native engine's cache is a pool: where the whole step's sequences at their longest do not fit beside the
    rest, the plan takes a half (a quarter, ...) of that and says so; the recipe's own cache size is kept. The
    number of GPUs a message names is the fewest that fit, planned under a launcher (CPU offload allowed)."""
    long = {**ISSUE_RECIPE, "data": {**ISSUE_RECIPE["data"], "prompts_per_step": 64},
            "rollout": {"n": 8, "max_prompt_length": 512, "max_new_tokens": 1024}}  # fmt: skip
    tree = with_fast_path({**long, "lora": {"rank": 16}})
    plan = plan_memory(QWEN25_7B, tree, {}, 1, H100_GIB)
    assert plan.fits and plan.chosen["rollout.kv_cache_gib"] == 23.75  # half of 47.2
    assert "kv_cache_gib 23.75 holds about 1/2 of the step's sequences" in plan.summary()
    kept = plan_memory(QWEN25_7B, tree, {"rollout.kv_cache_gib": 47.25}, 1, H100_GIB)
    assert not kept.fits and "leave out rollout.kv_cache_gib=47.25" in kept.message
    full = plan_memory(QWEN25_7B, with_fast_path(long), {}, 1, H100_GIB)
    assert not full.fits and "; 2 GPUs of 79 GiB" in full.message  # with CPU offload there: not 4
    roomy = plan_memory(QWEN25_7B, tree, {}, 1, 140.0)
    assert roomy.chosen["rollout.kv_cache_gib"] == 47.25 and "holds about" not in roomy.summary()


def test_the_rollout_s_tensor_parallel_degree_is_the_fastest_predicted_decode():
    """Data-parallel replicas for a small model (the per-step overhead rules), two GPUs per engine for 7B (half the
    weights read per step; the all-reduces of four cost more than the next halving saves), as measured on 4 x H100
    (bench/tp_rollout.py); the recipe's own degree, another engine or one GPU: no choice, no line."""
    tree = with_fast_path(ISSUE_RECIPE)
    qwen2_05b = dict(QWEN25_7B, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                     num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)  # fmt: skip
    small = plan_memory(qwen2_05b, tree, {}, 4, H100_GIB)
    assert small.settings.tp_degree == 1 and "rollout: tp_degree 1 (predicted decode step ms: tp 1 2.1, tp 2 3.6)" in (
        small.summary()
    )
    seven = plan_memory(QWEN25_7B, tree, {}, 4, H100_GIB)
    assert seven.chosen["rollout.tp_degree"] == 2 and "tp 1 7.2, tp 2 6.1, tp 4 6.5" in seven.summary()
    for plan in (plan_memory(QWEN25_7B, tree, {"rollout.tp_degree": 4}, 4, H100_GIB),
                 plan_memory(QWEN25_7B, tree, {}, 1, 1000.0)):  # fmt: skip
        assert "rollout.tp_degree" not in plan.chosen and "predicted decode step" not in plan.summary()
    kept = plan_memory(QWEN25_14B, tree, {"rollout.tp_degree": 1}, 4, H100_GIB)
    assert kept.fits and kept.chosen["train.param_offload"] is True  # the recipe's tp_degree 1 kept: offload then


# --- the CLI ---------------------------------------------------------------------------------------------------


def write_recipe(folder: Path, config: dict, **extra: str) -> Path:
    """A recipe on a config-only model dir (init = 'random'): config.json of `config`'s shape and a tokenizer."""
    model = write_tiny_model_dir(folder / "model")
    merged = {k: v for k, v in json.loads((model / "config.json").read_text()).items() if k != "head_dim"}
    merged.update(config)
    (model / "config.json").write_text(json.dumps(merged))
    (folder / "prompts.jsonl").write_text('{"prompt": "1+1="}\n' * 32)
    lines = ["use_ref = false", "steps = 2", *(f"{k} = {v}" for k, v in extra.items())]
    lines += ["[model]", 'path = "model"', 'init = "random"', "[data]", 'prompts = "prompts.jsonl"']
    lines += ["prompts_per_step = 32", "[rollout]", "n = 8", "max_prompt_length = 128", "max_new_tokens = 256"]
    lines += ["[score]", 'reward = "length"']
    path = folder / "recipe.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_plan_cli_fits_and_does_not_fit(tmp_path):
    recipe = write_recipe(tmp_path, QWEN25_7B)
    fits = cli("ppo", recipe, "--plan", "--gpus", "4", "--gpu-memory-gib", "79.1")
    assert fits.exit_code == 0, fits
    assert "memory plan for 4 x 79 GiB: fits" in fits.stdout
    assert "train.grad_accumulation=sharded" in fits.stdout
    assert "checkpoint: about 91.4 GB each (float32 weights and AdamW's two moments)" in fits.stdout
    assert not (tmp_path / "runs").exists()
    small = cli("ppo", recipe, "--plan", "--gpus", "1", "--gpu-memory-gib", "24")
    assert small.exit_code == 1
    assert "DOES NOT FIT" in small.stdout
    error = small.stderr.strip().splitlines()[-1]
    assert "nothing fits 1 x 24 GiB; would fit:" in error and "GPUs of 24 GiB" in error
    kept = (
        "--set",
        "rollout.sleep=false",
        "--set",
        "train.gradient_checkpointing=false",
        "--set",
        "train.param_offload=false",
        "--set",
        'train.grad_accumulation="unsharded"',
    )
    user_set = cli("ppo", recipe, "--plan", "--gpus", "4", "--gpu-memory-gib", "64", *kept)
    assert user_set.exit_code == 1
    assert "leave out rollout.sleep=false, train.gradient_checkpointing=false, train.param_offload=false, " in (
        user_set.stderr
    )


def test_the_old_name_rollout_tp_is_the_recipe_s_own_degree(tmp_path, monkeypatch):
    """A recipe giving the deprecated rollout.tp keeps that degree: the plan chooses none of its own (4 x H100 would
    pick tp_degree 2 for 7B), which RolloutConfig would refuse beside tp as two different values."""
    import rlx.commands.ppo as command

    recipe = write_recipe(tmp_path, QWEN25_7B)
    monkeypatch.setattr(command, "_device_memory_gib", lambda: 79.1)
    monkeypatch.setattr(command, "_host_memory_gib", lambda: X4_HOST_GIB)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert "rollout.tp_degree=2" in command._planned(recipe, [])
    recipe.write_text(recipe.read_text().replace("[rollout]\n", '[rollout]\nengine = "native"\ntp = 4\n'))
    assert not [o for o in command._planned(recipe, []) if o.startswith("rollout.tp_degree")]
    assert "predicted decode step" not in cli("ppo", recipe, "--plan", "--gpus", "4", "--gpu-memory-gib", "79.1").stdout


def test_plan_cli_bad_input(tmp_path):
    recipe = write_recipe(tmp_path, QWEN25_7B)
    no_plan = cli("ppo", recipe, "--gpus", "4")
    assert no_plan.exit_code == 1 and "add --plan" in no_plan.stderr
    import torch

    if not torch.cuda.is_available():
        no_gpu = cli("ppo", recipe, "--plan", "--gpus", "2")
        assert no_gpu.exit_code == 1 and "--gpu-memory-gib" in no_gpu.stderr
    (tmp_path / "model" / "config.json").write_text("{}")
    broken = cli("ppo", recipe, "--plan", "--gpu-memory-gib", "80")
    assert broken.exit_code == 1 and "config.json" in broken.stderr


def test_a_cuda_run_that_does_not_fit_stops_before_loading_weights(tmp_path, monkeypatch):
    """`rlx ppo` on a (faked) CUDA machine with too little memory: exit 1 with the plan's message, no run folder;
    with enough, the plan's choices reach the resolved recipe (--print-config shows the recipe before the plan)."""
    import rlx.commands.ppo as command

    recipe = write_recipe(tmp_path, QWEN25_7B)
    monkeypatch.setattr(command, "_device_memory_gib", lambda: 24.0)
    monkeypatch.setattr(command, "_host_memory_gib", lambda: X4_HOST_GIB)  # not this machine's 24 GiB
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr("rlx.utils.device.resolve_device", lambda name: __import__("torch").device("cuda"))
    monkeypatch.setenv("WORLD_SIZE", "1")
    result = cli("ppo", recipe, "--out", tmp_path / "run")
    assert result.exit_code == 1, result
    assert "nothing fits 1 x 24 GiB" in result.stderr
    assert not (tmp_path / "run").exists()
    monkeypatch.setattr(command, "_device_memory_gib", lambda: 79.1)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert "`torchrun --nproc_per_node 1" in cli("ppo", recipe, "--out", tmp_path / "run").stderr  # a plain process
    monkeypatch.setenv("LOCAL_RANK", "0")  # one process under torchrun: FSDP, so CPU offload
    assert "train.param_offload=true" in command._planned(recipe, [])
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr(command, "_device_memory_gib", lambda: 79.1)
    overrides = command._planned(recipe, [])
    assert "rollout.sleep=true" in overrides and "train.grad_accumulation=sharded" in overrides
    assert command._planned(
        recipe, ["train.gradient_checkpointing=false"]
    ) == [] or "train.gradient_checkpointing=" not in " ".join(
        command._planned(recipe, ["train.gradient_checkpointing=false"])
    )


def test_a_resumed_run_keeps_the_memory_settings_it_started_with(tmp_path, monkeypatch):
    """--resume does not plan again (the hardware or rlx's estimate may have changed since): the settings come from
    the run's recipe.json, so the resumed run's recipe equals the saved one; keys the user sets still win."""
    import rlx.commands.ppo as command

    recipe = write_recipe(tmp_path, QWEN25_7B)
    run = tmp_path / "run"
    run.mkdir()
    saved = {"rollout": {"sleep": False, "kv_cache_gib": 2.0}, "train": {"gradient_checkpointing": True}}
    (run / "recipe.json").write_text(json.dumps(saved))
    monkeypatch.setattr(command, "_device_memory_gib", lambda: 24.0)  # would not fit: not planned again
    overrides = command._planned(recipe, ["train.gradient_checkpointing=false"], run)
    assert overrides == ["rollout.sleep=false", "rollout.kv_cache_gib=2.0"]


def test_the_host_s_memory_is_planned_too():
    """Rank 0 builds the whole float32 policy on the host before sharding it (every rank with LoRA or a critic of
    its own folder), and each rank pins its share of the checkpoint buffers (with CPU offload, also its offloaded
    shards): a 32B model whose GPUs' plan fits 4 x H100 with CPU offload does not fit the lent 4-GPU host (503 GB;
    998 GiB of offloaded steady state): refused, naming the host's peaks and what would hold it, with the GPUs' plan
    shown. 7B and 14B fit it (they ran there)."""
    tree = with_fast_path({**ISSUE_RECIPE, "model": {"path": "m"}})
    x4 = Host(X4_HOST_GIB, 4)
    fourteen = plan_memory(QWEN25_14B, tree, {}, 4, H100_GIB, x4)
    assert fourteen.fits and fourteen.chosen == plan_memory(QWEN25_14B, tree, {}, 4, H100_GIB).chosen
    assert "  host: peak GiB load 71, steady 184 of 421 usable of 468 (4 ranks per host)\n" in fourteen.summary()
    gpus_only = plan_memory(QWEN25_32B, tree, {}, 4, H100_GIB)
    assert gpus_only.fits and gpus_only.chosen["train.param_offload"] is True and gpus_only.host is None
    on_x4 = plan_memory(QWEN25_32B, tree, {}, 4, H100_GIB, x4)
    assert not on_x4.fits and on_x4.chosen == gpus_only.chosen  # the GPUs' plan, refused for the host
    assert on_x4.message == (
        "4 x 79 GiB GPUs would hold the run but the host would not: peak GiB per host load 138 (rank 0 builds the "
        "policy in float32 on the host before sharding: 122 GiB), steady 998 (checkpoint buffers, "
        "offloaded shards), of 421 usable of 468; would fit: hosts of 1110 GiB; 1 rank per host (4 hosts)"
    )
    assert "DOES NOT FIT" in on_x4.summary() and "host: peak GiB load 138, steady 998" in on_x4.summary()
    # the load fits a 600 GiB host, the offloaded steady state does not; 2 TiB holds both
    assert not plan_memory(QWEN25_32B, tree, {}, 4, H100_GIB, Host(600.0, 4)).fits
    assert plan_memory(QWEN25_32B, tree, {}, 4, H100_GIB, Host(2048.0, 4)).fits
    # rank 0 alone loads the policy and the reference and critic copied from it (whole float32 copies); a critic of
    # its own folder is loaded on every rank, with the policy and reference
    ref = with_fast_path({**ISSUE_RECIPE, "model": {"path": "m"}, "use_ref": True})
    both = with_fast_path({**ISSUE_RECIPE, "model": {"path": "m"}, "use_ref": True, "critic": {}})
    own = with_fast_path({**ISSUE_RECIPE, "model": {"path": "m"}, "use_ref": True, "critic": {"path": "c"}})
    loads = [plan_memory(QWEN25_7B, t, {}, 4, H100_GIB, x4).host_gib["load"] for t in (tree, ref, both, own)]
    policy = model_shape(QWEN25_7B).params * 4 / 2**30
    assert [load - loads[0] for load in loads[1:]] == pytest.approx([policy, 2 * policy, 11 * policy])


def test_plan_cli_checks_the_host_it_is_given(tmp_path, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)  # every rank on one host (an earlier test may leave it)
    recipe = write_recipe(tmp_path, QWEN25_32B)
    args = ("ppo", recipe, "--plan", "--gpus", "4", "--gpu-memory-gib", "79.1")
    unchecked = cli(*args)
    assert unchecked.exit_code == 0 and "host memory not checked (name it with --host-memory-gib)" in unchecked.stdout
    refused = cli(*args, "--host-memory-gib", "468")
    assert refused.exit_code == 1 and "would hold the run but the host would not" in refused.stderr
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two hosts of 2 GPUs: half the ranks each
    halves = cli(*args, "--host-memory-gib", "600")
    assert halves.exit_code == 0 and "(2 ranks per host)" in halves.stdout, halves


def test_the_score_budget_shrinks_only_when_the_score_phase_is_over():
    from rlx.ppo.plan import _fit_score

    shape, work = model_shape(QWEN25_7B), Workload.from_recipe(with_fast_path(ISSUE_RECIPE))
    huge = Settings(sleep=True, score_tokens=1 << 20)
    fitted = _fit_score(shape, work, huge, {}, 4, H100_GIB, 1024)
    assert 1024 <= fitted.score_tokens < huge.score_tokens
    assert estimate(shape, work, fitted, 4, H100_GIB).phases["score"] <= usable_gib(H100_GIB)
    assert _fit_score(shape, work, replace(huge, score_tokens=6144), {}, 4, H100_GIB, 1024).score_tokens == 6144
    kept = _fit_score(shape, work, huge, {"score.max_tokens_per_micro_batch": 1 << 20}, 4, H100_GIB, 1024)
    assert kept.score_tokens == 1 << 20


QWEN3_30B_A3B = dict(  # Qwen3-30B-A3B's shape: 128 experts, 8 per token
    model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
    head_dim=128, moe_intermediate_size=768, intermediate_size=6144, num_experts=128, num_experts_per_tok=8,
    vocab_size=151936, tie_word_embeddings=False,
)  # fmt: skip


def test_moe_sizes_and_the_plan_suggests_expert_parallelism():
    shape = model_shape(QWEN3_30B_A3B)
    assert shape.params == pytest.approx(30.5e9, rel=1e-2) and shape.active_params == pytest.approx(3.3e9, rel=3e-2)
    assert shape.expert_params == 48 * 128 * 3 * 2048 * 768
    work = Workload.from_recipe(with_fast_path(ISSUE_RECIPE))
    one, eight = (estimate(shape, work, Settings(train_tokens=4096, ep_degree=ep), 8, 139.0) for ep in (1, 8))
    experts_gib = shape.expert_params * 7 / 8 / 2**30  # what a rank no longer holds whole
    assert one.parts["accumulated_grads"] - eight.parts["accumulated_grads"] == pytest.approx(2 * experts_gib)
    assert one.parts["trained_state"] == eight.parts["trained_state"]  # FSDP shards the experts either way
    # small micro-batches accumulate float32 gradients of every expert: 8 x H200 fit only with the experts split
    user = {"train.max_tokens_per_micro_batch": 4096, "train.gradient_checkpointing": False}
    plan = plan_memory(QWEN3_30B_A3B, with_fast_path(ISSUE_RECIPE), user, 8, 139.0)
    assert plan.fits and plan.chosen["train.ep_degree"] in (2, 4, 8), plan.summary()
    summary = plan.summary()
    assert "3.35B active per token" in summary and f"ep_degree {plan.chosen['train.ep_degree']}" in summary
    kept = plan_memory(QWEN3_30B_A3B, with_fast_path(ISSUE_RECIPE), {**user, "train.ep_degree": 1}, 8, 139.0)
    assert "train.ep_degree" not in kept.chosen and kept.settings.ep_degree == 1
    assert plan_memory(QWEN25_7B, with_fast_path(ISSUE_RECIPE), {}, 4, H100_GIB).settings.ep_degree == 1  # dense


def test_activations_are_those_of_the_trainer_s_even_micro_batches():
    """A rank's rows split into the fewest micro-batches the budget allows, of even size (rlx/training/trainer.py):
    98,304 tokens a rank at a 65,536-token budget are two micro-batches of 49,152, not one of 65,536."""
    shape, work = model_shape(QWEN25_7B), Workload.from_recipe(ISSUE_RECIPE)  # 256 x 384 tokens
    per_token = _activation_bytes_per_token(shape, True) / 2**30
    for budget, tokens in ((65536, 49152), (98304, 98304), (16384, 16384), (40000, 32768)):
        settings = Settings(sleep=True, gradient_checkpointing=True, train_tokens=budget)
        parts = estimate(shape, work, settings, 1, H100_GIB).parts
        assert parts["activations"] == pytest.approx(tokens * per_token), budget


def test_the_train_phase_is_planned_at_or_above_every_measured_peak():
    """bench/plan_check.py on one H200 (bench/results/plan_check_h200.json): the train phase's peak of `rlx ppo`'s
    trainer on one process, at 12k-98k tokens, eager, compiled and checkpointed, 0.5B and 7B widths. The plan must
    not under-predict any of them (a run it lets through would run out of memory), should stay near the large ones,
    and its activations per token must match the measured growth between two token counts of one configuration."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from plan_check import planned
    from scale import COMMON, SHAPES

    measured = json.loads((Path(__file__).resolve().parents[2] / "bench/results/plan_check_h200.json").read_text())
    ratios, by_config = {}, {}
    for run in measured["results"]:
        shape, layers, _, mode = run["run"].split(":")
        config = {**SHAPES[shape], **COMMON, "num_hidden_layers": int(layers)}
        plan = planned(config, run["sequences"], run["tokens"], "compile" in mode, "ckpt" in mode, 140.4)
        ratios[run["run"]] = plan["train_gib"] / run["peak_gib"]
        by_config.setdefault((shape, layers, mode), []).append((run, plan["activation_bytes_per_token"]))
    assert min(ratios.values()) >= 1.0, ratios
    assert max(r for k, r in ratios.items() if "eager" in k or k.endswith("98304:compile")) <= 1.2, ratios
    slopes = 0
    for runs in by_config.values():
        for (a, _), (b, per_token) in zip(runs, runs[1:]):
            slope = (
                (b["peak_gib"] - b["before_gib"] - a["peak_gib"] + a["before_gib"])
                * 2**30
                / (b["tokens"] - a["tokens"])
            )
            assert per_token == pytest.approx(slope, rel=0.06), (a["run"], b["run"], per_token, slope)
            slopes += 1
    assert slopes >= 4


MEASURED_PPO_PEAKS = [  # (shape, GPUs, --weak, extra --set, rank 0's train-phase peak GiB; bench/RESULTS.md, § Scale)
    ("0.5b", 1, True, {}, 111.5),  # twenty-fifth to twenty-seventh sessions, one H200
    ("0.5b", 2, True, {}, 104.7),  # twenty-fifth and twenty-sixth, two H200
    ("0.5b", 4, True, {}, 103.3),  # twenty-seventh, four H200
    ("0.5b", 2, False, {}, 55.0),  # twenty-sixth
    ("0.5b", 4, False, {}, 28.9),  # twenty-seventh: 23% under the plan of 4% of the card as the compile margin
    ("0.5b", 1, False, {"train.param_offload": True}, 101.3),  # one process under torchrun
    ("7b", 1, False, {}, 129.9),  # twenty-second
    ("7b", 2, False, {}, 121.3),  # twenty-sixth
    ("7b", 4, False, {}, 103.3),  # twenty-seventh
    ("7b", 1, False, {"lora.rank": 16}, 65.6),  # twenty-fourth
    ("14b", 1, False, {"lora.rank": 16}, 108.3),  # twenty-fourth
]


def test_the_plan_is_within_15_percent_of_every_measured_ppo_peak(tmp_path):
    """The issue's target, on the `bench/scale.py` runs of one H200 (140.4 GiB) to four: the plan of each run's
    recipe and GPU count at or above its measured train-phase peak (a run it lets through must not run out of
    memory) and at most 15% over it. The margin for compiled runs grows with the model: a share of the card alone
    (5.6 GiB on an H200) put the plan 23% over the 0.5B fixed work on four GPUs."""
    import sys
    from argparse import Namespace

    import tomllib

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from scale import write_recipe

    from rlx.ppo.plan import plan_recipe

    ratios = {}
    for i, (shape, gpus, weak, sets, peak) in enumerate(MEASURED_PPO_PEAKS):
        args = Namespace(num_prompts=32, weak=weak, steps=4, prompt_len=128, response_len=256, num_generations=8)
        recipe = write_recipe(tmp_path / str(i), shape, args, gpus)
        tree = tomllib.loads(recipe.read_text())
        for key, value in sets.items():
            table, name = key.split(".")
            tree.setdefault(table, {})[name] = value
        plan = plan_recipe(tree, recipe.parent, gpus, 140.4, launched=gpus > 1 or "train.param_offload" in sets)
        assert plan.fits, plan.summary()
        ratios[shape, gpus, weak, tuple(sets)] = plan.estimate.phases["train"] / peak
    assert all(1.0 <= r <= 1.15 for r in ratios.values()), ratios


def test_the_host_plan_is_at_or_above_rank_0_s_measured_host_memory():
    """Rank 0's largest host RSS over the steps of `bench/scale.py` runs (7B: one and two H200, 2026-11-29; four
    H100, 2026-11-28; 0.5B: one and two H200) against the plan's steady host share of a rank: never under (a host
    the plan passes must hold the run), and within 10% at 7B, where the pinned checkpoint buffers are most of it.
    Their chunks are whole powers of two: without that rounding the plan was 5 GiB under at 7B on one GPU."""
    work = Workload.from_recipe(ISSUE_RECIPE)
    from bench.scale import SHAPES

    for config, world, measured in ((QWEN25_7B, 1, 94.0), (QWEN25_7B, 2, 48.5), (QWEN25_7B, 4, 25.8),
                                    (SHAPES["0.5b"], 1, 8.0), (SHAPES["0.5b"], 2, 5.4)):  # fmt: skip
        planned = host_gib(model_shape(config), work, Settings(), world, 1)["steady"]
        assert measured <= planned <= (1.1 * measured if config is QWEN25_7B else 1.3 * measured), (world, planned)
