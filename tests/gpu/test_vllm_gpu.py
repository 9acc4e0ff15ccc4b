"""The vllm engine's weight push on CUDA: vLLM's own loader straight into its parameters (direct load) gives the
weights its in-place reload gives. The GPU test runs with vLLM installed on a CUDA machine (bench/device/)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from rlx.formats.records import PromptRecord
from rlx.models.tiny import build_char_tokenizer, tiny_llama_config
from rlx.rollout.base import ModuleWeights
from rlx.rollout.config import RolloutConfig, SamplingParams
from rlx.rollout.vllm import direct_load_safe
from tests.conftest import generate, make_engine

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def test_direct_load_only_where_vllm_keeps_its_parameters_as_loaded():
    dense = tiny_llama_config(64)
    moe = AutoConfig.for_model("qwen3_moe", num_experts=4, num_experts_per_tok=2, hidden_size=32)
    assert direct_load_safe(CUDA, dense, lora=False)
    assert not direct_load_safe(CPU, dense, lora=False)  # vLLM's CPU GEMMs repack the weights after loading
    assert not direct_load_safe(CUDA, moe, lora=False)
    assert not direct_load_safe(CUDA, dense, lora=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run with RLX_TEST_GPU=1)")
def test_direct_load_equals_the_in_place_reload():
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_llama_config(len(tokenizer), num_heads=2, num_kv_heads=1)).cuda()
    cfg = RolloutConfig(engine="vllm", kv_cache_gib=0.25, chat_template="off", gpu_memory_utilization=0.3)
    cfg.sampling = SamplingParams(n=1, max_new_tokens=8, temperature=0)
    prompts = [PromptRecord(id=f"p{i}", prompt=text) for i, text in enumerate(["1+2=", "3*4=", "12+7="])]
    engine = make_engine(model, tokenizer, cfg, CUDA)
    try:
        assert engine.direct_load
        before = generate(engine, prompts, cfg)
        changed = type(model)(model.config).cuda()
        changed.load_state_dict({k: v + 0.3 * torch.randn_like(v) for k, v in model.state_dict().items()})
        runs = []
        for direct in (True, False):
            engine.direct_load = direct
            engine.sleep()
            engine.wake()
            engine.update_weights(ModuleWeights(changed))
            runs.append(generate(engine, prompts, cfg))
        direct, reload = runs
        assert [r.response_ids for r in direct] == [r.response_ids for r in reload]
        assert [r.rollout_logprobs for r in direct] == [r.rollout_logprobs for r in reload]
        assert [r.rollout_logprobs for r in direct] != [r.rollout_logprobs for r in before]  # the weights changed
        assert engine.counters()["weight_push_s"] > 0
    finally:
        engine.close()
