"""The native engine on mixture-of-experts models, CPU: grouped expert GEMMs equal transformers' expert modules,
compile without graph breaks, native rollouts equal the hf engine's (tokens, logprobs and recorded routing), replay
of the native routing gives the rollout's logprobs, two tensor-parallel ranks decode as one engine, and
bench/moe_step.py runs."""

from __future__ import annotations

import dataclasses
import functools
import subprocess
import sys
import textwrap

import pytest
import torch

from rlx.formats.batch import collate_routes
from rlx.formats.records import PromptRecord
from rlx.kernels.grouped_experts import routed_experts_mlp
from rlx.logprobs import ModuleScorer
from rlx.models.moe import tiny_moe_config
from rlx.parallel.dist import DistContext
from rlx.rollout.config import NativeConfig, RolloutConfig, SamplingParams
from rlx.rollout.native.moe import routed_mlp
from tests.conftest import REPO, flat_config, generate, make_engine, run_torchrun

PROMPTS = [PromptRecord(id=f"p{i}", prompt=text) for i, text in enumerate(["1+2=", "3*4=", "12+7=", "9-5=", "0+0="])]


def _model(model_type: str = "qwen3_moe", vocab: int = 64, seed: int = 0, **sizes):
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(tiny_moe_config(vocab, model_type, **sizes)).eval()


@pytest.fixture(scope="module")
def tiny_moe():
    from rlx.models.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    return _model(vocab=len(tokenizer), max_position_embeddings=128), tokenizer


def _grouped_mm_on_cpu() -> bool:
    try:
        torch._grouped_mm(torch.ones(2, 4), torch.ones(1, 4, 4), offs=torch.tensor([2], dtype=torch.int32))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
def test_routed_layer_equals_the_expert_module_padded_tokens_included(model_type):
    model = _model(model_type, hidden_size=32, moe_intermediate_size=16, intermediate_size=16, num_experts=8)
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(1))
    x[4:] = 0.0  # a CUDA graph's padded entries
    impls = ["padded", "auto"] + (["grouped"] if _grouped_mm_on_cpu() else [])
    with torch.no_grad():
        for layer in model.model.layers:
            want = layer.mlp(x[None])[0]
            _, _, chosen = layer.mlp.gate(x)
            for impl in impls:
                got, experts = routed_mlp(layer.mlp, x, impl)
                assert torch.equal(experts, chosen)
                assert torch.allclose(got, want, atol=1e-6), (impl, (got - want).abs().max())


def test_experts_every_token_to_one_expert_and_empty_experts():
    """Skewed routing: all tokens to expert 3 (the others get none), against a per-token reference."""
    gen = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(5, 8, 6, generator=gen), torch.randn(5, 6, 4, generator=gen)
    x = torch.randn(7, 6, generator=gen)
    experts = torch.tensor([[3, 1]] * 7)
    weights = torch.rand(7, 2, generator=gen)
    want = torch.zeros(7, 6)
    for t in range(7):
        for j in range(2):
            gate, up = (gate_up[experts[t, j]] @ x[t]).chunk(2)
            want[t] += weights[t, j] * (down[experts[t, j]] @ (torch.nn.functional.silu(gate) * up))
    got = routed_experts_mlp(x, experts, weights, gate_up, down, torch.nn.functional.silu, "padded")
    assert torch.allclose(got, want, atol=1e-5)
    with pytest.raises(ValueError, match="experts impl"):
        routed_experts_mlp(x, experts, weights, gate_up, down, torch.nn.functional.silu, "loop")


def test_routed_layer_compiles_into_one_graph():
    """fullgraph=True: no data-dependent Python control flow, shapes dynamic in the token count (the decode graphs'
    ladder); the grouped GEMM traces in bf16 (its meta function's dtype)."""
    model = _model("qwen2_moe", hidden_size=32, moe_intermediate_size=16)
    mlp = model.model.layers[0].mlp
    cases = [("padded", torch.float32)] + ([("grouped", torch.bfloat16)] if _grouped_mm_on_cpu() else [])
    for impl, dtype in cases:
        mlp = mlp.to(dtype)
        step = torch.compile(functools.partial(routed_mlp, impl=impl), fullgraph=True, dynamic=True,
                             backend="aot_eager")  # fmt: skip
        with torch.no_grad():
            for tokens in (5, 9):
                x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(tokens)).to(dtype)
                got, experts = step(mlp, x)
                want, chosen = routed_mlp(mlp, x, impl)
                assert torch.equal(experts, chosen) and torch.allclose(got, want, atol=1e-6), impl


@pytest.mark.parametrize(
    "settings",
    [
        dict(n=2, max_new_tokens=10, temperature=0),
        dict(n=3, max_new_tokens=10, temperature=1.0, seed=4),
        # a tiny cache, few sequences at once: refills and preemption (the preempted sequences' routes recomputed)
        dict(n=3, max_new_tokens=20, temperature=1.0, seed=1, max_num_seqs=3, block_size=2, kv_cache_gib=1e-5),
    ],
)
def test_native_equals_hf_tokens_logprobs_and_routes(tiny_moe, settings):
    model, tokenizer = tiny_moe
    cfg = flat_config(RolloutConfig, engine="native", chat_template="off", **settings)
    ours = generate(make_engine(model, tokenizer, cfg), PROMPTS, cfg)
    theirs = generate(make_engine(model, tokenizer, dataclasses.replace(cfg, engine="hf")), PROMPTS, cfg)
    assert [r.response_ids for r in ours] == [r.response_ids for r in theirs]
    for a, b in zip(ours, theirs):
        assert torch.allclose(torch.tensor(a.rollout_logprobs), torch.tensor(b.rollout_logprobs), atol=1e-5)
        assert a.routed_experts.dtype == torch.int16 and a.routed_experts.shape == (len(a.response_ids), 2, 2)
        assert torch.equal(a.routed_experts, b.routed_experts), a.id


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run with RLX_TEST_GPU=1)")
def test_grouped_gemm_and_compiled_decode_graphs_on_cuda(tiny_moe):
    """bf16 on the GPU: `torch._grouped_mm` equals the expert module; fp32 decode graphs with the compiled MoE layer
    inside give the hf engine's tokens and routes (one near-tie may flip)."""
    import copy

    from rlx.kernels.grouped_experts import grouped_mm_supported

    cuda = torch.device("cuda")
    mlp = _model(hidden_size=64, moe_intermediate_size=32, num_experts=8).model.layers[0].mlp.to(cuda, torch.bfloat16)
    x = torch.randn(37, 64, device=cuda, dtype=torch.bfloat16)
    assert grouped_mm_supported(x, mlp.experts.gate_up_proj, mlp.experts.down_proj)
    with torch.no_grad():
        want = mlp(x[None])[0].float()
        got = routed_mlp(mlp, x, "grouped")[0].float()
    assert torch.allclose(got, want, atol=2e-2 * want.abs().max().item()), (got - want).abs().max()
    model, tokenizer = tiny_moe
    model = copy.deepcopy(model).to(cuda)
    cfg = RolloutConfig(engine="native", chat_template="off", precision="float32", native=NativeConfig(max_num_seqs=8),
                        sampling=SamplingParams(n=4, max_new_tokens=20, seed=3))  # fmt: skip
    engine = make_engine(model, tokenizer, cfg, cuda)
    ours = generate(engine, PROMPTS, cfg)
    assert engine._runner.graphs and engine._runner.compiled and engine._runner.routed_layers == [True, True]
    theirs = generate(make_engine(model, tokenizer, dataclasses.replace(cfg, engine="hf"), cuda), PROMPTS, cfg)
    same = [a for a, b in zip(ours, theirs) if a.response_ids == b.response_ids and
            torch.equal(a.routed_experts, b.routed_experts)]  # fmt: skip
    assert len(same) >= len(ours) - 1


def _batch(records):
    p, r = max(len(x.prompt_ids) for x in records), max(len(x.response_ids) for x in records)
    out = {k: torch.zeros(len(records), w, dtype=torch.long) for k, w in
           (("prompt_ids", p), ("prompt_mask", p), ("response_ids", r), ("response_mask", r))}  # fmt: skip
    rollout = torch.zeros(len(records), r)
    for i, x in enumerate(records):
        out["prompt_ids"][i, p - len(x.prompt_ids) :], out["prompt_mask"][i, p - len(x.prompt_ids) :] = (
            torch.tensor(x.prompt_ids), 1)  # fmt: skip
        out["response_ids"][i, : len(x.response_ids)], out["response_mask"][i, : len(x.response_ids)] = (
            torch.tensor(x.response_ids), 1)  # fmt: skip
        rollout[i, : len(x.response_ids)] = torch.tensor(x.rollout_logprobs)
    out["routed_experts"] = collate_routes(records, p, r)
    return out, rollout


def test_replaying_native_routes_gives_the_rollout_logprobs(tiny_moe):
    """The trainer's forward over a native rollout routes as recorded and, with replay, gives the rollout's logprobs;
    routes recorded one position off would not (the record's entry i belongs to the position predicting token i)."""
    model, tokenizer = tiny_moe
    cfg = RolloutConfig(
        engine="native", chat_template="off", sampling=SamplingParams(n=2, max_new_tokens=8, temperature=1.0, seed=7)
    )
    records = generate(make_engine(model, tokenizer, cfg), PROMPTS[:3], cfg)
    tensors, rollout = _batch(records)
    mask = tensors["response_mask"].bool()
    scorer = ModuleScorer(model, DistContext(device=torch.device("cpu")))
    for replay in ("off", "rollout"):
        logprobs, mismatch = scorer.replayed_logprobs(tensors, replay, 1.0, torch.float32, micro_batch_size=3,
                                                      impl="naive")  # fmt: skip
        assert mismatch == 0.0 and torch.allclose(logprobs[mask], rollout[mask], atol=1e-5), replay
    shifted = dict(tensors, routed_experts=tensors["routed_experts"].roll(1, dims=1))  # routes one position late
    logprobs, mismatch = scorer.replayed_logprobs(shifted, "rollout", 1.0, torch.float32, micro_batch_size=3,
                                                  impl="naive")  # fmt: skip
    assert mismatch > 0 and not torch.allclose(logprobs[mask], rollout[mask], atol=1e-3)


TP_SCRIPT = textwrap.dedent("""
    import copy, dataclasses, sys
    sys.path.insert(0, {repo!r})
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from rlx.formats.records import PromptRecord
    from rlx.models.moe import tiny_moe_config
    from rlx.models.tiny import build_char_tokenizer
    from rlx.parallel.dist import DistContext, exit_process, setup
    from rlx.rollout.base import build_engine
    from rlx.rollout.config import NativeConfig, RolloutConfig, SamplingParams

    ctx = setup("cpu")
    tokenizer = build_char_tokenizer()
    prompts = [PromptRecord(id=f"p{{i}}", prompt=t) for i, t in enumerate(["1+2=", "3*4=", "12+7=", "9-5="])]
    cfg = RolloutConfig(engine="native", chat_template="off", kv_cache_gib=1e-4, precision="float32",
                        sampling=SamplingParams(n=2, max_new_tokens=10, seed=5, temperature=1.0),
                        native=NativeConfig(max_num_seqs=4, block_size=2))
    for model_type in ("qwen3_moe", "qwen2_moe"):  # qwen2_moe: a shared expert and q/k/v biases
        torch.manual_seed(1)
        config = tiny_moe_config(len(tokenizer), model_type, num_experts=4, max_position_embeddings=128)
        model = AutoModelForCausalLM.from_config(config).requires_grad_(False)
        engines, results = [], []
        for tp_degree, context in ((2, ctx), (1, DistContext(device=ctx.device))):
            engines.append(build_engine(dataclasses.replace(cfg, tp_degree=tp_degree), copy.deepcopy(model),
                                        tokenizer, context))
            results.append(engines[-1].generate(prompts, cfg.sampling, progress=False).records)
        tp, single = results
        experts = engines[0]._replica.model.layers[0].mlp.experts  # this rank's half of each expert
        assert experts.gate_up_proj.shape == (4, config.moe_intermediate_size, config.hidden_size), model_type
        assert [r.response_ids for r in tp] == [r.response_ids for r in single], model_type
        for a, b in zip(tp, single):
            diff = (torch.tensor(a.rollout_logprobs) - torch.tensor(b.rollout_logprobs)).abs().max().item()
            assert diff <= 1e-5 and torch.equal(a.routed_experts, b.routed_experts), (model_type, diff)
    print(f"rank {{ctx.rank}}: MoE tensor parallel == one engine", flush=True)
    exit_process(0)
""")


def test_two_tensor_parallel_ranks_decode_an_moe_as_one_engine(tmp_path):
    """Experts split by width over two gloo ranks: the same tokens, logprobs (1e-5) and routes as one engine."""
    script = tmp_path / "tp_moe.py"
    script.write_text(TP_SCRIPT.format(repo=str(REPO)))
    out = run_torchrun(2, script, timeout=300)
    assert "rank 0: MoE tensor parallel == one engine" in out.stdout
    assert "rank 1: MoE tensor parallel == one engine" in out.stdout


def test_tensor_parallel_slices_experts_by_width_and_refuses_olmoe():
    from rlx.errors import UserError
    from rlx.rollout.native.tensor_parallel import check_splittable, rank_slice, sliced_config

    gate_up = torch.arange(2 * 8 * 3).reshape(2, 8, 3)  # [E, 2I, H], I = 4: gate rows 0-3, up rows 4-7
    first = rank_slice("model.layers.0.mlp.experts.gate_up_proj", gate_up, 2, 1)
    assert torch.equal(first, gate_up[:, [2, 3, 6, 7]])  # rank 1: the second half of the gate rows and of up's
    down = torch.arange(2 * 3 * 4).reshape(2, 3, 4)
    assert torch.equal(rank_slice("model.layers.0.mlp.experts.down_proj", down, 2, 1), down[:, :, 2:])
    config = tiny_moe_config(64, "qwen2_moe")
    sliced = sliced_config(config, 2)
    assert (sliced.moe_intermediate_size, sliced.shared_expert_intermediate_size) == (8, 8)
    with pytest.raises(UserError, match="moe_intermediate_size \\(5\\) is not a multiple"):
        check_splittable(tiny_moe_config(64, moe_intermediate_size=5), 2)
    with pytest.raises(UserError, match="not 'olmoe'"):
        check_splittable(tiny_moe_config(64, "olmoe"), 2)


def test_moe_bench_runs_on_the_tiny_shape(tmp_path):
    cmd = [sys.executable, str(REPO / "bench" / "moe_step.py"), "--shape", "tiny", "--skip", "grpo_step",
           "--rollout-prompts", "2", "--n", "2", "--prompt-len", "6", "--response-len", "6",
           "--work", str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    import json

    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [(x["measurement"], x.get("engine") or x.get("router_replay")) for x in lines] == [
        ("rollout", "native"), ("rollout", "hf"), ("routing_mismatch", "off"), ("routing_mismatch", "rollout"),
        ("rollout", "native"), ("dense_mismatch", "off"),
    ]  # fmt: skip
    assert all(x["tokens_per_s"] > 0 for x in lines[:2]) and lines[3]["routing_mismatch"] == 0.0
