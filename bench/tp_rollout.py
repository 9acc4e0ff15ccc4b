"""The native engine over N GPUs: data-parallel replicas against tensor-parallel engines (rollout.tp_degree), on the
same work (issue 34: which one `rlx ppo` should pick for a model and a batch).

    torchrun --nproc_per_node 4 bench/tp_rollout.py --shapes 0.5b,7b --tp 1,2,4      # 4 x H100: ~4 minutes
    torchrun --nproc_per_node 2 bench/tp_rollout.py --small --cpu --tp 1,2            # a check of the script

Every rank builds the shape's model (bench/scale.py's shapes, random init, bfloat16 on the GPU) and, for each
tp_degree, a native engine over it: world / tp_degree replicas of tp_degree ranks each. The work is the issue's
fixed step: --num-prompts prompts of --prompt-len tokens x --n samples, up to --response-len tokens (a random model
rarely stops), split over the replicas as `rlx ppo` splits it. A warm-up call of the same work (CUDA graph capture)
is not timed; then --repeat timed calls. One JSON line per (shape, tp_degree) from rank 0: seconds of the median
call, response tokens/s in all and per GPU, the decode-step time it implies (seconds / response length), the peak
device memory; and the fastest tp_degree per shape.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="0.5b,7b", help="comma-separated shapes of bench/scale.py")
    parser.add_argument("--tp", default="1,2,4", help="comma-separated rollout.tp_degree values (each divides N)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3, help="timed calls (the median is reported)")
    parser.add_argument("--small", action="store_true", help="the tiny shape and short sequences")
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU (with --small)")
    parser.add_argument("--json", type=Path, default=None, help="rank 0 also writes the lines here")
    args = parser.parse_args()
    os.environ.setdefault("TQDM_DISABLE", "1")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from bench.scale import COMMON, SHAPES
    from rlx.formats.records import PromptRecord
    from rlx.models.tiny import build_char_tokenizer
    from rlx.parallel.dist import exit_process, setup
    from rlx.rollout.config import SamplingParams

    ctx = setup("cpu" if args.cpu else "cuda")
    cuda = ctx.device.type == "cuda"
    if args.small:
        args.shapes, args.prompt_len, args.response_len, args.num_prompts = "small", 8, 16, 4
    tokenizer = build_char_tokenizer()
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789+-*= "
    texts = ["".join(alphabet[(i * 7 + j * 13) % len(alphabet)] for j in range(args.prompt_len - 1))
             for i in range(args.num_prompts)]  # fmt: skip
    prompts = [PromptRecord(id=f"p{i}", prompt=t) for i, t in enumerate(texts)]
    sampling = SamplingParams(n=args.n, max_new_tokens=args.response_len, temperature=1.0, seed=0)
    lines = []
    for shape in args.shapes.split(","):
        fields = {**SHAPES[shape], **COMMON}
        if shape == "small":  # two key/value heads, so that they split over 2 ranks
            fields.update(num_attention_heads=4, num_key_value_heads=2)
        config = AutoConfig.for_model(**fields)
        torch.manual_seed(0)
        with torch.device(ctx.device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if cuda else torch.float32)
        model.requires_grad_(False).eval()
        best = None
        for tp in (int(t) for t in args.tp.split(",")):
            if ctx.world % tp or config.num_key_value_heads % tp:
                if ctx.rank == 0:
                    print(json.dumps({"shape": shape, "tp_degree": tp, "skipped": "does not divide the GPUs or "
                                      f"the {config.num_key_value_heads} key/value heads"}), flush=True)  # fmt: skip
                continue
            line = measure(model, tokenizer, prompts, sampling, tp, ctx, args)
            line["shape"] = shape
            median = line["median_s"]
            if best is None or median < best[1]:
                best = (tp, median)
            if ctx.rank == 0:
                print(json.dumps(line), flush=True)
            lines.append(line)
        if ctx.rank == 0 and best is not None:
            print(json.dumps({"shape": shape, "fastest_tp_degree": best[0]}), flush=True)
        del model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    if ctx.rank == 0 and args.json:
        args.json.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    exit_process(0)


def measure(model, tokenizer, prompts, sampling, tp: int, ctx, args) -> dict:
    """One engine of `tp` ranks per replica over `model`: the warm-up call, then --repeat timed calls; the line."""
    import torch

    from rlx.parallel.dist import all_gather_objects
    from rlx.rollout.base import build_engine
    from rlx.rollout.config import RolloutConfig

    cuda = ctx.device.type == "cuda"
    cfg = RolloutConfig(engine="native", chat_template="off", tp_degree=tp, sampling=sampling)
    if cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    engine = build_engine(cfg, model, tokenizer, ctx)
    engine.generate(prompts, sampling, progress=False)  # warm-up: graph capture, compile
    seconds, tokens, count = [], 0, 0
    for _ in range(args.repeat):
        if cuda:
            torch.cuda.synchronize(ctx.device)
        start = time.perf_counter()
        records = engine.generate(prompts, sampling, progress=False).records
        seconds.append(time.perf_counter() - start)
        tokens, count = sum(len(r.response_ids) for r in records), len(records)
    peaks = all_gather_objects(torch.cuda.max_memory_allocated(ctx.device) / 2**30 if cuda else 0.0)
    engine.close()
    del engine
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    median = statistics.median(seconds)
    return {"gpus": ctx.world, "tp_degree": tp, "replicas": ctx.world // tp, "sequences": count,
            "response_tokens": tokens, "median_s": round(median, 3), "seconds": [round(s, 3) for s in seconds],
            "tokens_per_s": round(tokens / median, 1), "tokens_per_s_per_gpu": round(tokens / median / ctx.world, 1),
            "decode_step_ms": round(1000 * median / max(1, args.response_len), 2),
            "peak_gib_max_rank": round(max(peaks), 2)}  # fmt: skip


if __name__ == "__main__":
    main()
