"""The vllm engine on CUDA: vLLM's own loader straight into its parameters (direct load) gives the weights its
in-place reload gives; on an MoE model the engine records each response token's experts from vLLM's routed-experts
output (R3), which the trainer's forward replays to the rollout's logprobs. The GPU tests run with vLLM installed on
a CUDA machine (bench/device/)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from rlx.formats.batch import collate_routes
from rlx.formats.records import PromptRecord
from rlx.models.moe import tiny_moe_config
from rlx.models.tiny import build_char_tokenizer, tiny_llama_config
from rlx.rollout.base import ModuleWeights
from rlx.rollout.config import RolloutConfig, SamplingParams
from rlx.rollout.requests import TokenRequest
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
            released = engine.sleep()  # vLLM's sleep mode: the device's free memory grows by at least the KV cache
            assert released >= 0.2 * 2**30, released
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


def _replay_batch(records) -> dict[str, torch.Tensor]:
    """Left-padded prompts, right-padded responses and the records' routes, as `rlx score` lays a batch out."""
    p, r = max(len(x.prompt_ids) for x in records), max(len(x.response_ids) for x in records)
    out = {k: torch.zeros(len(records), w, dtype=torch.long) for k, w in
           (("prompt_ids", p), ("prompt_mask", p), ("response_ids", r), ("response_mask", r))}  # fmt: skip
    for i, x in enumerate(records):
        out["prompt_ids"][i, p - len(x.prompt_ids) :] = torch.tensor(x.prompt_ids)
        out["prompt_mask"][i, p - len(x.prompt_ids) :] = 1
        out["response_ids"][i, : len(x.response_ids)] = torch.tensor(x.response_ids)
        out["response_mask"][i, : len(x.response_ids)] = 1
    out["routed_experts"] = collate_routes(records, p, r)
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run with RLX_TEST_GPU=1)")
def test_moe_rollouts_record_the_routing_the_trainer_replays():
    """A tiny Qwen3-MoE whose first layer is dense (vLLM's routing rows of it are dropped): single-turn samples and
    the token stream record int16 [R, MoE layers, k] routes (and, asked for, the rows of the positions predicting the
    prompt's last 2 tokens, as a multi-turn turn asks for its inserted tokens'); the trainer's forward routes as
    recorded (near-ties aside) and, replaying the record, gives the rollout's logprobs."""
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    from rlx.logprobs import ModuleScorer
    from rlx.models.routing import RouterRecorder
    from rlx.parallel.dist import DistContext

    tokenizer = build_char_tokenizer()
    sizes = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_hidden_layers=3)
    config = tiny_moe_config(len(tokenizer), mlp_only_layers=[0], max_position_embeddings=128, **sizes)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    sampling = SamplingParams(n=2, max_new_tokens=12, temperature=1.0, seed=3)
    cfg = RolloutConfig(engine="vllm", kv_cache_gib=0.25, chat_template="off", gpu_memory_utilization=0.3,
                        precision="float32", sampling=sampling, sleep=False)  # fmt: skip
    # sleep off: vLLM's sleep-mode allocator serves one engine per process (the direct-load test's)
    prompts = [PromptRecord(id=f"p{i}", prompt=text) for i, text in enumerate(["1+2=", "3*4=", "12+7=", "9-5="])]
    engine = make_engine(model.cuda(), tokenizer, cfg, CUDA)
    try:
        assert engine.records_routes and engine.moe_layers == [1, 2]
        records = generate(engine, prompts, cfg)
        requests = [TokenRequest(r.id, r.prompt_ids, 12, num_prompt_routes=2) for r in records]
        streamed = engine.generate_tokens(requests, cfg.sampling)
    finally:
        engine.close()
    for r, g in zip(records, streamed):
        assert r.routed_experts.dtype == torch.int16 and r.routed_experts.shape == (len(r.response_ids), 2, 2)
        assert g.response_ids == r.response_ids and torch.equal(g.routed_experts, r.routed_experts)
        assert g.prompt_routed_experts.dtype == torch.int16 and g.prompt_routed_experts.shape == (2, 2, 2)
    tensors = _replay_batch(records)
    mask = tensors["response_mask"].bool()
    rollout = torch.zeros(mask.shape)
    for i, r in enumerate(records):
        rollout[i, : len(r.response_ids)] = torch.tensor(r.rollout_logprobs)
    scorer = ModuleScorer(model.cpu(), DistContext(device=CPU))
    own, mismatch = scorer.replayed_logprobs(tensors, "off", 1.0, torch.float32, micro_batch_size=4, impl="naive")
    assert mismatch <= 0.05  # the forward's own routers pick the recorded experts (a near-tie may flip)
    with torch.no_grad(), RouterRecorder(model) as recorder:  # the prompt rows: those of the same positions
        differ = 0
        for r, g in zip(records, streamed):
            model(input_ids=torch.tensor([r.prompt_ids]))
            own = recorder.pop()[len(r.prompt_ids) - 3 : -1].sort(-1).values
            differ += int((own != g.prompt_routed_experts.sort(-1).values).any(-1).sum())
    assert differ <= 2  # of 16 (position, layer) pairs (a near-tie may flip)
    replayed, _ = scorer.replayed_logprobs(tensors, "rollout", 1.0, torch.float32, micro_batch_size=4, impl="naive")
    assert torch.allclose(replayed[mask], rollout[mask], atol=2e-3), (replayed[mask] - rollout[mask]).abs().max()
    shifted = dict(tensors, routed_experts=tensors["routed_experts"].roll(1, dims=1))  # one position late
    _, late = scorer.replayed_logprobs(shifted, "rollout", 1.0, torch.float32, micro_batch_size=4, impl="naive")
    assert late > mismatch + 0.1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run with RLX_TEST_GPU=1)")
@pytest.mark.parametrize("name", ["qwen2_vl", "qwen3_vl", "glm4v"])
def test_vision_language_rollouts_equal_the_hf_engine(name):
    """A tiny vision-language model on the vllm engine: vLLM processes the images rebuilt from the requests' pixels
    and repeats each placeholder itself; greedy tokens equal the hf engine's on prompts with no image, one, two, and
    equal words with other images, logprobs within float32 rounding, through generate and the token stream."""
    pytest.importorskip("vllm")
    from rlx.parallel.dist import DistContext
    from rlx.rollout.base import build_engine
    from tests.stages.test_vision_stages import engine_prompts

    model, processor = _tiny_vlm_on_cuda(name)
    prompts = engine_prompts()
    records = {}
    for engine_name in ("vllm", "hf"):
        cfg = RolloutConfig(engine=engine_name, precision="float32", kv_cache_gib=0.25, gpu_memory_utilization=0.3,
                            sleep=False, sampling=SamplingParams(n=1, max_new_tokens=8, temperature=0))  # fmt: skip
        # sleep off: vLLM's sleep-mode allocator serves one engine per process, and the families run in one
        engine = build_engine(cfg, model, processor.tokenizer, DistContext(device=CUDA), processor)
        try:
            records[engine_name] = generate(engine, prompts, cfg)
            if engine_name == "vllm":
                encoded = [processor.encode(p.prompt, prompt_id=p.id) for p in prompts]
                requests = [TokenRequest(p.id, e.input_ids, 8, greedy=True, vision=e.vision if e.image_refs else None)
                            for p, e in zip(prompts, encoded)]  # fmt: skip
                streamed = engine.generate_tokens(requests, cfg.sampling)
        finally:
            engine.close()
    for ours, theirs, stream in zip(records["vllm"], records["hf"], streamed):
        assert ours.prompt_ids == theirs.prompt_ids  # rlx's own expansion in both records
        assert ours.response_ids == theirs.response_ids == stream.response_ids, (name, ours.id)
        torch.testing.assert_close(torch.tensor(ours.rollout_logprobs), torch.tensor(theirs.rollout_logprobs),
                                   atol=5e-3, rtol=0)  # fmt: skip


def _tiny_vlm_on_cuda(name: str):
    """(tiny vision-language model on CUDA with heads of 32, its processor)."""
    from rlx.models.vision.tiny import tiny_vision_config, tiny_vision_processor

    processor = tiny_vision_processor(name)
    config = tiny_vision_config(name, processor.tokenizer, hidden_size=128)  # decoder heads of 32
    config.vision_config.num_heads = 1  # tower heads of 32 (vLLM's attention kernels)
    torch.manual_seed(0)
    return processor.family.load_model_class()(config).float().eval().cuda(), processor


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run with RLX_TEST_GPU=1)")
def test_episodes_with_images_on_vllm_equal_the_hf_engine(tmp_path):
    """Environment episodes whose opening prompts and replies carry images (tests/stages/test_multi_turn_images.py's
    ShowsPictures): on the vllm engine each turn's context goes to vLLM with every image so far where its offsets
    put it; greedy turns, loss masks and image references equal the hf engine's, logprobs within float32 rounding."""
    pytest.importorskip("vllm")
    from rlx.agent.driver import EnvRollout
    from rlx.parallel.dist import DistContext
    from rlx.rollout.base import build_engine
    from tests.conftest import flat_config
    from tests.stages.test_multi_turn_images import ENVS, STOPS, image_prompts

    (tmp_path / "envs.py").write_text(ENVS)
    model, processor = _tiny_vlm_on_cuda("qwen2_vl")
    records = {}
    for engine_name in ("vllm", "hf"):
        cfg = flat_config(RolloutConfig, engine=engine_name, precision="float32", kv_cache_gib=0.25, sleep=False,
                          gpu_memory_utilization=0.3, env=f"{tmp_path}/envs.py:ShowsPictures", n=2, max_new_tokens=6,
                          temperature=0.0, seed=5, stop=list(STOPS), max_total_tokens=500)  # fmt: skip
        engine = build_engine(cfg, model, processor.tokenizer, DistContext(device=CUDA), processor)
        try:
            records[engine_name] = (
                EnvRollout(engine, processor.tokenizer, cfg.sampling, cfg.agent).generate(image_prompts()).records
            )
        finally:
            engine.close()
    assert sum(r.num_turns for r in records["vllm"]) > len(records["vllm"]) + 2  # episodes went past one turn
    for ours, theirs in zip(records["vllm"], records["hf"]):
        assert (ours.response_ids, ours.loss_mask, ours.image_refs) == (
            theirs.response_ids, theirs.loss_mask, theirs.image_refs), ours.id  # fmt: skip
        torch.testing.assert_close(torch.tensor(ours.rollout_logprobs), torch.tensor(theirs.rollout_logprobs),
                                   atol=5e-3, rtol=0)  # fmt: skip
