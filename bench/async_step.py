"""Asynchronous vs synchronous `rlx ppo` on two GPUs, on work with long-tailed response lengths, in one call.

    python bench/async_step.py --steps 12 --json async.json            # 2 GPUs: the three modes, one after another
    python bench/async_step.py --small --cpu --steps 3                 # a quick check of the script (CPU, gloo)

Modes (each a `torchrun --nproc_per_node 2 -m rlx ppo` started from here):
  sync      both ranks generate, then both train (FSDP over 2): the colocated loop
  async1    rank 0 generates, rank 1 trains, [async] max_staleness = 1
  async2    the same at max_staleness = 2

The work: a Qwen2-0.5B-shaped model (random init; bf16 compute on GPUs), 32 prompts of 128 tokens x 8 samples
per step, a length reward, no reference model, the native engine. A random model rarely samples EOS, so each
response runs to its own cap: 256 tokens for 15 samples in 16, 2,048 for the others (chosen by a hash of the
sample id, the same samples in every mode). The cap is set in the launched processes by wrapping rlx's
`token_requests` (bench only: rlx has no per-sample length option).

Per mode: samples/s over the steady steps (every step after the first: their samples / their summed step
times; also samples per step / the median step), median and p90 step time, and for async the mean staleness
and the trainers' and rollout ranks' waits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

MODES = {"sync": None, "async1": 1, "async2": 2}


def capped_token_requests(short: int, long: int, every: int):
    """rlx's token_requests with a per-sample cap: `long` for one sample id in `every` (by hash), else `short`."""
    from rlx.rollout import requests

    original = requests.token_requests

    def token_requests(reqs, sampling):
        out = original(reqs, sampling)
        for i, r in enumerate(out):
            cap = long if zlib.crc32(r.key.encode()) % every == 0 else short
            out[i] = dataclasses.replace(r, max_new_tokens=min(cap, r.max_new_tokens))
        return out

    return token_requests


def worker(argv: list[str]) -> None:
    """Inside torchrun: cap the lengths, then `rlx ppo ARGV`."""
    short, long, every = (int(os.environ[k]) for k in ("BENCH_SHORT", "BENCH_LONG", "BENCH_EVERY"))
    wrapped = capped_token_requests(short, long, every)
    import rlx.ppo.async_rollout as async_rollout
    import rlx.rollout.base as base
    import rlx.rollout.vllm as vllm_engine

    base.token_requests = async_rollout.token_requests = vllm_engine.token_requests = wrapped
    from rlx.cli import main

    sys.argv = ["rlx", "ppo", *argv]
    main()


def write_recipe(work: Path, args, staleness: int | None) -> Path:
    from grpo_step import LENGTH_REWARD, prompts, write_model_dir

    model = work / "model"
    if not model.exists():
        write_model_dir(model, args.small)
        (work / "reward.py").write_text(LENGTH_REWARD)
        texts = prompts(args.num_prompts * args.steps, args.prompt_len - 1)
        lines = [json.dumps({"id": f"p{i}", "prompt": p}) for i, p in enumerate(texts)]
        (work / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    table = "" if staleness is None else f"[async]\nmax_staleness = {staleness}\nrollout_ranks = 1\n"
    recipe = f"""
seed = 0
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
n = {args.num_generations}
max_new_tokens = {args.long_len}
temperature = 1.0
[score]
reward = "{work / "reward.py"}:score"
[train.optim]
lr = 1e-6
{table}"""
    path = work / f"recipe_{staleness}.toml"
    path.write_text(recipe)
    return path


def torchrun_command(recipe: Path, run_dir: Path, args) -> list[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv-endpoint=localhost:0"]
    command += ["--rdzv-backend=c10d", str(Path(__file__).resolve()), "--worker", str(recipe), "--out", str(run_dir)]
    command += sum((["--set", s] for s in args.set), [])
    if args.cpu:
        command += [
            "--set",
            'train.device="cpu"',
            "--set",
            'rollout.device="cpu"',
            "--set",
            "rollout.native.compile=false",
        ]
    return command


def run_mode(name: str, args, work: Path) -> dict:
    recipe = write_recipe(work, args, MODES[name])
    run_dir = work / f"run_{name}"
    env = {**os.environ, "BENCH_SHORT": str(args.short_len), "BENCH_LONG": str(args.long_len), "BENCH_EVERY": "16"}
    if args.cpu:
        env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    with open(work / f"{name}.log", "w") as log:
        code = subprocess.call(torchrun_command(recipe, run_dir, args), stdout=log, stderr=subprocess.STDOUT, env=env)
    if code != 0:
        raise SystemExit(f"{name} failed:\n{(work / f'{name}.log').read_text()[-3000:]}")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steady = [m["timing/step_s"] for m in metrics[1:]] or [metrics[0]["timing/step_s"]]
    samples = args.num_prompts * args.num_generations
    out = {
        "mode": name,
        "max_staleness": MODES[name],
        "samples_per_s": samples * len(steady) / sum(steady),
        "samples_per_s_median_step": samples / statistics.median(steady),
        "median_step_s": statistics.median(steady),
        "p90_step_s": sorted(steady)[min(len(steady) - 1, int(0.9 * len(steady)))],
        "wall_s_all_steps": sum(m["timing/step_s"] for m in metrics),
        "response_length_mean": statistics.mean(m["response_length/mean"] for m in metrics),
        "steps_s": [m["timing/step_s"] for m in metrics],
    }
    keys = ("async/staleness_mean", "async/trainer_wait_s", "async/rollout_weight_wait_s", "timing/weight_push_s")
    keys += ("async/queue_depth", "timing/generate_s", "timing/score_s", "timing/train_s")
    for key in keys:
        values = [m[key] for m in metrics[1:] if key in m]
        if values:
            out[key] = statistics.mean(values)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--short-len", type=int, default=256, help="the cap of 15 samples in 16")
    parser.add_argument("--long-len", type=int, default=2048, help="the cap of 1 sample in 16")
    parser.add_argument("--set", action="append", default=[], help="extra `rlx ppo --set` overrides (every mode)")
    parser.add_argument("--small", action="store_true", help="a tiny model (a check of the script)")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--work", type=Path, default=None, help="keep the run folders here")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown:
        parser.error(f"unknown mode(s) {sorted(unknown)}; choose from {', '.join(MODES)}")
    if args.small:  # the tiny model's context is 1,024 positions: scale the default lengths down with it
        defaults = {"prompt_len": 128, "short_len": 256, "long_len": 2048, "num_prompts": 32, "num_generations": 8}
        small = {"prompt_len": 16, "short_len": 16, "long_len": 96, "num_prompts": 4, "num_generations": 4}
        for key, value in small.items():
            if getattr(args, key) == defaults[key]:
                setattr(args, key, value)
    return args


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2:])
        return
    args = parse_args()
    os.environ.setdefault("TQDM_DISABLE", "1")
    work = args.work or Path(tempfile.mkdtemp(prefix="rlx-async-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    results = [run_mode(name, args, work) for name in args.modes.split(",")]
    for r in results:
        print(json.dumps(r), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print(f"\n{'mode':<7} {'samples/s':>10} {'median step':>12} {'staleness':>10} {'trainer wait':>13}")
    for r in results:
        print(f"{r['mode']:<7} {r['samples_per_s']:>10.1f} {r['median_step_s']:>11.2f}s "
              f"{r.get('async/staleness_mean', 0.0):>10.2f} {r.get('async/trainer_wait_s', 0.0):>12.2f}s")  # fmt: skip
    base = next((r for r in results if r["mode"] == "sync"), None)
    for r in results:
        if base is not None and r is not base:
            print(f"{r['mode']} / sync samples/s: {r['samples_per_s'] / base['samples_per_s']:.2f}x")


if __name__ == "__main__":
    main()
