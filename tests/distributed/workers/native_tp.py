"""torchrun worker of tests/distributed/test_native_tp.py (argv: cpu|cuda): the native engine at tp_degree 2 samples
what one engine with the whole model samples, from plain models and FSDP shards."""

import copy
import dataclasses
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from rlx.formats.records import PromptRecord
from rlx.models.tiny import build_char_tokenizer
from rlx.parallel.dist import DistContext, exit_process, setup
from rlx.rollout.base import build_engine
from rlx.rollout.config import NativeConfig, RolloutConfig, SamplingParams

ctx = setup(sys.argv[1])  # cpu: gloo; cuda: nccl, decode steps in CUDA graphs with torch.compile inside
tokenizer = build_char_tokenizer()
shape = dict(
    vocab_size=len(tokenizer),
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
families = {
    "llama": LlamaConfig(**shape, tie_word_embeddings=True),
    # o_proj and down_proj biases: row-parallel, added once over the group
    "llama-biases": LlamaConfig(**shape, attention_bias=True, mlp_bias=True, tie_word_embeddings=False),
    "qwen2": Qwen2Config(**shape),  # q/k/v biases: column-parallel
}
if ctx.device.type == "cuda":
    torch.cuda.manual_seed_all(0)
prompts = [PromptRecord(id=f"p{i}", prompt=t) for i, t in enumerate(["1+2=", "3*4=", "12+7=", "9-5=", "0+0="])]
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
    for name, p in model.named_parameters():  # random biases (zeros would hide a bias added twice)
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

model = build("qwen2")
reference = copy.deepcopy(model).requires_grad_(False)
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)
engine, tp = records(model, dataclasses.replace(cfg, tp_degree=2), ctx)
_, single = records(reference, cfg, one)
same(tp, single, "fsdp")
engine.close()
print(f"rank {ctx.rank}: tensor parallel == one engine", flush=True)
exit_process(0)
