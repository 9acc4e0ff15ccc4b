"""The memory plan's train phase against the measured peak, one configuration at a time, in one process.

    python3 bench/plan_check.py --json plan_check.json                    # the default grid on one GPU
    python3 bench/plan_check.py --runs 0.5b:24:49152:compile,7b:4:12288:ckpt
    python3 bench/plan_check.py --small --cpu                             # a check of the script

Each run builds a model of a bench/scale.py shape with the given number of layers (float32 master weights, as
`rlx ppo` loads a policy), trains it with `ActorTrainer` (the code `rlx ppo` runs on one process) on one
micro-batch of N sequences of 128 + 256 tokens (N * 384 tokens: the budget), one warm-up step (AdamW's state made,
compiled layers built), then one measured step: `torch.cuda.max_memory_allocated` over it against the plan's train
phase (rlx/ppo/plan.py `estimate` with the engine released and no reference, as the plan sees such a step), and
the activations measured (the peak less what was allocated before the step) per token against the plan's
`_activation_bytes_per_token`. Modes: `compile` (train.compile), `eager`, `ckpt` (gradient checkpointing, no
compile), `ckpt+compile`.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402

from rlx.formats.batch import BatchMeta, TrainBatch  # noqa: E402
from rlx.ppo import plan as P  # noqa: E402

PROMPT, RESPONSE = 128, 256
DEFAULT_RUNS = (
    "0.5b:24:12288:compile,0.5b:24:49152:compile,0.5b:24:98304:compile,0.5b:12:49152:compile,"
    "0.5b:24:12288:eager,0.5b:24:49152:eager,0.5b:12:49152:eager,"
    "0.5b:24:49152:ckpt,0.5b:24:98304:ckpt,0.5b:24:98304:ckpt+compile,"
    "7b:4:12288:compile,7b:4:36864:compile,7b:4:12288:eager,7b:4:36864:ckpt"
)


def fixed_batch(n: int, vocab: int, seed: int = 0) -> TrainBatch:
    """n samples, every prompt PROMPT tokens and every response RESPONSE (as bench/scale.py's random policy)."""
    g = torch.Generator().manual_seed(seed)
    ones_p, ones_r = torch.ones(n, PROMPT, dtype=torch.long), torch.ones(n, RESPONSE, dtype=torch.long)
    old = -torch.rand(n, RESPONSE, generator=g) * 3
    meta = BatchMeta(sample_ids=[f"s{i}" for i in range(n)], group_ids=[f"g{i // 8}" for i in range(n)],
                     vocab_size=vocab, pad_token_id=0, temperature=1.0)  # fmt: skip
    return TrainBatch(
        prompt_ids=torch.randint(1, vocab, (n, PROMPT), generator=g), prompt_mask=ones_p,
        response_ids=torch.randint(1, vocab, (n, RESPONSE), generator=g), response_mask=ones_r,
        rollout_logprobs=old.clone(), old_logprobs=old,
        advantages=(adv := torch.randn(n, 1, generator=g).expand(n, RESPONSE).contiguous()), returns=adv,
        token_rewards=torch.zeros(n, RESPONSE), rewards=torch.zeros(n), meta=meta,
    )  # fmt: skip


def planned(config: dict, n: int, tokens: int, compile: bool, ckpt: bool, gpu_gib: float) -> dict:
    """The plan's train phase for this step: the engine released (sleep), no reference, one process."""
    shape = P.model_shape(config)
    work = P.Workload(sequences=n, prompt_tokens=PROMPT, response_tokens=RESPONSE, optimizer_steps=1,
                      engine="native", use_ref=False, has_critic=False, has_lora=False, max_prefill_tokens=16384,
                      vllm_memory_fraction=0.5)  # fmt: skip
    settings = P.Settings(sleep=True, gradient_checkpointing=ckpt, train_tokens=tokens, compile=compile)
    est = P.estimate(shape, work, settings, 1, gpu_gib)
    return {"train_gib": est.phases["train"], "parts": est.parts,
            "activation_bytes_per_token": P._activation_bytes_per_token(shape, ckpt, compile)}  # fmt: skip


def one_run(spec: str, args, device: torch.device) -> dict:
    from scale import COMMON, SHAPES
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlx.training.actor import ActorTrainer
    from rlx.training.config import OptimConfig, TrainConfig

    shape, layers, tokens, mode = spec.split(":")
    layers, tokens = int(layers), int(tokens)
    compile, ckpt = "compile" in mode, "ckpt" in mode
    n = max(1, tokens // (PROMPT + RESPONSE))
    config = {**SHAPES[shape], **COMMON, "num_hidden_layers": layers}
    torch.manual_seed(0)
    hf_config = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    hf_config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(hf_config).float()
    cfg = TrainConfig(optim=OptimConfig(lr=1e-6), mini_batch_size=n, use_packing=True,
                      max_tokens_per_micro_batch=n * (PROMPT + RESPONSE), gradient_checkpointing=ckpt,
                      compile=compile, device=device.type)  # fmt: skip
    from rlx.parallel.dist import setup

    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    trainer = ActorTrainer(model, cfg, device, dtype, setup(device.type))
    batch = fixed_batch(n, config["vocab_size"])
    started = time.perf_counter()
    trainer.train_step(batch, 0)  # AdamW's state, compiled layers
    warm_s = time.perf_counter() - started
    out = {"run": spec, "sequences": n, "tokens": n * (PROMPT + RESPONSE), "warm_up_s": round(warm_s, 1)}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        started = time.perf_counter()
        trainer.train_step(batch, 1)
        torch.cuda.synchronize(device)
        out["step_s"] = round(time.perf_counter() - started, 3)
        peak = torch.cuda.max_memory_allocated(device)
        gpu_gib = torch.cuda.get_device_properties(device).total_memory / P.GIB
        out.update(before_gib=before / P.GIB, peak_gib=peak / P.GIB,
                   measured_activation_bytes_per_token=(peak - before) / out["tokens"])  # fmt: skip
    else:
        trainer.train_step(batch, 1)
        gpu_gib = args.gpu_memory_gib
    out["plan"] = planned(config, n, out["tokens"], compile, ckpt, gpu_gib)
    del trainer, model
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def line(r: dict) -> str:
    p = r["plan"]
    if "peak_gib" not in r:
        return f"{r['run']:>28}: plan {p['train_gib']:.1f} GiB (no GPU: nothing measured)"
    return (
        f"{r['run']:>28}: peak {r['peak_gib']:.1f} GiB (state {r['before_gib']:.1f}), plan {p['train_gib']:.1f} "
        f"({p['train_gib'] / r['peak_gib'] - 1:+.0%}); activations {r['measured_activation_bytes_per_token']:,.0f} "
        f"B/token, plan {p['activation_bytes_per_token']:,.0f}; step {r['step_s']} s, warm-up {r['warm_up_s']} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default=DEFAULT_RUNS, help="comma-separated shape:layers:tokens:mode")
    parser.add_argument("--small", action="store_true", help="tiny runs of the small shape (a check of the script)")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0, help="for the plan without a GPU")
    parser.add_argument("--deadline-s", type=float, default=540.0, help="start no run past this long")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.small:
        args.runs = "small:2:768:eager,small:2:1536:ckpt"
    device = torch.device("cpu" if args.cpu else "cuda")
    started, results = time.perf_counter(), []
    for spec in args.runs.split(","):
        if time.perf_counter() - started > args.deadline_s:
            print(f"{spec}: not run (past --deadline-s)", flush=True)
            continue
        try:
            results.append(one_run(spec, args, device))
            print(line(results[-1]), flush=True)
        except torch.OutOfMemoryError as e:
            results.append({"run": spec, "error": f"out of memory: {str(e)[:200]}"})
            print(f"{spec}: out of memory", flush=True)
            gc.collect()
            torch.cuda.empty_cache()
        if args.json:
            args.json.write_text(json.dumps({"device": str(device), "torch": torch.__version__,
                                             "results": results}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
