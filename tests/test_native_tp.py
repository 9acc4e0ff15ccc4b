"""Tensor parallelism in the native rollout engine (rollout.tp_degree): two gloo ranks on the CPU decode with half
the heads and half the MLP each and sample what one engine with the whole model samples."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from rlx.config import ConfigError
from rlx.rollout.agent_config import AgentConfig
from rlx.rollout.config import RolloutConfig
from tests.conftest import REPO, cli, cli_ok, read_jsonl, rollout_args, run_torchrun, torchrun

SCRIPT = textwrap.dedent("""
    import copy, dataclasses, sys
    sys.path.insert(0, {repo!r})
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config
    from rlx.formats.records import PromptRecord
    from rlx.models.tiny import build_char_tokenizer
    from rlx.parallel.dist import DistContext, exit_process, setup
    from rlx.rollout.base import build_engine
    from rlx.rollout.config import NativeConfig, RolloutConfig, SamplingParams

    ctx = setup(sys.argv[1])  # cpu: gloo; cuda: nccl, decode steps in CUDA graphs with torch.compile inside
    tokenizer = build_char_tokenizer()
    shape = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0,
                 bos_token_id=1, eos_token_id=2)
    families = {{
        "llama": LlamaConfig(**shape, tie_word_embeddings=True),
        # o_proj and down_proj biases: row-parallel, added once over the group
        "llama-biases": LlamaConfig(**shape, attention_bias=True, mlp_bias=True, tie_word_embeddings=False),
        "qwen2": Qwen2Config(**shape),  # q/k/v biases: column-parallel
    }}
    if ctx.device.type == "cuda":
        torch.cuda.manual_seed_all(0)
    prompts = [PromptRecord(id=f"p{{i}}", prompt=t) for i, t in enumerate(["1+2=", "3*4=", "12+7=", "9-5=", "0+0="])]
    one = DistContext(device=ctx.device)  # a lone engine over the whole model, in this process

    def records(model, cfg, context):
        engine = build_engine(cfg, model, tokenizer, context)
        return engine, engine.generate(prompts, cfg.sampling, progress=False).records

    def same(tp, single, what):
        assert [r.response_ids for r in tp] == [r.response_ids for r in single], what
        assert sum(len(r.response_ids) for r in tp) > 100, what  # not all stopped at once
        for a, b in zip(tp, single):
            diff = (torch.tensor(a.rollout_logprobs) - torch.tensor(b.rollout_logprobs)).abs().max().item()
            assert diff <= 1e-5, (what, diff)

    def build(family):
        torch.manual_seed(1)
        model = AutoModelForCausalLM.from_config(families[family])
        for (name, p) in model.named_parameters():  # random biases (zeros would hide a bias added twice)
            if name.endswith("bias"):
                p.data.normal_(0, 0.5)
        return model

    cfg = RolloutConfig(
        engine="native",
        chat_template="off",
        kv_cache_gib=1e-4,
        precision="float32",
        sampling=SamplingParams(n=3, max_new_tokens=12, seed=5),
        native=NativeConfig(max_num_seqs=4, block_size=2),
    )
    for family in families:
        model = build(family).requires_grad_(False)
        for temperature in (0.0, 1.0):
            cfg = dataclasses.replace(cfg, sampling=dataclasses.replace(cfg.sampling, temperature=temperature))
            engine, tp = records(copy.deepcopy(model), dataclasses.replace(cfg, tp_degree=2), ctx)
            _, single = records(copy.deepcopy(model), cfg, one)
            same(tp, single, (family, temperature))
            replica = engine._replica.model.layers[0]
            assert replica.self_attn.q_proj.weight.shape[0] == 2 * 16 and replica.mlp.up_proj.weight.shape[0] == 48
            assert engine._runner.fused is not None  # decode steps through the merged projections, all-reduced
            assert engine._runner.kv[0][0].shape[2] == 1  # each rank caches its one key/value head
            if ctx.device.type == "cuda":
                assert engine._runner.graphs and engine._runner.compiled, "no compiled decode graphs"
            tokens = [None, None]
            dist.all_gather_object(tokens, [r.response_ids for r in tp])
            assert tokens[0] == tokens[1], "the ranks of a group sampled different tokens"
            engine.close()  # its decode graphs (NCCL all-reduces inside) go before the process group

    # a trainer's FSDP-sharded module: each rank gathers one parameter at a time and keeps its slice
    from torch.distributed.fsdp import fully_shard
    model = build("qwen2")
    reference = copy.deepcopy(model).requires_grad_(False)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    engine, tp = records(model, dataclasses.replace(cfg, tp_degree=2), ctx)
    _, single = records(reference, cfg, one)
    same(tp, single, "fsdp")
    engine.close()
    print(f"rank {{ctx.rank}}: tensor parallel == one engine", flush=True)
    exit_process(0)
""")


def test_two_tensor_parallel_ranks_sample_what_one_engine_samples(tmp_path):
    """Tiny Llama (with and without o_proj/down_proj biases) and Qwen2 (q/k/v biases), greedy and sampled at a fixed
    seed, from a plain model and from FSDP shards: the same tokens on both ranks as one whole engine, logprobs to
    1e-5."""
    script = tmp_path / "tp.py"
    script.write_text(SCRIPT.format(repo=str(REPO)))
    out = run_torchrun(2, script, "cpu", timeout=300)
    assert "rank 0: tensor parallel == one engine" in out.stdout
    assert "rank 1: tensor parallel == one engine" in out.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_tensor_parallel_decode_graphs_on_two_gpus(tmp_path):
    """The same on two GPUs over NCCL: decode steps replay CUDA graphs (the all-reduces captured inside them, the
    merged layers compiled), float32, against one GPU's engine."""
    script = tmp_path / "tp.py"
    script.write_text(SCRIPT.format(repo=str(REPO)))
    out = run_torchrun(2, script, "cuda", timeout=600)
    assert "rank 1: tensor parallel == one engine" in out.stdout


def test_rollout_command_with_tp_degree_2_equals_one_process(tmp_path, tiny_ckpt, prompts_file):
    common = ["--engine", "native", "--seed", "4", "--temperature", "1", "--kv-cache-gib", "0.001"]
    cli_ok(*rollout_args(tiny_ckpt, prompts_file, tmp_path / "one.jsonl", *common))
    args = rollout_args(tiny_ckpt, prompts_file, tmp_path / "tp.jsonl", *common, "--tp-degree", "2")
    args[args.index("--n")] = "--num-samples"  # torchrun's own parser takes --n
    torchrun(2, *args)
    one, tp = read_jsonl(tmp_path / "one.jsonl"), read_jsonl(tmp_path / "tp.jsonl")
    assert [r["response_ids"] for r in one] == [r["response_ids"] for r in tp] and len(tp) == 16
    for a, b in zip(one, tp):
        assert max(abs(x - y) for x, y in zip(a["rollout_logprobs"], b["rollout_logprobs"])) <= 1e-5


def test_tp_degree_errors(tmp_path, tiny_ckpt, prompts_file, capsys):
    # the old name still works for one release, with a notice
    assert RolloutConfig(engine="vllm", tp=2).tp_degree == 2
    assert "rollout.tp_degree" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="old name of tp_degree: give one of them"):
        RolloutConfig(engine="vllm", tp=2, tp_degree=4)
    with pytest.raises(ConfigError, match="single-turn rollouts only"):
        RolloutConfig(engine="native", tp_degree=2, agent=AgentConfig(env="envs.py:Env"))
    result = cli(*rollout_args(tiny_ckpt, prompts_file, tmp_path / "r.jsonl", "--engine", "hf", "--tp-degree", "2"))
    assert result.exit_code == 1 and "--tp-degree: tensor parallel rollout needs engine 'vllm' or 'native'" in (
        result.stderr
    )
    result = cli(*rollout_args(tiny_ckpt, prompts_file, tmp_path / "r.jsonl", "--engine", "native", "--tp-degree", "2"))
    assert result.exit_code == 1 and "tp_degree 2 needs 2 processes" in result.stderr
    assert not (tmp_path / "r.jsonl").exists()


def test_heads_that_do_not_split_are_refused():
    from transformers import GPT2Config, LlamaConfig

    from rlx.errors import UserError
    from rlx.rollout.native.tensor_parallel import check_splittable, rank_slice, sliced_config

    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
    check_splittable(config, 2)
    with pytest.raises(UserError, match="num_key_value_heads \\(2\\) is not a multiple"):
        check_splittable(config, 4)
    with pytest.raises(UserError, match="splits llama, qwen2, qwen3, mistral models only, not 'gpt2'"):
        check_splittable(GPT2Config(n_head=4), 2)
    half = sliced_config(config, 2)
    assert (half.num_attention_heads, half.num_key_value_heads, half.intermediate_size, half.head_dim) == (2, 1, 48, 16)
    weight = torch.arange(12.0).view(3, 4)
    assert torch.equal(rank_slice("model.layers.0.mlp.down_proj.weight", weight, 2, 1), weight[:, 2:])
    assert torch.equal(rank_slice("model.layers.0.self_attn.o_proj.bias", weight[0], 2, 1), torch.zeros(4))
    assert rank_slice("model.norm.weight", weight, 2, 1) is weight


@pytest.mark.slow
def test_ppo_with_tp_degree_2(tmp_path):
    recipe = Path(REPO) / "recipes" / "quickstart.toml"
    sets = ["--set", "data.prompts_per_step=4", "--set", "rollout.sampling.n=2", "--set", "steps=2"]
    sets += ["--set", "rollout.engine=native", "--set", "rollout.kv_cache_gib=0.001"]
    cli_ok("ppo", recipe, "--out", tmp_path / "one", *sets)
    torchrun(2, "ppo", recipe, "--out", tmp_path / "tp", *sets, "--set", "rollout.tp_degree=2")
    one, tp = (read_jsonl(tmp_path / name / "metrics.jsonl") for name in ("one", "tp"))
    assert [m["reward/mean"] for m in one] == [m["reward/mean"] for m in tp] and len(tp) == 2
