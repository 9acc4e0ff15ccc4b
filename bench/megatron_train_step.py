"""Train-step throughput of the megatron backend (tensor parallel) against FSDP2 on the same GPUs.

    torchrun --nproc_per_node 2 bench/megatron_train_step.py --json out.json     # tp 2 vs FSDP2 over 2 GPUs
    torchrun --nproc_per_node 2 bench/megatron_train_step.py --small --cpu        # a quick check of the script

The model is Llama-3.2-1B-shaped (16 layers, hidden 2048, 32 heads / 8 KV heads, MLP 8192, vocab
128256, tied head), randomly initialised, float32 master weights, bf16 compute, AdamW; the batch is
bench/train_step.py's (prompts of 64-512 tokens, skewed responses up to --max-response). In one launch:
first rlx's FSDP2 actor (`ActorTrainer`, packed micro-batches by token budget, fused Triton logprobs),
then the megatron actor (`MegatronActorTrainer`: tp = world size, no data parallel, packed micro-batches,
vocab-parallel logprobs). One optimizer step over the whole batch is timed (median of --steps after a
warm-up); tokens/s counts prompt + response tokens of the batch.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_step import build_batch, profile, summarize, timed_steps, useful_flops  # noqa: E402

from rlx.observe import flops as F  # noqa: E402
from rlx.parallel.dist import setup, teardown  # noqa: E402
from rlx.training.actor import ActorTrainer  # noqa: E402
from rlx.training.config import OptimConfig, TrainConfig  # noqa: E402

LLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    tie_word_embeddings=True,
    architectures=["LlamaForCausalLM"],
)
SMALL = dict(LLAMA_1B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
SMALL.update(num_key_value_heads=2, vocab_size=512)


def build_model(shape: dict, device: torch.device, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**shape)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        return LlamaForCausalLM(config).float()


def train_config(args, batch) -> TrainConfig:
    return TrainConfig(
        optim=OptimConfig(lr=1e-6),
        mini_batch_size=batch.size,
        use_packing=True,
        max_tokens_per_micro_batch=args.tokens_per_micro_batch,
        device="cpu" if args.cpu else "cuda",
    )


def measure(trainer, batch, device, args, name: str) -> dict:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = timed_steps(lambda i: trainer.train_step(batch, i), device, args.steps, args.warmup)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    if args.profile:  # every rank runs the step (collectives); rank 0 writes the table
        if trainer.ctx.rank == 0:
            profile(lambda: trainer.train_step(batch, 100), device, f"{args.profile}.{name}.txt")
        else:
            trainer.train_step(batch, 100)
    return {"times_s": times, "peak_gib": peak}


def run_fsdp(args, shape, batch, ctx, dtype) -> dict:
    model = build_model(shape, ctx.device)
    trainer = ActorTrainer(model, train_config(args, batch), ctx.device, dtype, ctx)
    return measure(trainer, batch, ctx.device, args, "fsdp")


def run_megatron(args, shape, batch, ctx, dtype) -> dict:
    from rlx.backends.megatron.parallel import setup_megatron
    from rlx.backends.megatron.stage import load_stage
    from rlx.backends.megatron.trainer import MegatronActorTrainer
    from rlx.models.loading import tied_keys
    from rlx.models.megatron.convert import hf_to_megatron_shard

    mctx = setup_megatron("cpu" if args.cpu else "cuda", ctx.world, 1)
    model = build_model(shape, ctx.device)
    config = model.config
    weights = {k: v for k, v in model.state_dict().items() if k not in tied_keys(model)}
    state = hf_to_megatron_shard(weights, config, mctx.tp_degree, 1, mctx.tp_rank, 0)
    del model, weights
    stage = load_stage(config, {k: v.cpu() for k, v in state.items()}, mctx, "bench")
    trainer = MegatronActorTrainer(stage, config, train_config(args, batch), mctx, dtype)
    return measure(trainer, batch, ctx.device, args, "megatron")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--max-response", type=int, default=2048)
    parser.add_argument("--tokens-per-micro-batch", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--backends", default="fsdp,megatron")
    parser.add_argument("--small", action="store_true", help="a tiny model and batch (checks the script)")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--json", help="write the results here (rank 0)")
    parser.add_argument("--profile", help="profile one more step per backend; top kernels to PATH.<backend>.txt")
    args = parser.parse_args()
    if args.small:
        args.samples, args.max_prompt, args.max_response, args.tokens_per_micro_batch = 8, 32, 64, 256
    shape = SMALL if args.small else LLAMA_1B
    ctx = setup("cpu" if args.cpu else "cuda")
    dtype = torch.float32 if args.cpu else torch.bfloat16
    batch = build_batch(args.samples, shape["vocab_size"], args.max_prompt, args.max_response)
    config = build_model(dict(shape, num_hidden_layers=1), torch.device("cpu")).config
    config.num_hidden_layers = shape["num_hidden_layers"]
    flops = useful_flops(config, batch)
    tokens = float(batch.prompt_mask.sum() + batch.response_mask.sum())
    name = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
    peak_flops = F.device_peak_flops(name) if ctx.device.type == "cuda" else 0.0
    runners = {"fsdp": run_fsdp, "megatron": run_megatron}
    results = []
    for backend in args.backends.split(","):
        result = runners[backend](args, shape, batch, ctx, dtype)
        label = f"megatron_tp{ctx.world}" if backend == "megatron" else f"fsdp{ctx.world}"
        results.append(summarize(label, result, flops, tokens, peak_flops, ctx.world))
        if ctx.is_main:
            r = results[-1]
            print(
                f"{r['name']:>14} x{r['gpus']}: {r['step_s']:.3f} s/step, {r['tokens_per_s']:,.0f} tokens/s, "
                f"MFU {r['mfu']:.1%}, peak {r['peak_gib']:.1f} GiB",
                flush=True,
            )
        gc.collect()
        torch.cuda.empty_cache() if ctx.device.type == "cuda" else None
    if ctx.is_main and args.json:
        report = {
            "device": name,
            "gpus": ctx.world,
            "torch": torch.__version__,
            "samples": batch.size,
            "tokens": tokens,
            "useful_tflop_per_step": flops / 1e12,
            "args": vars(args),
            "results": results,
        }
        Path(args.json).write_text(json.dumps(report, indent=2))
    teardown()


if __name__ == "__main__":
    main()
