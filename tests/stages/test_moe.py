"""Mixture-of-experts models (Qwen3-MoE first; Qwen2-MoE, Mixtral, OLMoE share the code) through the stages on CPU:
the hub's per-expert layout round trip, scoring logprobs equal transformers' forward (padded and packed), a
train-step that moves the experts, hf rollout, LoRA on attention and a critic."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from rlx.formats.batch import TrainBatch
from rlx.logprobs import ModuleScorer
from rlx.models.family import family_of
from rlx.models.loading import read_weights
from rlx.models.moe import MOE_FAMILIES, MoeFamily, write_tiny_moe_model_dir
from rlx.parallel.dist import DistContext
from tests.conftest import cli_ok, read_jsonl, rollout_args, write_jsonl, write_length_reward

CPU = DistContext(device=torch.device("cpu"))


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return write_tiny_moe_model_dir(tmp_path_factory.mktemp("moe") / "hf", "qwen3_moe", seed=0)


@pytest.fixture(scope="module")
def moe_ckpt(moe_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_ck") / "step0"
    cli_ok("shard", "--model", moe_dir, "--out", out)
    return out


@pytest.fixture(scope="module")
def moe_rollouts(moe_ckpt, prompts_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_r") / "rollouts.jsonl"
    cli_ok(*rollout_args(moe_ckpt, prompts_file, out, "--engine", "hf"))
    return out


@pytest.mark.parametrize("model_type", list(MOE_FAMILIES))
def test_hub_layout_round_trip_is_bit_exact(tmp_path, model_type):
    hub = write_tiny_moe_model_dir(tmp_path / "hf", model_type, seed=1)
    with safe_open(str(hub / "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    assert any(".experts.0." in k for k in stored)  # transformers writes the hub's per-expert layout
    for layout in ("single", "fsdp"):
        cli_ok("shard", "--model", hub, "--out", tmp_path / layout, "--layout", layout)
        cli_ok("merge", "--checkpoint", tmp_path / layout, "--out", tmp_path / f"merged_{layout}")
        for name in ("model.safetensors", "config.json", "tokenizer.json"):
            assert (tmp_path / f"merged_{layout}" / name).read_bytes() == (hub / name).read_bytes(), (layout, name)
    fused = read_weights(tmp_path / "single")  # the module's names: what transformers loads
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hub)
    expected = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert fused.keys() == expected.keys() and all(torch.equal(fused[k], expected[k]) for k in expected)


def test_a_missing_expert_tensor_is_named_not_a_traceback(tmp_path, moe_dir):
    from safetensors.torch import load_file, save_file

    from tests.conftest import cli

    hub = tmp_path / "hf"
    shutil.copytree(moe_dir, hub)
    weights = load_file(str(hub / "model.safetensors"))
    del weights["model.layers.0.mlp.experts.2.up_proj.weight"]
    save_file(weights, str(hub / "model.safetensors"), metadata={"format": "pt"})
    result = cli("shard", "--model", hub, "--out", tmp_path / "ckpt")
    assert result.exit_code == 1 and not (tmp_path / "ckpt").exists()
    assert f"{hub}: model.layers.0.mlp.experts.gate_up_proj: cannot make it from the stored" in result.stderr
    assert "mlp.experts.*.up_proj.weight" in result.stderr and "Traceback" not in result.stderr


def test_moe_configs_get_the_moe_family(moe_dir):
    from transformers import AutoConfig

    family = family_of(AutoConfig.from_pretrained(moe_dir))
    assert isinstance(family, MoeFamily) and family.name == "qwen3_moe" and not family.takes_images


def _batch(rows):
    """Left-padded prompts and right-padded responses of `rows` [(prompt ids, response ids)]."""
    width_p, width_r = max(len(p) for p, _ in rows), max(len(r) for _, r in rows)
    widths = {"prompt_ids": width_p, "prompt_mask": width_p, "response_ids": width_r, "response_mask": width_r}
    out = {k: torch.zeros(len(rows), w, dtype=torch.long) for k, w in widths.items()}
    for i, (p, r) in enumerate(rows):
        out["prompt_ids"][i, width_p - len(p) :], out["prompt_mask"][i, width_p - len(p) :] = torch.tensor(p), 1
        out["response_ids"][i, : len(r)], out["response_mask"][i, : len(r)] = torch.tensor(r), 1
    return out


def test_scoring_logprobs_equal_transformers_forward(moe_dir):
    from transformers import AutoModelForCausalLM

    rows = [([1, 5, 6], [7, 8, 9, 2]), ([1, 10, 11, 12, 13], [4, 2]), ([1, 3], [5, 6, 7, 8, 9, 10])]
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    want = torch.zeros(3, 6)
    with torch.no_grad():
        for i, (p, r) in enumerate(rows):  # each sample alone, no padding
            logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : -1]
            want[i, : len(r)] = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(r)[:, None])[:, 0]
    scorer = ModuleScorer(model, CPU)
    padded = scorer.logprobs(_batch(rows), 1.0, torch.float32, micro_batch_size=3, impl="naive")
    packed = scorer.logprobs(_batch(rows), 1.0, torch.float32, micro_batch_size=3, impl="naive", max_tokens=64)
    assert torch.allclose(padded, want, atol=1e-5), (padded - want).abs().max()
    assert torch.allclose(packed, want, atol=1e-5), (packed - want).abs().max()


def test_rollout_score_train_step_eval(tmp_path, moe_ckpt, moe_rollouts, prompts_file):
    records = read_jsonl(moe_rollouts)
    assert len(records) == 16 and all(r["response_ids"] and len(r["rollout_logprobs"]) == len(r["response_ids"])
                                      for r in records)  # fmt: skip
    reward = write_length_reward(tmp_path)
    cli_ok("score", "--rollouts", moe_rollouts, "--actor", moe_ckpt, "--reward", f"{reward}:score", "--out", tmp_path)
    batch = TrainBatch.load(tmp_path / "batch.safetensors")
    assert batch.old_logprobs[batch.response_mask].abs().sum() > 0
    metrics = tmp_path / "m.jsonl"
    cli_ok("train-step", "--checkpoint", moe_ckpt, "--batch", tmp_path / "batch.safetensors", "--out",
           tmp_path / "step1", "--lr", "1e-2", "--metrics", metrics)  # fmt: skip
    before, after = read_weights(moe_ckpt), read_weights(tmp_path / "step1")
    assert before.keys() == after.keys()
    for key in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.gate.weight"):
        assert not torch.equal(before[key], after[key]), key
    assert "actor/pg_loss" in read_jsonl(metrics)[0]
    cli_ok("merge", "--checkpoint", tmp_path / "step1", "--out", tmp_path / "merged")  # trained experts, hub layout
    with safe_open(str(tmp_path / "merged" / "model.safetensors"), "pt") as f:
        assert "model.layers.0.mlp.experts.3.up_proj.weight" in set(f.keys())
    prompts = write_jsonl(tmp_path / "p.jsonl", read_jsonl(prompts_file)[:4])
    cli_ok("eval", "--model", tmp_path / "step1", "--prompts", prompts, "--reward", "arith", "--out", tmp_path / "ev",
           "--max-new-tokens", "3")  # fmt: skip
    assert len(read_jsonl(tmp_path / "ev" / "eval.jsonl")) == 4


def test_lora_on_attention_and_a_critic(tmp_path, moe_ckpt, moe_rollouts):
    lora = tmp_path / "lora"
    cli_ok(
        "shard",
        "--model",
        moe_ckpt,
        "--out",
        lora,
        "--lora-rank",
        "4",
        "--lora-target-modules",
        "q_proj",
        "--lora-target-modules",
        "v_proj",
    )
    critic = tmp_path / "critic"
    cli_ok("shard", "--role", "critic", "--model", moe_ckpt, "--seed", "1", "--out", critic)
    config = json.loads((critic / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForTokenClassification"]
    reward = write_length_reward(tmp_path)
    cli_ok("score", "--rollouts", moe_rollouts, "--actor", lora, "--critic", critic, "--estimator", "gae",
           "--reward", f"{reward}:score", "--out", tmp_path / "s")  # fmt: skip
    batch = tmp_path / "s" / "batch.safetensors"
    assert TrainBatch.load(batch).values[TrainBatch.load(batch).response_mask].abs().sum() > 0
    cli_ok("train-step", "--checkpoint", lora, "--batch", batch, "--out", tmp_path / "lora1", "--lr", "1e-2")
    cli_ok("train-step", "--role", "critic", "--checkpoint", critic, "--batch", batch, "--out", tmp_path / "c1",
           "--lr", "1e-2")  # fmt: skip
    before, after = read_weights(critic), read_weights(tmp_path / "c1")
    assert not torch.equal(
        before["model.layers.0.mlp.experts.down_proj"], after["model.layers.0.mlp.experts.down_proj"]
    )


def test_lora_on_the_experts_through_the_stages(tmp_path, moe_dir, moe_ckpt, prompts_file):
    """shard with --lora-target-parameters, rollout (routing recorded), score and train-step with router replay,
    merge (the hub's per-expert layout) equal to PEFT's merge_and_unload of the --adapter-only folder, and the hf and
    native engines' tokens with the adapters (seeded sampling) equal to the merged model's."""
    import copy
    import dataclasses

    from transformers import AutoModelForCausalLM

    from rlx.checkpoints.loading import load_model
    from rlx.models.loading import ModelSource, read_safetensors
    from rlx.models.tiny import build_char_tokenizer
    from rlx.rollout.config import NativeConfig, RolloutConfig, SamplingParams
    from tests.conftest import generate, make_engine
    from tests.stages.test_lora_stages import peft
    from tests.unit.test_vllm_moe import PROMPTS

    lora0, lora1 = tmp_path / "lora0", tmp_path / "lora1"
    cli_ok("shard", "--model", moe_ckpt, "--out", lora0, "--lora-rank", "4", "--lora-init", "random",
           "--lora-target-modules", "q_proj", "--lora-target-parameters", "all-experts")  # fmt: skip
    assert json.loads((lora0 / "lora.json").read_text())["lora"]["target_parameters"] == ["all-experts"]
    rollouts = tmp_path / "r.jsonl"
    cli_ok(*rollout_args(lora0, prompts_file, rollouts, "--engine", "native"))
    assert all(r["routed_experts"] for r in read_jsonl(rollouts))
    reward = write_length_reward(tmp_path)
    cli_ok("score", "--rollouts", rollouts, "--actor", lora0, "--reward", f"{reward}:score", "--out", tmp_path / "s",
           "--router-replay", "rollout", "--metrics", tmp_path / "score.jsonl")  # fmt: skip
    assert read_jsonl(tmp_path / "score.jsonl")[0]["moe/routing_mismatch"] == 0.0  # native rollout == trainer
    metrics = tmp_path / "train.jsonl"
    cli_ok("train-step", "--checkpoint", lora0, "--batch", tmp_path / "s" / "batch.safetensors", "--out", lora1,
           "--lr", "1e-2", "--router-replay", "rollout", "--use-packing", "--metrics", metrics)  # fmt: skip
    assert read_jsonl(metrics)[0]["actor/moe_routing_mismatch"] == 0.0
    before, after = (read_safetensors(d / "adapter.safetensors") for d in (lora0, lora1))
    expert = "model.layers.0.mlp.experts.base_layer.lora_B.weight"  # gate_up_proj's B [2I, r E]
    assert after[expert].shape == (32, 16) and not torch.equal(before[expert], after[expert])
    # continues the adapters and their AdamW state
    cli_ok("train-step", "--checkpoint", lora1, "--batch", tmp_path / "s" / "batch.safetensors", "--out",
           tmp_path / "lora2", "--lr", "1e-2", "--use-packing")  # fmt: skip
    assert f"{expert}::exp_avg" in read_safetensors(lora1 / "optimizer.safetensors")
    assert not torch.equal(read_safetensors(tmp_path / "lora2" / "adapter.safetensors")[expert], after[expert])

    cli_ok("merge", "--checkpoint", lora1, "--out", tmp_path / "merged")
    cli_ok("merge", "--checkpoint", lora1, "--out", tmp_path / "peft", "--adapter-only")
    with safe_open(str(tmp_path / "merged" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names and not any("lora" in n for n in names)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "peft").merge_and_unload().state_dict()
    assert max((t - theirs[k]).abs().max().item() for k, t in merged.state_dict().items()) < 1e-6

    live = load_model(ModelSource(lora1), adapters=True).requires_grad_(False)  # base + adapters (PEFT layers)
    tokenizer = build_char_tokenizer()
    cfg = RolloutConfig(chat_template="off", sampling=SamplingParams(n=2, max_new_tokens=8, seed=3))  # sampled
    want = generate(make_engine(merged, tokenizer, cfg), PROMPTS, cfg)
    assert len({tuple(r.response_ids) for r in want}) > 4  # (greedy decoding of this tiny model repeats one token)
    plain = generate(make_engine(base, tokenizer, cfg), PROMPTS, cfg)  # the adapters change the policy:
    assert max(abs(a.rollout_logprobs[0] - b.rollout_logprobs[0]) for a, b in zip(want, plain)) > 0.05
    for engine, mode in (("hf", "merged"), ("native", "merged"), ("native", "adapters")):
        run = dataclasses.replace(cfg, engine=engine, kv_cache_gib=0.01, native=NativeConfig(lora_rollout=mode))
        got = generate(make_engine(live, tokenizer, run), PROMPTS, run)
        assert [r.response_ids for r in got] == [r.response_ids for r in want], (engine, mode)
        for a, b in zip(got, want):
            assert max(abs(x - y) for x, y in zip(a.rollout_logprobs, b.rollout_logprobs)) < 1e-4, (engine, mode)
            assert engine == "hf" or a.routed_experts is not None


def test_ppo_with_lora_on_the_experts_native_rollouts_and_router_replay(tmp_path):
    """`rlx ppo` with adapters on the experts: the native engine's merged replica (filled, then refreshed after the
    update) samples what the trainer computes, routing replays without mismatch, and the reference (adapters off)
    differs from the random-initialised adapters from step 1 on."""
    from tests.conftest import REPO

    cli_ok("ppo", REPO / "recipes" / "moe_quickstart.toml", "--out", tmp_path / "run", "--set", "steps=2",
           "--set", "data.prompts_per_step=4", "--set", "rollout.sampling.n=2", "--set", "train.optim.lr=1e-2",
           "--set", "lora.rank=4", "--set", "lora.init=random", "--set", 'lora.target_parameters=["all-experts"]',
           "--set", "rollout.engine=native", "--set", "score.router_replay=rollout",
           "--set", "train.router_replay=rollout", "--set", "train.use_packing=true")  # fmt: skip
    steps = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(steps) == 2
    for line in steps:
        assert line["rollout_corr/logprob_abs_diff_max"] < 1e-4
        assert line["moe/routing_mismatch"] == line["actor/moe_routing_mismatch"] == 0.0
        assert abs(line["actor/ref_kl"]) > 1e-3


@pytest.mark.parametrize("engine", ["hf", "native"])
def test_rollout_logprobs_equal_transformers_forward(tmp_path, moe_dir, moe_ckpt, prompts_file, engine):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "r.jsonl"
    cli_ok(*rollout_args(moe_ckpt, prompts_file, out, "--engine", engine))
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    for record in read_jsonl(out):
        prompt, response = record["prompt_ids"], record["response_ids"]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
        want = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(record["rollout_logprobs"]), want, atol=1e-4), record["id"]


def test_router_probe_aux_loss_matches_transformers_and_expert_load_counts_every_slot():
    from transformers import AutoModelForCausalLM

    from rlx.models.moe import RouterProbe, moe_sizes, tiny_moe_config

    config = tiny_moe_config(19, num_hidden_layers=1, output_router_logits=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11]])
    num_experts, top_k = moe_sizes(config)
    with torch.no_grad(), RouterProbe(model) as probe:
        out = model(input_ids=ids)
    # transformers' loss counts each of the k slots as a whole token (uniform load gives k); ours averages them
    assert torch.allclose(probe.aux_loss(num_experts, top_k) * top_k, out.aux_loss, atol=1e-6)
    load = probe.expert_load(num_experts)
    assert load.sum() == ids.numel() * top_k and load.shape == (num_experts,)


def test_load_balancing_loss_option_trains_the_routers(tmp_path, moe_ckpt, moe_rollouts):
    reward = write_length_reward(tmp_path)
    cli_ok("score", "--rollouts", moe_rollouts, "--actor", moe_ckpt, "--reward", f"{reward}:score", "--out", tmp_path)
    batch, gates = tmp_path / "batch.safetensors", {}
    for coef in ("0", "1.0"):
        metrics = tmp_path / f"m{coef}.jsonl"
        cli_ok("train-step", "--checkpoint", moe_ckpt, "--batch", batch, "--out", tmp_path / f"s{coef}", "--lr", "1e-2",
               "--moe-aux-loss-coef", coef, "--metrics", metrics)  # fmt: skip
        line = read_jsonl(metrics)[0]
        assert line["actor/moe_aux_loss"] > 0 and line["actor/moe_max_expert_load"] >= 1.0
        gates[coef] = read_weights(tmp_path / f"s{coef}")["model.layers.0.mlp.gate.weight"]
    assert not torch.equal(gates["0"], gates["1.0"])  # the loss reaches the routers


def test_a_negative_load_balancing_coefficient_is_a_user_error(tmp_path, moe_ckpt):
    from tests.conftest import cli

    result = cli("train-step", "--checkpoint", moe_ckpt, "--batch", tmp_path / "b.safetensors", "--out", tmp_path / "o",
                 "--moe-aux-loss-coef", "-1")  # fmt: skip
    assert result.exit_code == 1 and "--moe-aux-loss-coef: must be >= 0" in result.stderr
