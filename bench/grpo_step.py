"""Whole GRPO steps, rlx against TRL's GRPOTrainer on the same work, each in its own process, one after the other.

    python bench/grpo_step.py --tools rlx,trl --steps 12 --json out.json     # one GPU
    python bench/grpo_step.py --tools rlx-vllm,trl-vllm --steps 12           # both tools generating with vLLM
    python bench/grpo_step.py --small --cpu --steps 3 --tools rlx,trl       # a quick check of the script

The work (issue 15): a Qwen2-0.5B-shaped model (random init, float32 master weights, bf16 compute), 32 prompts of
128 tokens x 8 samples per step, responses of up to 256 tokens (a random model rarely stops), a length reward, no
reference model, one optimizer step per batch. Both tools get the same prompt token ids (a character tokenizer;
127 characters + BOS), sample at temperature 1 and train with AdamW at lr 1e-6.

rlx: `rlx ppo` on a generated recipe, with the fast defaults it picks on CUDA (printed at its start).
TRL: `GRPOTrainer` (HF generate, its defaults: gradient checkpointing, bf16), per-device batch 16 x 16 gradient
accumulation steps = one generation of 256 samples per optimizer step.
With vLLM (issue 35): 'rlx-vllm' is `rlx ppo` with rollout.engine = "vllm"; 'trl-vllm' is the same TRL run with
`use_vllm=True, vllm_mode="colocate"` (vLLM in the trainer's process, TRL's own weight sync), vLLM's share of GPU
memory --vllm-gpu-memory-utilization for both, and vLLM's sleep mode while training set by --vllm-sleep for both
(TRL's vllm_enable_sleep_mode; rlx's rollout.sleep; on by default, as rlx does). TRL's vLLM loads the random
initial weights from a saved folder.

Per tool: first-step time (process start to the end of step 1, what a user waits for), median and p90 of the
steady steps (every step after the first), tokens/s of the median step (prompt + response tokens), peak device
memory, and for rlx the phase split of the median step. `--exact` adds the row rlx-exact: rlx in exact mode
(`exact = true`, the native engine; docs/exact.md), with the largest |rollout - old logprob| of each rlx row.
"""

from __future__ import annotations

import argparse
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

QWEN2_05B = dict(
    hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
    vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True,
)  # fmt: skip
SMALL = dict(QWEN2_05B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2)
SMALL.update(num_key_value_heads=1, vocab_size=512, max_position_embeddings=1024)
LENGTH_REWARD = (
    "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return float(len(solution_str))\n"
)


def write_model_dir(folder: Path, small: bool) -> Path:
    """config.json (Qwen2 shape) + the character tokenizer: what `init = "random"` starts from."""
    from transformers import Qwen2Config

    from rlx.models.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = Qwen2Config(**(SMALL if small else QWEN2_05B), bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config.architectures = ["Qwen2ForCausalLM"]
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def prompts(count: int, length: int, seed: int = 0) -> list[str]:
    """`count` different prompts of `length` digits: one token each both by the character tokenizer and by the
    byte-level BPE that transformers 5 builds from it for a qwen2 model dir (which drops letters and spaces: with
    them a 127-character prompt was ~44 tokens)."""
    import random

    rng = random.Random(seed)
    alphabet = "0123456789"
    return ["".join(rng.choice(alphabet) for _ in range(length)) for _ in range(count)]


def write_rlx_recipe(work: Path, args) -> Path:
    model = write_model_dir(work / "model", args.small)
    (work / "reward.py").write_text(LENGTH_REWARD)
    lines = [json.dumps({"id": f"p{i}", "prompt": p}) for i, p in enumerate(prompts(args.num_prompts * args.steps,
                                                                                  args.prompt_len - 1))]  # fmt: skip
    (work / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    recipe = f"""
seed = 0
steps = {args.steps}
use_ref = false
save_every = {args.save_every}
keep_checkpoints = 1
[model]
path = "{model}"
init = "random"
[data]
prompts = "{work / "prompts.jsonl"}"
prompts_per_step = {args.num_prompts}
[rollout]
chat_template = "off"
[rollout.sampling]
n = {args.num_generations}
max_new_tokens = {args.response_len}
temperature = 1.0
[score]
reward = "{work / "reward.py"}:score"
[train.optim]
lr = 1e-6
"""
    path = work / "recipe.toml"
    path.write_text(recipe)
    return path


def run_rlx(args, work: Path, tool: str = "rlx") -> dict:
    recipe = write_rlx_recipe(work, args)
    run_dir = work / ("run" if tool == "rlx" else f"run-{tool}")
    launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc)] if args.nproc > 1 else []
    cmd = [
        sys.executable,
        *launcher,
        "-m",
        "rlx",
        "ppo",
        str(recipe),
        "--out",
        str(run_dir),
        *sum((["--set", s] for s in args.set), []),
    ]
    if args.cpu:
        cmd += ["--set", 'train.device="cpu"', "--set", 'rollout.device="cpu"']
    if tool == "rlx-exact":  # exact (batch-invariant) mode: the native engine's logprobs equal the trainer's
        cmd += ["--set", "exact=true", "--set", 'rollout.engine="native"']
    if tool == "rlx-vllm":
        cmd += ["--set", 'rollout.engine="vllm"', "--set", f"rollout.sleep={str(args.vllm_sleep == 'on').lower()}"]
        cmd += ["--set", f"rollout.gpu_memory_utilization={args.vllm_gpu_memory_utilization}"]
    log_path = work / f"{tool}.log"
    metrics, arrivals = run_and_watch(cmd, run_dir / "metrics.jsonl", log_path)
    steps = [m["timing/step_s"] for m in metrics]
    tokens = [m.get("perf/tokens", 0) or m["rollout/tokens"] + m["prompt_length/mean"] * m["batch/num_samples"]
              for m in metrics]  # fmt: skip
    phases = {
        k: [m.get(f"timing/{k}_s", 0.0) for m in metrics] for k in ("weight_sync", "rollout", "score", "train", "save")
    }
    out = summarize(tool, arrivals[0], steps, tokens)
    median_step = sorted(range(1, len(steps)), key=lambda i: steps[i])[(len(steps) - 1) // 2] if len(steps) > 1 else 0
    out["phases_of_median_step"] = {k: v[median_step] for k, v in phases.items()}
    first = (
        "since_process_start",
        "setup_process",
        "setup_backend",
        "setup_inputs",
        "setup_models",
        "setup_engine",
        "rollout",
        "score",
        "train",
        "save",
    )
    out["first_step_phases"] = {k: metrics[0].get(f"timing/{k}_s") for k in first}
    peaks = [v for m in metrics for k, v in m.items() if k.startswith("memory/") and k.endswith("_device_peak_gb")]
    out["peak_memory_gb"] = max(peaks, default=0.0)
    diffs = [m["rollout_corr/logprob_abs_diff_max"] for m in metrics if "rollout_corr/logprob_abs_diff_max" in m]
    out["rollout_corr_abs_diff_max"] = max(diffs, default=None)  # the sampler's logprobs vs the trainer's old ones
    out["rollout_tokens_per_s_median"] = statistics.median(
        m["perf/rollout_tokens_per_s"] for m in metrics[1:] or metrics
    )
    out["config_line"] = next((line for line in log_path.read_text().splitlines() if "fast path" in line), "")
    return out


TRL_SCRIPT = r"""
import json, sys, time
T0 = float(sys.argv[1]); work = sys.argv[2]; args = json.loads(sys.argv[3])
import torch
from datasets import Dataset
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
tokenizer = AutoTokenizer.from_pretrained(work + "/model")
config = Qwen2Config.from_pretrained(work + "/model")
torch.manual_seed(0)
model = Qwen2ForCausalLM(config)
if args["use_vllm"]:  # TRL's colocated vLLM loads the weights from model.name_or_path: save them there first
    model.save_pretrained(work + "/trl_vllm_model")
    tokenizer.save_pretrained(work + "/trl_vllm_model")
    model = Qwen2ForCausalLM.from_pretrained(work + "/trl_vllm_model", dtype=torch.float32)
prompts = [json.loads(l)["prompt"] for l in open(work + "/prompts.jsonl")]
data = Dataset.from_dict({"prompt": prompts})
def length_reward(completions, **kw):
    return [float(len(c)) for c in completions]
log = open(work + "/trl_steps.jsonl", "w")
class Timer(TrainerCallback):
    def on_step_end(self, a, state, control, **kw):
        peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0
        log.write(json.dumps({"step": state.global_step, "t": time.time() - T0, "peak_gb": peak}) + "\n")
        log.flush()
micro = min(args["trl_micro_batch"], args["num_prompts"] * args["num_generations"])
cfg = GRPOConfig(
    output_dir=work + "/trl_out", num_generations=args["num_generations"], max_completion_length=args["response_len"],
    per_device_train_batch_size=micro,
    gradient_accumulation_steps=args["num_prompts"] * args["num_generations"] // micro,
    learning_rate=1e-6, temperature=1.0, max_steps=args["steps"], logging_steps=1, save_strategy="no", report_to=[],
    shuffle_dataset=False, use_cpu=args["cpu"], bf16=not args["cpu"], seed=0,
    **(dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=args["vllm_gpu_memory_utilization"],
            vllm_enable_sleep_mode=args["vllm_sleep"] == "on", vllm_max_model_length=args["max_model_len"])
       if args["use_vllm"] else {}),
)
trainer = GRPOTrainer(model=model, reward_funcs=length_reward, args=cfg, train_dataset=data, processing_class=tokenizer,
                      callbacks=[Timer()])
trainer.train()
"""


def run_trl(args, work: Path, tool: str = "trl") -> dict:
    if not (work / "model").exists():
        write_rlx_recipe(work, args)  # the same model dir and prompts
    script = work / "trl_run.py"
    script.write_text(TRL_SCRIPT)
    keys = ("num_prompts", "num_generations", "response_len", "steps", "cpu", "trl_micro_batch",
            "vllm_gpu_memory_utilization", "vllm_sleep")  # fmt: skip
    settings = {k: getattr(args, k) for k in keys}
    settings.update(use_vllm=tool == "trl-vllm", max_model_len=args.prompt_len + args.response_len + 8)
    log_path = work / f"{tool}.log"
    (work / "trl_steps.jsonl").unlink(missing_ok=True)
    start = time.time()
    with open(log_path, "w") as log:
        done = subprocess.run([sys.executable, str(script), str(start), str(work), json.dumps(settings)],
                              stdout=log, stderr=subprocess.STDOUT, cwd=work)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"{tool} failed:\n{log_path.read_text()[-3000:]}")
    rows = [json.loads(line) for line in (work / "trl_steps.jsonl").read_text().splitlines()]
    ends = [r["t"] for r in rows]
    steps = [ends[0]] + [b - a for a, b in zip(ends, ends[1:])]
    tokens = [args.num_prompts * args.num_generations * (args.prompt_len + args.response_len)] * len(steps)
    out = summarize(tool, ends[0], steps, tokens)
    out["peak_memory_gb"] = max(r["peak_gb"] for r in rows)
    out["note"] = "tokens assume full-length responses (TRL's random model rarely stops early)"
    return out


def run_and_watch(cmd: list[str], metrics_file: Path, log_path: Path) -> tuple[list[dict], list[float]]:
    """Run `cmd`, noting when each metrics line appears (seconds since the start)."""
    start, arrivals, seen = time.time(), [], 0
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        while proc.poll() is None:
            time.sleep(0.2)
            if metrics_file.exists():
                count = sum(1 for line in metrics_file.read_text().splitlines() if line.strip())
                arrivals += [time.time() - start] * (count - seen)
                seen = count
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[:4]} failed:\n{log_path.read_text()[-3000:]}")
    metrics = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    arrivals += [time.time() - start] * (len(metrics) - len(arrivals))
    return metrics, arrivals


def summarize(tool: str, first_step_s: float, steps: list[float], tokens: list[float]) -> dict:
    steady = steps[1:] or steps
    median = statistics.median(steady)
    p90 = sorted(steady)[min(len(steady) - 1, int(round(0.9 * (len(steady) - 1))))]
    return {
        "tool": tool,
        "first_step_s": first_step_s,
        "steady_median_s": median,
        "steady_p90_s": p90,
        "p90_over_median": p90 / median,
        "tokens_per_s": statistics.median(tokens[1:] or tokens) / median,
        "steps_s": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tools", default="rlx,trl", help="comma-separated: rlx, trl, rlx-vllm, trl-vllm, rlx-exact")
    parser.add_argument("--exact", action="store_true", help="also run rlx in exact mode (exact = true, the native "
                        "engine): the row rlx-exact, beside the others")  # fmt: skip
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument("--save-every", type=int, default=5, help="rlx checkpoint interval (steps)")
    parser.add_argument("--trl-micro-batch", type=int, default=64, help="TRL's per_device_train_batch_size")
    parser.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.3, help="rlx-vllm, trl-vllm: vLLM's "
                        "share of GPU memory (TRL's default)")  # fmt: skip
    parser.add_argument("--vllm-sleep", choices=("on", "off"), default="on", help="rlx-vllm, trl-vllm: vLLM's sleep "
                        "mode while training (on: rlx's default; TRL's vllm_enable_sleep_mode)")  # fmt: skip
    parser.add_argument("--set", action="append", default=[], help="extra `rlx ppo --set` overrides")
    parser.add_argument("--nproc", type=int, default=1, help="rlx: processes under torchrun (FSDP over N GPUs); the "
                        "same work per step in all")  # fmt: skip
    parser.add_argument("--small", action="store_true", help="a tiny model (a check of the script)")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--work", type=Path, default=None, help="keep the run folders here")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    os.environ.setdefault("TQDM_DISABLE", "1")
    work = args.work or Path(tempfile.mkdtemp(prefix="rlx-grpo-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    runners = {"rlx": run_rlx, "rlx-vllm": run_rlx, "rlx-exact": run_rlx, "trl": run_trl, "trl-vllm": run_trl}
    tools = args.tools.split(",")
    if args.exact and "rlx-exact" not in tools:
        tools.append("rlx-exact")
    unknown = [t for t in tools if t not in runners]
    if unknown:
        parser.error(f"unknown tools {unknown}: choose from {', '.join(runners)}")
    for tool in tools:
        result = runners[tool](args, work, tool)
        results.append(result)
        print(json.dumps(result), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print(f"\n{'tool':<8} {'first step':>11} {'median':>8} {'p90':>8} {'p90/med':>8} {'tokens/s':>10} {'peak GB':>8}")
    for r in results:
        print(f"{r['tool']:<8} {r['first_step_s']:>10.1f}s {r['steady_median_s']:>7.2f}s {r['steady_p90_s']:>7.2f}s "
              f"{r['p90_over_median']:>8.2f} {r['tokens_per_s']:>10,.0f} {r['peak_memory_gb']:>8.1f}")  # fmt: skip
    by = {r["tool"]: r for r in results}
    for ours, theirs in (("rlx", "trl"), ("rlx-vllm", "trl-vllm"), ("rlx", "trl-vllm"), ("rlx-exact", "rlx")):
        if ours in by and theirs in by:
            print(f"{ours} / {theirs} tokens/s: {by[ours]['tokens_per_s'] / by[theirs]['tokens_per_s']:.2f}x")
    for tool in ("rlx", "rlx-vllm", "rlx-exact"):
        if tool in by:
            print(f"{tool} median step phases:", {k: round(v, 3) for k, v in by[tool]["phases_of_median_step"].items()})
            print(f"{tool} first step phases:",
                  {k: v and round(v, 2) for k, v in by[tool]["first_step_phases"].items()})  # fmt: skip


if __name__ == "__main__":
    main()
