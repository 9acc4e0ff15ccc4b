"""LoRA on a mixture-of-experts model's fused expert weights (`lora.target_parameters`, PEFT's ParamWrapper) on a tiny
Qwen3-MoE: targets and their errors, the adapted model computes what PEFT's own wrapping of the plain transformers
model computes in each experts forward rlx trains and scores with (transformers' own, the autocast grouped GEMMs,
packed rows), only the adapters train, merged weights equal PEFT's merge_and_unload, the native engine's own expert
path applies the adapters, and expert parallelism refuses them."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlx.algorithms.config import LossConfig
from rlx.config import from_dict
from rlx.errors import UserError
from rlx.logprobs import packed_response_logprobs, response_logprobs
from rlx.models.attention import enable_packed_attention
from rlx.models.lora import adapted_parameters, adapters_disabled, apply_lora, has_expert_adapters, hf_name
from rlx.models.lora_config import LoraConfig
from rlx.models.lora_experts import active_expert_weights, expert_delta
from rlx.models.lora_merge import merged_weights, save_peft_adapter
from rlx.models.lora_state import adapter_state
from rlx.models.moe import tiny_moe_config
from rlx.parallel.experts import use_autocast_experts
from rlx.training.actor import ActorTrainer
from rlx.training.config import OptimConfig, TrainConfig
from tests.unit.test_lora import inputs, make_batch, plain

peft = pytest.importorskip("peft")
EXPERTS = ["all-experts"]


def plain_moe(seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny float32 Qwen3-MoE (vocab 19 as tests/unit/test_lora.py's inputs; expert width 8, so gate_up_proj
    [4, 16, 32] and down_proj [4, 32, 8] have no square dimension to mix up)."""
    config = tiny_moe_config(19, moe_intermediate_size=8, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def with_experts(model, dtype=torch.float32, seed: int = 1, **cfg) -> torch.nn.Module:
    """A copy of `model` with random (non-zero) adapters on q_proj and every expert weight."""
    fields = {"rank": 4, "alpha": 8.0, "init": "random", "target_modules": ["q_proj"], "target_parameters": EXPERTS}
    return apply_lora(copy.deepcopy(model), LoraConfig(**{**fields, **cfg}), dtype, seed).eval()


def peft_twin(base, model) -> torch.nn.Module:
    """PEFT's own wrapping (get_peft_model) of a copy of the plain `base`, holding `model`'s adapter values."""
    config = model.peft_config["default"]
    twin = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
        r=config.r, lora_alpha=config.lora_alpha, target_modules=sorted(config.target_modules),
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], init_lora_weights=False,
    ))  # fmt: skip
    peft.set_peft_model_state_dict(twin, adapter_state(model))
    return twin.eval()


def logits(model, ids=None) -> torch.Tensor:
    ids = torch.tensor([[1, 5, 6, 7, 8, 9, 10], [1, 11, 12, 13, 14, 4, 5]]) if ids is None else ids
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


# --- targets ----------------------------------------------------------------------------------------------------


def adapted(model) -> list[str]:
    return [hf_name(n) for n in adapted_parameters(model)]


def test_targets_select_expert_weights_by_suffix_or_all_experts():
    base = plain_moe()
    model = with_experts(base)
    layers = "model.layers"
    weights = ("self_attn.q_proj.weight", "mlp.experts.down_proj", "mlp.experts.gate_up_proj")
    assert adapted(model) == [f"{layers}.{i}.{w}" for i in range(2) for w in weights]
    assert has_expert_adapters(model) and not has_expert_adapters(with_experts(base, target_parameters=[]))
    one = with_experts(base, target_modules=[], target_parameters=["layers.1.mlp.experts.gate_up_proj"])
    assert adapted(one) == [f"{layers}.1.mlp.experts.gate_up_proj"]
    down = with_experts(base, target_modules=[], target_parameters=["experts.down_proj"])
    assert adapted(down) == [f"{layers}.{i}.mlp.experts.down_proj" for i in range(2)]
    state = adapter_state(model)  # PEFT's paths: the inner wrapper (gate_up_proj) keeps its 'base_layer'
    assert state[f"{layers}.0.mlp.experts.base_layer.lora_A.weight"].shape == (4 * 4, 32)  # [r E, H]
    assert state[f"{layers}.0.mlp.experts.lora_A.weight"].shape == (4 * 4, 8)  # down_proj's: [r E, I]
    assert state[f"{layers}.0.mlp.experts.lora_B.weight"].shape == (32, 4 * 4)  # [H, r E]
    for name, param in model.named_parameters():
        assert param.requires_grad == (".lora_" in name), name


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"target_parameters": ["all-experts", "experts.down_proj"]}, r"lora\.target_parameters: 'all-experts' alr"),
        ({"target_parameters": [""]}, r"lora\.target_parameters: expected non-empty parameter names"),
        ({"target_parameters": ["all-experts"], "dropout": 0.1}, r"lora\.dropout: must be 0 with target_parameters"),
        ({"target_modules": [], "target_parameters": []}, r"lora\.target_modules: expected at least one"),
    ],
)
def test_bad_expert_settings_are_user_errors_naming_the_key(fields, match):
    with pytest.raises(UserError, match=match):
        from_dict(LoraConfig, fields, prefix="lora")


def test_a_target_matching_no_expert_weight_or_a_dense_model_is_a_user_error():
    with pytest.raises(UserError, match=r"'experts\.gate_proj' matches no expert weight of Qwen3MoeForCausalLM \(its "
                                        r"expert weights: mlp\.experts\.down_proj, mlp\.experts\.gate_up_proj, or "
                                        r"'all-experts'\)"):  # fmt: skip
        with_experts(plain_moe(), target_parameters=["experts.gate_proj"])
    with pytest.raises(UserError, match=r"LlamaForCausalLM has no routed experts \(target_parameters adapts a "
                                        r"mixture-of-experts model's fused expert weights"):  # fmt: skip
        with_experts(plain())


def test_peft_reading_dense_mlp_names_as_experts_is_refused():
    """PEFT 0.21 reads gate_proj/up_proj/down_proj in target_modules of a Qwen3-MoE as the transformers-v4 names of
    its experts: a dense MLP layer (mlp_only_layers) named so got no adapter and the experts one instead."""
    dense_layer_1 = plain_moe(mlp_only_layers=[1])
    with pytest.raises(UserError, match=r"PEFT did not adapt what target_modules \['down_proj', 'gate_proj', .*also "
                                        r"adapted model\.layers\.0\.mlp\.experts\.down_proj"):  # fmt: skip
        apply_lora(dense_layer_1, LoraConfig(rank=4))  # all-linear
    with pytest.raises(UserError, match=r"PEFT refused the targets \['gate_proj'\]: Cannot convert PEFT target"):
        apply_lora(plain_moe(mlp_only_layers=[1]), LoraConfig(rank=4, target_modules=["gate_proj"]))


# --- the forwards rlx runs: every one applies the expert adapters --------------------------------------------------


def test_logits_equal_peft_wrapping_of_the_plain_model():
    base = plain_moe()
    model = with_experts(base)
    twin = peft_twin(base, model)
    ours, theirs = logits(model), logits(twin)
    assert (ours - logits(base)).abs().max() > 0.1  # the adapters change the model
    assert (ours - logits(with_experts(base, target_parameters=[]))).abs().max() > 0.1  # the expert ones too
    assert torch.allclose(ours, theirs, atol=1e-6), (ours - theirs).abs().max()
    with adapters_disabled(model):
        assert torch.equal(logits(model), logits(base))


def test_autocast_grouped_experts_apply_the_adapters():
    """A lone training process runs the experts as grouped GEMMs in autocast's dtype (use_autocast_experts), reading
    the weights the ParamWrappers put in place."""
    base = plain_moe()
    model = with_experts(base)
    want, without = logits(peft_twin(base, model)), logits(base)
    use_autocast_experts(model)
    calls = []
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    forward = ALL_EXPERTS_FUNCTIONS["rlx_autocast_experts"]
    ALL_EXPERTS_FUNCTIONS.register("rlx_autocast_experts", lambda *a: calls.append(1) or forward(*a))
    try:
        with torch.autocast("cpu", torch.bfloat16):
            got = logits(model)
    finally:
        ALL_EXPERTS_FUNCTIONS.register("rlx_autocast_experts", forward)
    assert len(calls) == 2  # both MoE layers through rlx's forward
    assert (got - want).abs().max() < 0.05 < (want - without).abs().max(), (got - want).abs().max()


def test_packed_rows_equal_padded_and_gradients_reach_every_experts_adapters():
    base = plain_moe()
    model = with_experts(base).train()
    twin = peft_twin(base, model)
    enable_packed_attention(model)
    padded, _ = response_logprobs(twin, **inputs(), temperature=1.0, dtype=torch.float32)
    packed, _ = packed_response_logprobs(model, **inputs(), temperature=1.0, dtype=torch.float32)
    mask = inputs()["response_mask"]
    assert ((packed - padded) * mask).abs().max() < 1e-5
    (packed * mask).sum().backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().max() > 0}
    assert grads == {n for n, _ in model.named_parameters() if ".lora_" in n} and len(grads) == 12


def test_train_steps_change_the_expert_adapters_and_not_the_base():
    model = with_experts(plain_moe(), init="default")  # B = 0: starts as the base
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = TrainConfig(optim=OptimConfig(lr=1e-2), micro_batch_size=2, loss=LossConfig(kl_loss_coef=0.1),
                      use_packing=True, gradient_checkpointing=True)  # fmt: skip
    trainer = ActorTrainer(model, cfg, torch.device("cpu"), torch.float32)
    batch = make_batch(model)
    for step in range(2):  # B moves first, A once B is non-zero
        assert trainer.train_step(batch, step)["actor/grad_norm"] > 0
    for name, param in model.named_parameters():
        assert (not torch.equal(param.detach(), before[name])) == (".lora_" in name), name
    assert not torch.equal(merged_weights(model)["model.layers.0.mlp.experts.down_proj"],
                           before["model.layers.0.mlp.experts.base_layer.base_layer.down_proj"])  # fmt: skip


def test_expert_parallelism_refuses_lora():
    from rlx.checkpoints.lora_base import lora_spec

    model = plain_moe()
    spec = lora_spec(LoraConfig(rank=4, target_parameters=EXPERTS), "m", "random", 0, model)
    with pytest.raises(UserError, match=r"ep_degree 2: expert parallelism does not train LoRA adapters yet"):
        ActorTrainer(model, TrainConfig(ep_degree=2), torch.device("cpu"), torch.float32, lora=spec)


# --- merged weights and PEFT folders -------------------------------------------------------------------------------


def test_merged_weights_equal_peft_merge_and_unload_and_the_folder_loads_in_peft(tmp_path):
    import json

    base = plain_moe()
    model = with_experts(base)
    merged = merged_weights(model)
    want = peft_twin(base, model).merge_and_unload().state_dict()
    assert list(merged) == [n for n, _ in base.named_parameters()]  # Hugging Face names, tied ones once
    assert max((merged[k] - want[k]).abs().max().item() for k in merged) < 1e-6
    layer = model.model.layers[0].mlp.experts  # rlx's delta is PEFT's, expert by expert
    for wrapper in (layer, layer.base_layer):
        a, b = wrapper.lora_A["default"].weight, wrapper.lora_B["default"].weight
        ours = expert_delta(a, b, 4, wrapper.scaling["default"], True)
        assert torch.allclose(ours, wrapper.get_delta_weight("default"), atol=1e-6)
    folder = save_peft_adapter(model, tmp_path / "adapter")
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["experts.down_proj", "experts.gate_up_proj"]
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), folder).eval()
    assert torch.equal(logits(loaded), logits(model))


def test_native_expert_path_applies_the_adapters_as_the_wrapped_forward():
    from rlx.rollout.native.moe import is_routed, routed_mlp

    model = with_experts(plain_moe())
    mlp = model.model.layers[1].mlp
    assert is_routed(mlp)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out, experts = routed_mlp(mlp, x, impl="padded")
        want = mlp(x[None])
        want = (want[0] if isinstance(want, tuple) else want)[0]
        assert torch.allclose(out, want, atol=1e-5), (out - want).abs().max()
        _, gate_up, _ = active_expert_weights(mlp.experts, "default")
        assert not torch.equal(gate_up, mlp.experts.base_layer.base_layer.gate_up_proj)
        with adapters_disabled(model):
            _, gate_up, down = active_expert_weights(mlp.experts, "default")
            assert gate_up is mlp.experts.base_layer.base_layer.gate_up_proj


def test_critic_train_step_changes_its_expert_adapters_and_head_only():
    from rlx.models.value import build_value_model
    from rlx.training.critic import CriticTrainer

    model = with_experts(build_value_model(plain_moe(), seed=0))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = TrainConfig(role="critic", optim=OptimConfig(lr=1e-2))
    CriticTrainer(model, cfg, torch.device("cpu"), torch.float32).train_step(make_batch(with_experts(plain_moe())), 0)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed == {n for n, _ in model.named_parameters() if ".lora_" in n or n.startswith("score.")}
    assert any(".experts.base_layer.lora_A." in n for n in changed)
