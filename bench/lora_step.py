"""LoRA against full fine-tuning on one GPU: peak memory and steady GRPO step time, and the weight-sync time.

    python bench/lora_step.py --json lora_step.json                        # 0.5B and 1.5B shapes, full vs r16 / r64
    python bench/lora_step.py --shapes 1.5B --ranks 0 64 --json b.json     # a subset (rank 0 = full fine-tuning)
    python bench/lora_step.py --small --cpu                                # a quick check of the script

Shapes: Qwen2-0.5B (24 layers, hidden 896) and Qwen2-1.5B (28 layers, hidden 1536, 12 heads / 2 KV heads,
intermediate 8960), vocab 151936, tied head, random weights. Each configuration is what `rlx ppo` holds and runs
per step, minus the rollout, on the same synthetic GRPO batch (bench/train_step.py's: prompts of 64..--max-prompt
tokens, skewed responses up to --max-response):

- full: an ActorTrainer with float32 master weights and AdamW, bf16 compute; a float32 reference copy of the policy.
- LoRA rank r (all-linear, alpha 2r): the base frozen in bf16, adapters float32 with AdamW; the reference is the same
  module with the adapters off (no copy).

One step = old logprobs (the trained module) + reference logprobs + the actor update (packed micro-batches by
token budget). Reported: the median of --steps steps after --warmup, and the device's peak allocated memory from
the model's arrival on the device to the last step.

Weight sync (after the steps): the time to hand the updated policy to a rollout engine. `vllm` (when installed):
`VLLMRolloutEngine.update_weights(trainer)`: all weights through vLLM's reload for full fine-tuning, the adapters
alone (a PEFT folder, loaded in place) for LoRA. `native_replica`: filling a plain bf16 replica: every weight for
full fine-tuning (what a replica-based engine copies), the merged adapted weights for LoRA
(rollout.native.lora_rollout = 'merged', after the replica's first fill).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.train_step import QWEN2_05B, SMALL, build_batch, build_model, sync, timed_steps  # noqa: E402
from rlx.checkpoints.lora_base import lora_spec  # noqa: E402
from rlx.logprobs import ModuleScorer  # noqa: E402
from rlx.models.lora_config import LoraConfig  # noqa: E402
from rlx.parallel.dist import setup, teardown  # noqa: E402
from rlx.rollout.native.replica import build_replica, fill_merged_replica, fill_replica  # noqa: E402
from rlx.training.actor import ActorTrainer  # noqa: E402
from rlx.training.config import OptimConfig, TrainConfig  # noqa: E402
from rlx.training.reference import BaseModelScorer  # noqa: E402

SHAPES = {
    "0.5B": QWEN2_05B,
    "1.5B": dict(QWEN2_05B, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12),
    "small": SMALL,
}


def build_trainer(shape: dict, rank: int, args, ctx):
    """(trainer, reference scorer) of one configuration; rank 0 is full fine-tuning."""
    model = build_model(shape)
    cfg = TrainConfig(
        optim=OptimConfig(lr=1e-6),
        mini_batch_size=args.samples,
        use_packing=True,
        max_tokens_per_micro_batch=args.tokens_per_micro_batch,
        gradient_checkpointing=args.gradient_checkpointing,
        device=ctx.device.type,
    )
    dtype = torch.float32 if ctx.device.type == "cpu" else torch.bfloat16
    lora = lora_spec(LoraConfig(rank=rank, alpha=2.0 * rank), "bench", "random", 0, model) if rank else None
    ref = None if lora else copy.deepcopy(model).requires_grad_(False).to(ctx.device).eval()
    trainer = ActorTrainer(model, cfg, ctx.device, dtype, ctx, lora=lora)
    return trainer, BaseModelScorer(trainer.model, ctx) if lora else ModuleScorer(ref, ctx)


def measure_steps(trainer, reference, batch, args, ctx) -> list[float]:
    tensors = batch.tensors()
    dtype = trainer.dtype if ctx.device.type == "cpu" else torch.bfloat16

    def step(i: int) -> None:
        for scorer in (ModuleScorer(trainer.model, ctx), reference):
            scorer.logprobs(tensors, 1.0, dtype, args.score_micro_batch, desc="bench")
        trainer.train_step(batch, i)

    return timed_steps(step, ctx.device, args.steps, args.warmup)


def median_time(fn, device, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def replica_sync(trainer, ctx) -> float:
    """Seconds to refresh a plain bf16 replica: all weights (full) or the merged adapted ones (LoRA)."""
    dtype = torch.float32 if ctx.device.type == "cpu" else torch.bfloat16
    replica = build_replica(trainer.model, ctx.device, dtype)
    if trainer.lora is None:
        return median_time(lambda: fill_replica(replica, trainer.model), ctx.device)
    fill_merged_replica(replica, trainer.model)  # the first fill copies the frozen weights once
    return median_time(lambda: fill_merged_replica(replica, trainer.model, include_frozen=False), ctx.device)


def vllm_sync(trainer, ctx, args) -> float | None:
    """Seconds of `VLLMRolloutEngine.update_weights(trainer)` (None without vLLM)."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return None
    from rlx.models.tiny import build_char_tokenizer
    from rlx.rollout.base import build_engine
    from rlx.rollout.config import RolloutConfig, VllmConfig

    cfg = RolloutConfig(
        engine="vllm", gpu_memory_utilization=args.vllm_memory, kv_cache_gib=1.0, vllm=VllmConfig(max_model_len=4096)
    )
    engine = build_engine(cfg, trainer.module, build_char_tokenizer(), ctx)
    try:
        return median_time(lambda: engine.update_weights(trainer), ctx.device)
    finally:
        engine.close()


def run_config(name: str, rank: int, args, ctx, batch) -> dict:
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.device)
    trainer, reference = build_trainer(SHAPES[name], rank, args, ctx)
    times = measure_steps(trainer, reference, batch, args, ctx)
    peak = torch.cuda.max_memory_allocated(ctx.device) / 2**30 if ctx.device.type == "cuda" else float("nan")
    trained = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    result = {
        "shape": name,
        "mode": f"lora_r{rank}" if rank else "full",
        "trained_params_m": trained / 1e6,
        "step_s": statistics.median(times),
        "times_s": times,
        "peak_gib": peak,
        "sync_native_replica_s": replica_sync(trainer, ctx),
    }
    if not args.no_vllm:
        result["sync_vllm_s"] = vllm_sync(trainer, ctx, args)
    del trainer, reference
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["0.5B", "1.5B"], choices=list(SHAPES))
    parser.add_argument("--ranks", nargs="+", type=int, default=[0, 16, 64], help="0 = full fine-tuning")
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--max-response", type=int, default=1024)
    parser.add_argument("--tokens-per-micro-batch", type=int, default=16384)
    parser.add_argument("--score-micro-batch", type=int, default=16, help="rows per scoring forward")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--vllm-memory", type=float, default=0.25, help="vLLM's gpu_memory_utilization")
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM weight-sync timing")
    parser.add_argument("--small", action="store_true", help="a tiny model and batch (checks the script)")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.small:
        args.shapes, args.samples, args.max_prompt, args.max_response = ["small"], 16, 32, 64
        args.tokens_per_micro_batch, args.no_vllm = 256, True
    ctx = setup("cpu" if args.cpu else "cuda")
    device = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
    print(f"device {device}, torch {torch.__version__}", flush=True)
    results = []
    for name in args.shapes:
        batch = build_batch(args.samples, SHAPES[name]["vocab_size"], args.max_prompt, args.max_response)
        for rank in args.ranks:
            r = run_config(name, rank, args, ctx, batch)
            results.append(r)
            vllm = r.get("sync_vllm_s")
            print(
                f"{name:>5} {r['mode']:>9}: {r['step_s']:.3f} s/step, peak {r['peak_gib']:.1f} GiB, "
                f"{r['trained_params_m']:.1f}M trained; sync: replica {r['sync_native_replica_s'] * 1e3:.1f} ms"
                + (f", vllm {vllm * 1e3:.1f} ms" if vllm is not None else ""),
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "args": vars(args), "results": results}, indent=2))
    teardown()


if __name__ == "__main__":
    main()
