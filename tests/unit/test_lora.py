"""LoRA on tiny models: config and target errors, frozen base in the compute dtype, exact base model with the
adapters off or zero, packed == padded logprobs, adapter state and base identity, merged weights (live model
untouched, in-place refresh), PEFT folders that PEFT loads, adapter-only train steps, FSDP2 == one process."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlx.algorithms.config import LossConfig
from rlx.config import from_dict
from rlx.errors import UserError
from rlx.formats.batch import BatchMeta, TrainBatch
from rlx.logprobs import packed_response_logprobs, packed_response_values, response_logprobs, response_values
from rlx.models.attention import enable_packed_attention
from rlx.models.loading import tied_keys
from rlx.models.lora import adapters_disabled, apply_lora, hf_name, is_lora_model, trained_parameters
from rlx.models.lora_config import LoraConfig
from rlx.models.lora_merge import merged_weights, refresh_merged_weights, save_peft_adapter
from rlx.models.lora_state import adapter_state, base_identity, check_base_identity, load_adapter_state
from rlx.models.tiny import tiny_llama_config
from rlx.models.value import build_value_model
from rlx.parallel.fsdp import decoder_layers
from rlx.training.actor import ActorTrainer
from rlx.training.config import OptimConfig, TrainConfig
from rlx.training.critic import CriticTrainer
from tests.conftest import WORKERS, run_torchrun
from tests.unit.test_packing import tiny_config

peft = pytest.importorskip("peft")
FAMILIES = ("llama", "qwen2")  # tied embeddings, no biases / untied head, q/k/v biases
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def plain(family: str = "llama", seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny float32 causal LM (llama: the quickstart's config, tied; qwen2: untied, attention biases)."""
    config = tiny_llama_config(19, **overrides) if family == "llama" else tiny_config("qwen2", **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def with_lora(model: torch.nn.Module, dtype=torch.float32, seed: int = 1, **cfg) -> torch.nn.Module:
    """A copy of `model` with adapters (the original stays plain)."""
    return apply_lora(copy.deepcopy(model), LoraConfig(**{"rank": 4, **cfg}), dtype, seed).eval()


def inputs(seed: int = 0, vocab: int = 19) -> dict[str, torch.Tensor]:
    """4 rows: left-padded prompts [4, 3], right-padded responses [4, 4]."""
    gen = torch.Generator().manual_seed(seed)
    prompt_mask = torch.tensor([[1, 1, 1], [0, 1, 1], [0, 0, 1], [1, 1, 1]], dtype=torch.bool)
    response_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    prompt_ids = torch.randint(4, vocab, (4, 3), generator=gen) * prompt_mask
    response_ids = torch.randint(4, vocab, (4, 4), generator=gen) * response_mask
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "response_ids": response_ids,
            "response_mask": response_mask}  # fmt: skip


def logprobs(model, packed: bool = False, **kw) -> torch.Tensor:
    fn = packed_response_logprobs if packed else response_logprobs
    logp, _ = fn(model, **inputs(), temperature=1.0, dtype=torch.float32, **kw)
    return logp * inputs()["response_mask"]


def logits(model, ids=None) -> torch.Tensor:
    ids = torch.tensor([[1, 5, 6, 7, 8, 9, 10], [1, 11, 12, 13, 14, 4, 5]]) if ids is None else ids
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


# --- config and targets ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"rank": 0}, r"lora\.rank: must be > 0, got 0"),
        ({"rank": -2}, r"lora\.rank: must be > 0, got -2"),
        ({"alpha": 0.0}, r"lora\.alpha"),
        ({"dropout": 1.0}, r"lora\.dropout: must be in \[0, 1\)"),
        ({"target_modules": []}, r"lora\.target_modules: expected at least one"),
        ({"target_modules": ["all-linear", "q_proj"]}, r"lora\.target_modules: 'all-linear' already covers"),
        ({"init": "pissa"}, r"lora\.init: expected one of 'default' \| 'gaussian' \| 'random'"),
        ({"rnak": 4}, r"lora\.rnak: unknown key"),
    ],
)
def test_bad_config_is_a_user_error_naming_the_key(fields, match):
    with pytest.raises(UserError, match=match):
        from_dict(LoraConfig, fields, prefix="lora")


def test_a_target_that_matches_nothing_lists_the_linear_layers():
    with pytest.raises(UserError, match=r"'qproj' matches no linear layer of LlamaForCausalLM's backbone") as e:
        apply_lora(plain(), LoraConfig(target_modules=["q_proj", "qproj"]))
    assert "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj" in str(e.value)
    with pytest.raises(UserError, match="'lm_head' matches no linear layer"):  # heads are not targets
        apply_lora(plain("qwen2"), LoraConfig(target_modules=["lm_head"]))


def adapted_layers(model) -> list[str]:
    return [name.removesuffix(".lora_A.default.weight") for name, _ in model.named_parameters() if ".lora_A." in name]


def test_targets_all_linear_and_by_name():
    everything = adapted_layers(with_lora(plain("qwen2")))
    assert everything == [f"model.layers.{i}.{part}" for i in range(2) for part in
                          ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]  # fmt: skip
    critic = with_lora(build_value_model(plain(), seed=0))  # the value head is trained in full, not adapted
    assert len(adapted_layers(critic)) == 14 and not any("score" in n for n in adapted_layers(critic))
    chosen = adapted_layers(with_lora(plain(), target_modules=["q_proj", "layers.1.mlp.down_proj"]))
    layers = "model.layers"
    assert chosen == [f"{layers}.0.self_attn.q_proj", f"{layers}.1.self_attn.q_proj", f"{layers}.1.mlp.down_proj"]
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        apply_lora(with_lora(plain()), LoraConfig())


# --- dtypes, trainable parameters, Hugging Face structure -----------------------------------------------------


def test_base_frozen_in_compute_dtype_adapters_float32_and_hf_structure_kept():
    model = with_lora(plain(), dtype=torch.bfloat16)
    for name, param in model.named_parameters():
        is_adapter = ".lora_" in name
        assert param.requires_grad == is_adapter, name
        assert param.dtype == (torch.float32 if is_adapter else torch.bfloat16), name
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32  # buffers keep their dtype
    assert is_lora_model(model) and not is_lora_model(plain())
    assert type(model).__name__ == "LlamaForCausalLM" and len(decoder_layers(model)) == 2  # FSDP's unit list
    assert "lm_head.weight" in tied_keys(model)  # embedding and head never wrapped: still tied
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert hf_name("model.layers.0.self_attn.q_proj.base_layer.weight") == "model.layers.0.self_attn.q_proj.weight"
    with torch.autocast("cpu", torch.bfloat16):
        assert torch.isfinite(logits(model)).all()
    assert torch.isfinite(logits(model)).all()  # bf16 base, float32 adapters, no autocast


def test_value_model_trains_adapters_and_its_head_in_float32():
    critic = with_lora(build_value_model(plain(), seed=0), dtype=torch.bfloat16)
    trained = {n for n, p in critic.named_parameters() if p.requires_grad}
    assert trained == set(trained_parameters(critic)) and {"score.weight", "score.bias"} <= trained
    assert all(critic.get_parameter(n).dtype == torch.float32 for n in trained)
    values = response_values(critic, **inputs(), dtype=torch.bfloat16)
    packed = packed_response_values(critic, **inputs(), dtype=torch.bfloat16)
    assert values.shape == (4, 4) and torch.isfinite(values).all() and torch.isfinite(packed).all()


# --- exactness: zero adapters, adapters off, packing ----------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_zero_initialised_adapters_give_the_base_logprobs_exactly(family):
    base = plain(family)
    model = with_lora(base)  # init 'default': B = 0
    enable_packed_attention(base)
    enable_packed_attention(model)
    for packed in (False, True):
        assert torch.equal(logprobs(model, packed), logprobs(base, packed)), packed


@pytest.mark.parametrize("family", FAMILIES)
def test_adapters_disabled_is_exactly_the_base_model(family):
    base = plain(family)
    model = with_lora(base, init="random")
    assert (logits(model) - logits(base)).abs().max() > 1e-2  # the adapters do change the model
    flags = [p.requires_grad for p in model.parameters()]
    with adapters_disabled(model):
        assert torch.equal(logits(model), logits(base))
        assert torch.equal(logprobs(model), logprobs(base))
    assert (logits(model) - logits(base)).abs().max() > 1e-2  # on again
    assert [p.requires_grad for p in model.parameters()] == flags  # PEFT's own switch would clear these
    with pytest.raises(RuntimeError), adapters_disabled(model):
        raise RuntimeError
    assert not any(layer._disable_adapters for layer in model.modules() if hasattr(layer, "_disable_adapters"))


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_equals_padded_and_only_adapters_get_gradients(family):
    model = with_lora(plain(family), init="random").train()
    enable_packed_attention(model)
    grads = []
    for packed in (False, True):
        model.zero_grad(set_to_none=True)
        logp = logprobs(model, packed)
        logp.sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        if not packed:
            padded = logp.detach()
    assert (logprobs(model, True) - padded).abs().max() < 1e-5
    for packed in (False, True):  # the fused path reads the (untouched) LM head's weight
        assert (logprobs(model, packed, impl="chunked") - padded).abs().max() < 1e-5
    assert set(grads[0]) == set(grads[1]) == {n for n in dict(model.named_parameters()) if ".lora_" in n}
    for name, grad in grads[0].items():
        assert grad.abs().max() > 0, name
        assert (grads[1][name] - grad).abs().max() <= 1e-5 * grad.abs().max().clamp(min=1), name


# --- adapter state and base identity --------------------------------------------------------------------------


def test_adapter_state_round_trip_with_stable_names():
    base = plain()
    model = with_lora(base, init="random", seed=1)
    state = adapter_state(model)
    assert "model.layers.0.self_attn.q_proj.lora_A.weight" in state and len(state) == 28
    assert all(".default." not in n and t.dtype == torch.float32 for n, t in state.items())
    other = with_lora(base, init="random", seed=2)
    assert not torch.equal(logits(other), logits(model))
    load_adapter_state(other, state, "ckpt/adapter.safetensors")
    assert torch.equal(logits(other), logits(model))
    with pytest.raises(UserError, match=r"ckpt: adapter tensor model\.layers\.0\.self_attn\.q_proj\.lora_A\.weight "
                                         r"has shape \(4, 64\), this model's has \(8, 64\)"):  # fmt: skip
        load_adapter_state(with_lora(base, rank=8), state, "ckpt")
    with pytest.raises(UserError, match=r"ckpt: adapter tensor .*\.o_proj\.lora_A\.weight has no counterpart"):
        load_adapter_state(with_lora(base, target_modules=["q_proj", "k_proj", "v_proj"]), state, "ckpt")
    with pytest.raises(UserError, match=r"ckpt: adapter state lacks model\.layers\.0\.self_attn\.q_proj\.lora_A"):
        load_adapter_state(model, {}, "ckpt")


def test_base_identity_survives_save_load_and_casts_and_names_differences(tmp_path):
    base = plain()
    identity = json.loads(json.dumps(base_identity(base)))  # as rlx.json gives it back
    base.save_pretrained(tmp_path / "hf")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    assert base_identity(reloaded) == identity
    assert base_identity(with_lora(base, dtype=torch.bfloat16)) == identity  # adapters left out, bf16 rounding
    check_base_identity(identity, with_lora(reloaded), "ckpt")
    with pytest.raises(UserError, match=r"ckpt: the base model's weights differ from the adapters' base"):
        check_base_identity(identity, plain(seed=5), "ckpt")
    with pytest.raises(UserError, match=r"ckpt: base tensor model\.embed_tokens\.weight has shape \(19, 96\), the "
                                         r"adapters' base had \(19, 64\)"):  # fmt: skip
        check_base_identity(identity, plain(hidden_size=96), "ckpt")
    with pytest.raises(UserError, match=r"ckpt: the base model has no tensor model\.layers\.1\."):
        check_base_identity(identity, plain(num_layers=1), "ckpt")
    changed = plain()
    changed.config.rms_norm_eps = 1e-3
    with pytest.raises(UserError, match=r"ckpt: base config rms_norm_eps is 0\.001, the adapters' base had 1e-06"):
        check_base_identity(identity, changed, "ckpt")
    with pytest.raises(UserError, match=r"trained on a LlamaForCausalLM, this base model is a Qwen2ForCausalLM"):
        check_base_identity(identity, plain("qwen2"), "ckpt")


def test_value_model_identity_leaves_out_the_trained_head():
    critic = build_value_model(plain(), seed=0)
    identity = base_identity(critic)
    assert "score.weight" not in identity["shapes"] and "model.norm.weight" in identity["shapes"]
    trained = with_lora(critic)
    with torch.no_grad():
        trained.score.weight.add_(1.0)
    check_base_identity(identity, trained, "critic")


# --- merged weights ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_merged_weights_equal_applying_the_adapters_without_touching_the_model(family):
    base = plain(family)
    model = with_lora(base, init="random")
    before = {n: t.clone() for n, t in model.state_dict().items()}
    merged = merged_weights(model)
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())  # live model unchanged
    assert list(merged) == [n for n, _ in base.named_parameters()]  # Hugging Face names, tied ones once
    target = copy.deepcopy(base)
    target.load_state_dict(merged, strict=False)
    assert (logits(target) - logits(model)).abs().max() < 1e-5
    assert (logits(target) - logits(base)).abs().max() > 1e-2


def test_refresh_merged_weights_in_place_after_each_update():
    base = plain()
    model = with_lora(base, init="random")
    replica = copy.deepcopy(base).to(torch.bfloat16)  # a rollout engine's plain model, in its own dtype
    storage = {n: p.data_ptr() for n, p in replica.named_parameters()}
    assert refresh_merged_weights(replica, model) == len(list(base.named_parameters()))
    assert (logits(replica) - logits(model)).abs().max() < 0.05  # bf16 replica
    with torch.no_grad():  # an update changes the adapters only
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.mul_(-2.0)
    assert refresh_merged_weights(replica, model, include_frozen=False) == 14  # the adapted weights only
    replica32 = copy.deepcopy(base)
    refresh_merged_weights(replica32, model)
    name = "model.layers.0.mlp.up_proj.weight"  # merged in float32, rounded once to the replica's dtype
    assert torch.equal(replica.get_parameter(name), replica32.get_parameter(name).to(torch.bfloat16))
    assert (logits(replica32) - logits(model)).abs().max() < 1e-5
    assert storage == {n: p.data_ptr() for n, p in replica.named_parameters()}  # in place
    with pytest.raises(ValueError, match="shape"):
        refresh_merged_weights(plain(hidden_size=96), model)


# --- PEFT adapter folders -------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_folder_loads_in_peft_with_the_same_logits(tmp_path, family):
    base = plain(family)
    model = with_lora(base, init="random", target_modules=["q_proj", "v_proj", "down_proj"], alpha=8.0)
    folder = save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path="some/base")
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["target_modules"] == ["down_proj", "q_proj", "v_proj"] and config["r"] == 4
    assert config["base_model_name_or_path"] == "some/base" and config["task_type"] == "CAUSAL_LM"
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), folder).eval()
    assert torch.equal(logits(loaded), logits(model))


def test_peft_folder_of_a_value_model_carries_its_head(tmp_path):
    critic = build_value_model(plain(), seed=0)
    model = with_lora(critic, init="random")
    with torch.no_grad():
        model.score.weight.add_(0.5)  # a trained head
    folder = save_peft_adapter(model, tmp_path / "adapter")
    assert json.loads((folder / "adapter_config.json").read_text())["modules_to_save"] == ["score"]
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(critic), folder).eval()
    assert torch.equal(logits(loaded), logits(model))


# --- training: only adapters change ---------------------------------------------------------------------------


def make_batch(model, seed: int = 0) -> TrainBatch:
    """A scored batch of `inputs(seed)`: old logprobs from `model`, reference from its base (adapters off)."""
    t = inputs(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    mask = t["response_mask"]
    with torch.no_grad():
        old = logprobs(model)
        with adapters_disabled(model):
            ref = logprobs(model)
    meta = BatchMeta(sample_ids=[f"{i // 2}/{i % 2}" for i in range(4)], group_ids=[str(i // 2) for i in range(4)],
                     vocab_size=19, pad_token_id=0, temperature=1.0)  # fmt: skip
    return TrainBatch(
        **t, rollout_logprobs=old, old_logprobs=old, ref_logprobs=ref,
        advantages=torch.randn(4, 4, generator=gen) * mask, returns=torch.randn(4, 4, generator=gen) * mask,
        values=torch.randn(4, 4, generator=gen) * mask, token_rewards=torch.zeros(4, 4), rewards=torch.zeros(4),
        meta=meta,
    )  # fmt: skip


@pytest.mark.parametrize(("use_packing", "gradient_checkpointing"), [(False, False), (True, True)])
def test_actor_train_step_changes_only_the_adapters(use_packing, gradient_checkpointing):
    model = with_lora(plain(), dropout=0.1)  # default init: B = 0, the policy starts as the base
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = TrainConfig(
        optim=OptimConfig(lr=1e-2), micro_batch_size=2, loss=LossConfig(kl_loss_coef=0.1), use_packing=use_packing,
        gradient_checkpointing=gradient_checkpointing,
    )  # fmt: skip
    trainer = ActorTrainer(model, cfg, torch.device("cpu"), torch.float32)
    batch = make_batch(model)
    for step in range(2):  # B moves first, A once B is non-zero
        metrics = trainer.train_step(batch, step)
        assert metrics["actor/grad_norm"] > 0
    for name, param in model.named_parameters():
        changed = not torch.equal(param.detach(), before[name])
        assert changed == (".lora_" in name), name
    state = trainer.optimizer_state()  # AdamW state for the 28 adapter matrices only
    assert {key.split("::")[0] for key in state} == set(trained_parameters(model)) and len(state) == 28 * 3


def test_critic_train_step_changes_adapters_and_head_only():
    model = with_lora(build_value_model(plain(), seed=0))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = CriticTrainer(
        model, TrainConfig(role="critic", optim=OptimConfig(lr=1e-2)), torch.device("cpu"), torch.float32
    )
    trainer.train_step(make_batch(with_lora(plain())), 0)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed == {n for n, _ in model.named_parameters() if ".lora_" in n or n.startswith("score.")}


# --- FSDP2 ----------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_fsdp_train_steps_on_two_ranks_equal_one_process(tmp_path):
    out = run_torchrun(2, WORKERS / "lora_fsdp.py", timeout=300)
    assert "rank 0: 2 ranks == 1 rank" in out.stdout
