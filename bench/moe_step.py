"""A Qwen3-30B-A3B-shaped MoE with fewer layers: GRPO step time, native vs hf rollout, routing mismatch (issue 36).

    python bench/moe_step.py                          # one H100: 12 layers, every measurement
    python bench/moe_step.py --layers 4 --steps 8     # a GRPO step that fits one 80 GB GPU (see below)
    python bench/moe_step.py --shape tiny             # a quick check of the script, on the CPU

The model: Qwen3-30B-A3B's layer (hidden 2048, 32 query / 4 key-value heads of 128, 128 experts of width 768, 8 per
token, renormalised) and vocabulary (151,936), `--layers` of them, random init from a config (no download), the
character tokenizer (prompts of random characters, one token each). 12 layers hold 8.1B parameters (0.7B active
per token besides the embeddings): bf16 rollout needs 16 GB, but a GRPO step keeps float32 weights, gradients and
AdamW state (16 bytes a parameter: 130 GB), so on one 80 GB GPU the step is checked with `rlx ppo --plan` first and
reported as not fitting (use --layers 4: 3.1B parameters).

One JSON line per measurement:
- `rollout` (engine native, then hf): response tokens/s of a generate call (`--rollout-prompts` x `--n` samples,
  temperature 1, the same seed), after a warm-up call of the same work for native (CUDA graph capture);
- `routing_mismatch` (replay off, then rollout): the native rollouts scored by the trainer's forward (float32
  weights, bf16 compute on CUDA): the share of (response token, MoE layer) pairs routed to other experts than the
  rollout (`moe/routing_mismatch`), and the mean |logprob - rollout logprob| over response tokens;
- `dense_mismatch`: the same measurement on the dense model of the same shape (Qwen3, the MoE's attention, an MLP as
  wide as the active experts: 8 x 768), the level the MoE's mismatch with replay is compared with;
- `grpo_step`: `rlx ppo` (engine native, router replay on) for `--steps` steps: median and p90 step seconds over the
  steps after the first, tokens/s per GPU (prompt + response tokens of the median step), MFU (perf/mfu: FLOPs of the
  active parameters, rlx/observe/flops.py), peak device memory.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

QWEN3_30B_A3B = dict(
    model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=2048, intermediate_size=6144,
    moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[],
)  # fmt: skip
TINY = dict(QWEN3_30B_A3B, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=8,
            num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=512,
            max_position_embeddings=1024)  # fmt: skip
SHAPES = {"qwen3-30b-a3b": QWEN3_30B_A3B, "tiny": TINY}
LENGTH_REWARD = (
    "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return float(len(solution_str))\n"
)


def emit(line: dict) -> None:
    print(json.dumps(line), flush=True)


def write_model_dir(folder: Path, args, dense: bool = False) -> Path:
    """config.json of the shape with --layers layers + the character tokenizer (`init = "random"` starts here);
    `dense`: the Qwen3 dense model with the same attention and an MLP as wide as the active experts."""
    from rlx.models.tiny import build_char_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    config = {**SHAPES[args.shape], "num_hidden_layers": args.layers, "bos_token_id": 1, "eos_token_id": 2,
              "pad_token_id": 0, "torch_dtype": "float32"}  # fmt: skip
    if dense:
        width = config["moe_intermediate_size"] * config["num_experts_per_tok"]
        moe_keys = ("moe_intermediate_size", "num_experts", "num_experts_per_tok", "norm_topk_prob",
                    "decoder_sparse_step", "mlp_only_layers")  # fmt: skip
        config = {k: v for k, v in config.items() if k not in moe_keys}
        config.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"], intermediate_size=width)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    build_char_tokenizer().save_pretrained(folder)
    return folder


def prompt_texts(count: int, length: int, seed: int = 0) -> list[str]:
    import random

    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789+-*= "
    return ["".join(rng.choice(alphabet) for _ in range(length)) for _ in range(count)]


def rollout_config(args, engine: str, max_new_tokens: int):
    from rlx.rollout.config import RolloutConfig, SamplingParams

    sampling = SamplingParams(n=args.n, max_new_tokens=max_new_tokens, temperature=1.0, seed=0)
    return RolloutConfig(engine=engine, chat_template="off", sampling=sampling, kv_cache_gib=args.kv_cache_gib)


def measure_rollouts(model, tokenizer, device, args, engines=("native", "hf")) -> list:
    """`rollout` lines for `engines` (native first); returns the native records (for the mismatch measurement)."""
    import torch

    from rlx.formats.records import PromptRecord
    from rlx.parallel.dist import DistContext
    from rlx.rollout.base import build_engine

    texts = prompt_texts(args.rollout_prompts, args.prompt_len - 1)
    prompts = [PromptRecord(id=f"p{i}", prompt=t) for i, t in enumerate(texts)]
    kept = None
    for name in engines:
        cfg = rollout_config(args, name, args.response_len)
        engine = build_engine(cfg, model, tokenizer, DistContext(device=device))
        warm = cfg if name == "native" else rollout_config(args, name, 2)  # native: capture its graphs
        engine.generate(prompts, warm.sampling, progress=False)
        sync(device)
        start = time.perf_counter()
        records = engine.generate(prompts, cfg.sampling, progress=False).records
        sync(device)
        seconds = time.perf_counter() - start
        tokens = sum(len(r.response_ids) for r in records)
        emit({"measurement": "rollout", "engine": name, "shape": args.shape, "layers": args.layers,
              "samples": len(records), "response_tokens": tokens, "seconds": round(seconds, 3),
              "tokens_per_s": round(tokens / seconds, 1), "device": device_name(device)})  # fmt: skip
        if name == "native":
            kept = records
        engine.close()
        del engine
        gc.collect()  # the native engine's KV cache goes before the hf engine runs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return kept


def collate(records) -> dict:
    """Left-padded prompts, right-padded responses, their rollout logprobs and routes (rlx's batch layout)."""
    import torch

    from rlx.formats.batch import collate_routes

    p, r = max(len(x.prompt_ids) for x in records), max(len(x.response_ids) for x in records)
    out = {k: torch.zeros(len(records), w, dtype=torch.long) for k, w in
           (("prompt_ids", p), ("prompt_mask", p), ("response_ids", r), ("response_mask", r))}  # fmt: skip
    rollout = torch.zeros(len(records), r)
    for i, x in enumerate(records):
        out["prompt_ids"][i, p - len(x.prompt_ids) :] = torch.tensor(x.prompt_ids)
        out["prompt_mask"][i, p - len(x.prompt_ids) :] = 1
        out["response_ids"][i, : len(x.response_ids)] = torch.tensor(x.response_ids)
        out["response_mask"][i, : len(x.response_ids)] = 1
        rollout[i, : len(x.response_ids)] = torch.tensor(x.rollout_logprobs)
    out["routed_experts"] = collate_routes(records, p, r)
    return out, rollout


def measure_mismatch(trainer_model, records, device, args, replays=("off", "rollout"), name="routing_mismatch"):
    """`routing_mismatch` lines: the trainer's forward over the native rollouts, replay off and on."""
    import torch

    from rlx.logprobs import ModuleScorer
    from rlx.parallel.dist import DistContext

    tensors, rollout = collate(records)
    mask = tensors["response_mask"].bool()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    scorer = ModuleScorer(trainer_model, DistContext(device=device))
    for replay in replays:
        if tensors["routed_experts"] is None:  # the dense baseline: no routers
            logprobs, mismatch = scorer.logprobs(tensors, 1.0, dtype, micro_batch_size=args.n), 0.0
        else:
            logprobs, mismatch = scorer.replayed_logprobs(tensors, replay, 1.0, dtype, micro_batch_size=args.n)
        diff = (logprobs.float().cpu() - rollout).abs()[mask]
        emit({"measurement": name, "router_replay": replay, "routing_mismatch": round(mismatch, 5),
              "logprob_abs_diff_mean": float(diff.mean()), "logprob_abs_diff_max": float(diff.max()),
              "tokens": int(mask.sum()), "device": device_name(device)})  # fmt: skip


def write_recipe(work: Path, model: Path, args) -> Path:
    texts = prompt_texts(args.num_prompts * args.steps, args.prompt_len - 1, seed=1)
    lines = [json.dumps({"id": f"p{i}", "prompt": t}) for i, t in enumerate(texts)]
    (work / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    (work / "reward.py").write_text(LENGTH_REWARD)
    path = work / "recipe.toml"
    path.write_text(f"""seed = 0
steps = {args.steps}
use_ref = false
save_every = {args.steps}
keep_checkpoints = 1
[model]
path = "{model}"
init = "random"
[data]
prompts = "{work / "prompts.jsonl"}"
prompts_per_step = {args.num_prompts}
[rollout]
engine = "native"
chat_template = "off"
[rollout.sampling]
n = {args.n}
max_new_tokens = {args.response_len}
temperature = 1.0
[score]
reward = "{work / "reward.py"}:score"
router_replay = "rollout"
[train]
router_replay = "rollout"
[train.optim]
lr = 1e-6
""")
    return path


def measure_grpo_step(work: Path, model: Path, cpu: bool, args) -> None:
    """The `grpo_step` line (`rlx ppo --plan` first on a GPU: a step that does not fit is reported, not run)."""
    from bench.grpo_step import run_and_watch, summarize

    recipe = write_recipe(work, model, args)
    sets = ["--set", 'train.device="cpu"', "--set", 'rollout.device="cpu"'] if cpu else []
    base = [sys.executable, "-m", "rlx", "ppo", str(recipe), *sets]
    line = {"measurement": "grpo_step", "shape": args.shape, "layers": args.layers, "steps": args.steps}
    if not cpu:
        planned = subprocess.run([*base, "--plan"], capture_output=True, text=True, cwd=REPO)
        if planned.returncode != 0:
            emit({**line, "skipped": "rlx ppo --plan: does not fit", "plan": planned.stdout.strip()[-1500:]})
            return
    metrics, arrivals = run_and_watch([*base, "--out", str(work / "run")], work / "run" / "metrics.jsonl",
                                      work / "ppo.log")  # fmt: skip
    steps = [m["timing/step_s"] for m in metrics]
    tokens = [m.get("perf/tokens", 0) or m["rollout/tokens"] + m["prompt_length/mean"] * m["batch/num_samples"]
              for m in metrics]  # fmt: skip
    summary = summarize("rlx", arrivals[0], steps, tokens)
    steady = metrics[1:] or metrics
    peaks = [v for m in metrics for k, v in m.items() if k.startswith("memory/") and k.endswith("_device_peak_gb")]
    emit({**line, "first_step_s": round(summary["first_step_s"], 2), "median_s": round(summary["steady_median_s"], 3),
          "p90_s": round(summary["steady_p90_s"], 3), "tokens_per_s_per_gpu": round(summary["tokens_per_s"], 1),
          "mfu": statistics.median(m.get("perf/mfu", 0.0) for m in steady),
          "rollout_tokens_per_s": statistics.median(m.get("perf/rollout_tokens_per_s", 0.0) for m in steady),
          "routing_mismatch": statistics.median(m.get("moe/routing_mismatch", 0.0) for m in steady),
          "peak_memory_gb": max(peaks, default=0.0)})  # fmt: skip


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--steps", type=int, default=6, help="GRPO steps (the first is not counted)")
    parser.add_argument("--num-prompts", type=int, default=16, help="prompts per GRPO step")
    parser.add_argument("--rollout-prompts", type=int, default=16, help="prompts of the rollout measurement")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument("--kv-cache-gib", type=float, default=0.0, help="native KV cache (0: rlx's default)")
    parser.add_argument("--skip", default="",
                        help="comma-separated measurements to leave out: rollout, dense, grpo_step")  # fmt: skip
    parser.add_argument("--work", type=Path, default=None, help="keep the run folders here")
    args = parser.parse_args()
    if args.shape == "tiny":  # a CPU check: small work
        args.layers = min(args.layers, 2)
    os.environ.setdefault("TQDM_DISABLE", "1")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlx.models.tiny import build_char_tokenizer

    work = args.work or Path(tempfile.mkdtemp(prefix="rlx-moe-bench-"))
    model_dir = write_model_dir(work / "model", args)
    cuda = torch.cuda.is_available() and args.shape != "tiny"
    device = torch.device("cuda" if cuda else "cpu")
    skip = set(args.skip.split(","))
    if "rollout" not in skip:
        torch.manual_seed(0)
        with torch.device(device):
            trainer = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
        rollout_model = trainer.to(torch.bfloat16) if cuda else trainer
        records = measure_rollouts(rollout_model.eval(), build_char_tokenizer(), device, args)
        measure_mismatch(rollout_model.float() if cuda else trainer, records, device, args)
        del trainer, rollout_model
        if cuda:
            torch.cuda.empty_cache()
    if "dense" not in skip:
        dense_dir = write_model_dir(work / "dense", args, dense=True)
        torch.manual_seed(0)
        with torch.device(device):
            dense = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(dense_dir), dtype=torch.float32)
        rollout_model = dense.to(torch.bfloat16) if cuda else dense
        records = measure_rollouts(rollout_model.eval(), build_char_tokenizer(), device, args, engines=("native",))
        measure_mismatch(rollout_model.float() if cuda else dense, records, device, args, ("off",), "dense_mismatch")
        del dense, rollout_model
        if cuda:
            torch.cuda.empty_cache()
    if "grpo_step" not in skip:
        measure_grpo_step(work, model_dir, not cuda, args)


if __name__ == "__main__":
    main()
