"""Training-step throughput: rlx's actor update against a plain Hugging Face padded forward/backward.

    python bench/train_step.py --json one.json                       # 1 GPU: rlx, then the HF baseline
    torchrun --nproc_per_node 2 bench/train_step.py --json two.json  # rlx on 2 GPUs (FSDP2, no baseline)
    python bench/train_step.py --small --cpu                         # a quick check of the script

The model is Qwen2-0.5B-shaped (24 layers, hidden 896, 14 heads / 2 KV heads, vocab 151936, tied
head), randomly initialised; float32 master weights, bf16 compute, AdamW. The batch has prompts of
64-512 tokens and responses of skewed length (most short, a few near --max-response), like RL
rollouts. One optimizer step over the whole batch is timed (median of --steps after a warm-up).

rlx: `ActorTrainer.train_step`, the code `rlx train-step` runs: packed micro-batches by token budget,
varlen attention, fused logprobs (only response positions reach the LM head), PPO loss; under
torchrun, FSDP2 with work-balanced ranks.
HF baseline: the same samples in micro-batches of --baseline-rows padded rows (left-padded prompts,
right-padded responses), `model(input_ids, attention_mask).logits` with SDPA, float32 cross-entropy
on the response tokens, backward, clip, AdamW.

MFU counts the useful matmul FLOPs (flops.py, forward + backward = 3x forward): the decoder over every
real token, the LM head over the response positions only (prompt logits are not needed), no padding
and no recomputation; divided by the time, the device's peak bf16 dense FLOP/s, and the GPU count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlx.formats.batch import BatchMeta, TrainBatch  # noqa: E402
from rlx.observe import flops as F  # noqa: E402
from rlx.parallel.dist import setup, teardown  # noqa: E402
from rlx.training.actor import ActorTrainer  # noqa: E402
from rlx.training.config import OptimConfig, TrainConfig  # noqa: E402

QWEN2_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
)
SMALL = dict(QWEN2_05B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
SMALL["vocab_size"] = 512


def build_model(shape: dict, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(**shape)
    config._attn_implementation = "sdpa"
    return Qwen2ForCausalLM(config).float()


def build_batch(n: int, vocab: int, max_prompt: int, max_response: int, seed: int = 0) -> TrainBatch:
    """n samples: prompts uniform in [64, max_prompt], responses skewed (exponential, mean max/5, cut at max)."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(min(64, max_prompt), max_prompt + 1, (n,), generator=g)
    response_lens = (torch.empty(n).exponential_(generator=g) * max_response / 5).long().clamp(8, max_response)
    p, r = int(prompt_lens.max()), int(response_lens.max())
    prompt_ids = torch.randint(0, vocab, (n, p), generator=g)
    response_ids = torch.randint(0, vocab, (n, r), generator=g)
    cols_p, cols_r = torch.arange(p), torch.arange(r)
    prompt_mask = (cols_p[None, :] >= p - prompt_lens[:, None]).long()  # left padded
    response_mask = (cols_r[None, :] < response_lens[:, None]).long()
    prompt_ids, response_ids = prompt_ids * prompt_mask, response_ids * response_mask
    old = (-torch.rand(n, r, generator=g) * 3) * response_mask
    advantages = torch.randn(n, 1, generator=g).expand(n, r) * response_mask
    zeros = torch.zeros(n, r)
    meta = BatchMeta(
        sample_ids=[f"s{i}" for i in range(n)],
        group_ids=[f"g{i // 8}" for i in range(n)],
        vocab_size=vocab,
        pad_token_id=0,
        temperature=1.0,
    )
    return TrainBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        rollout_logprobs=old.clone(),
        old_logprobs=old,
        advantages=advantages.contiguous(),
        returns=advantages.contiguous(),
        token_rewards=zeros,
        rewards=torch.zeros(n),
        meta=meta,
    )


def useful_flops(config, batch: TrainBatch) -> float:
    """Forward + backward matmul FLOPs: decoder over real tokens, LM head over response positions."""
    seq = (batch.prompt_mask.sum(-1) + batch.response_mask.sum(-1)).tolist()
    responses = float(batch.response_mask.sum())
    forward = (
        sum(seq) * F.layer_flops_per_token(config)
        + responses * F.lm_head_flops_per_token(config)
        + F.attention_flops(config, sum(F.causal_pairs(n) for n in seq))
    )
    return 3 * forward


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(step_fn, device, steps: int, warmup: int) -> list[float]:
    for i in range(warmup):
        step_fn(i)
    times = []
    for i in range(steps):
        sync(device)
        t0 = time.perf_counter()
        step_fn(warmup + i)
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def run_rlx(args, shape, batch, ctx) -> dict:
    model = build_model(shape)
    cfg = TrainConfig(
        optim=OptimConfig(lr=1e-6),
        mini_batch_size=batch.size,
        use_packing=True,
        max_tokens_per_micro_batch=args.tokens_per_micro_batch,
        gradient_checkpointing=args.gradient_checkpointing,
        compile=args.compile,
        device="cpu" if args.cpu else "cuda",
        exact=args.exact,
    )
    dtype = torch.float32 if args.cpu else torch.bfloat16
    trainer = ActorTrainer(model, cfg, ctx.device, dtype, ctx)
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    times = timed_steps(lambda i: trainer.train_step(batch, i), ctx.device, args.steps, args.warmup)
    peak = torch.cuda.max_memory_allocated(ctx.device) / 2**30 if ctx.device.type == "cuda" else float("nan")
    if args.profile and ctx.is_main:
        profile(lambda: trainer.train_step(batch, 100), ctx.device, args.profile)
    elif args.profile:
        trainer.train_step(batch, 100)
    return {"times_s": times, "peak_gib": peak}


def profile(fn, device, path: str) -> None:
    """One step under torch.profiler: the top kernels by device time, written to `path`."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        fn()
        sync(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    Path(path).write_text(prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=70))


def run_hf(args, shape, batch, device) -> dict:
    model = build_model(shape).to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    dtype = torch.float32 if args.cpu else torch.bfloat16
    tokens = float(batch.response_mask.sum())
    rows = args.baseline_rows

    def step(_):
        for lo in range(0, batch.size, rows):
            part = batch.select(list(range(lo, min(lo + rows, batch.size))))
            keep_p = int(part.prompt_mask.sum(-1).max())
            keep_r = int(part.response_mask.sum(-1).max())
            ids = torch.cat([part.prompt_ids[:, -keep_p:], part.response_ids[:, :keep_r]], 1).to(device)
            mask = torch.cat([part.prompt_mask[:, -keep_p:], part.response_mask[:, :keep_r]], 1).to(device)
            labels = torch.where(mask.bool(), ids, -100)
            labels[:, :keep_p] = -100  # loss on response tokens only
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), reduction="sum"
            )
            (loss / tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = timed_steps(step, device, args.steps, args.warmup)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    return {"times_s": times, "peak_gib": peak}


def summarize(name, result, flops, tokens, peak_flops, gpus) -> dict:
    median = statistics.median(result["times_s"])
    out = {
        "name": name,
        "gpus": gpus,
        "step_s": median,
        "tokens_per_s": tokens / median,
        "mfu": flops / median / (peak_flops * gpus) if peak_flops else float("nan"),
        "peak_gib": result["peak_gib"],
        "times_s": result["times_s"],
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--max-response", type=int, default=3072)
    parser.add_argument("--tokens-per-micro-batch", type=int, default=16384)
    parser.add_argument("--baseline-rows", type=int, default=4, help="padded rows per HF micro-batch")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--compile", action="store_true", help="rlx with torch.compile'd decoder layers")
    parser.add_argument("--exact", action="store_true", help="rlx in exact (batch-invariant) mode (docs/exact.md)")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--small", action="store_true", help="a tiny model and batch (checks the script)")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--json", help="write the results here (rank 0)")
    parser.add_argument("--profile", help="profile one extra rlx step; write the top kernels here")
    args = parser.parse_args()
    if args.small:
        args.samples, args.max_prompt, args.max_response, args.tokens_per_micro_batch = 16, 32, 64, 256
    shape = SMALL if args.small else QWEN2_05B
    ctx = setup("cpu" if args.cpu else "cuda")
    batch = build_batch(args.samples, shape["vocab_size"], args.max_prompt, args.max_response)
    config = build_model(dict(shape, num_hidden_layers=1)).config
    config.num_hidden_layers = shape["num_hidden_layers"]
    flops = useful_flops(config, batch)
    tokens = float(batch.prompt_mask.sum() + batch.response_mask.sum())
    name = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
    peak_flops = F.device_peak_flops(name) if ctx.device.type == "cuda" else 0.0
    results = [summarize("rlx", run_rlx(args, shape, batch, ctx), flops, tokens, peak_flops, ctx.world)]
    if not args.no_baseline and not ctx.distributed:
        torch.cuda.empty_cache() if ctx.device.type == "cuda" else None
        results.append(summarize("hf_padded", run_hf(args, shape, batch, ctx.device), flops, tokens, peak_flops, 1))
    report = {
        "device": name,
        "gpus": ctx.world,
        "torch": torch.__version__,
        "samples": batch.size,
        "tokens": tokens,
        "response_tokens": float(batch.response_mask.sum()),
        "padded_tokens": float(batch.size * (batch.prompt_ids.shape[1] + batch.response_ids.shape[1])),
        "useful_tflop_per_step": flops / 1e12,
        "peak_tflops": peak_flops / 1e12,
        "args": vars(args),
        "results": results,
    }
    if ctx.is_main:
        for r in results:
            print(
                f"{r['name']:>10} x{r['gpus']}: {r['step_s']:.3f} s/step, {r['tokens_per_s']:,.0f} tokens/s, "
                f"MFU {r['mfu']:.1%}, peak {r['peak_gib']:.1f} GiB",
                flush=True,
            )
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2))
    teardown()


if __name__ == "__main__":
    main()
