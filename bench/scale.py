"""rlx ppo at 0.5B-14B on 1, 2 and 4 GPUs: the memory plan against the measured peak, and step times.

    python bench/scale.py                                      # 7B on 4, 2, 1 GPUs (4 x H100): < 8 minutes
    python bench/scale.py --shapes 0.5b,7b,14b --deadline-s 3600 --json scale.json   # the whole table
    python bench/scale.py --small --cpu --gpus 1,2 --steps 2   # a quick check of the script, on the CPU
    python bench/scale.py --shapes 0.5b --weak --gpus 4,1 --independent 4 --steps 6   # where weak scaling loses

The work per step (issue 34): a config-only model dir of the shape (random init, no download), 32 prompts of 128
tokens x 8 samples, responses of up to 256 tokens (a random model rarely stops), a length reward, no reference model,
one optimizer step per batch; `rlx ppo` under torchrun with N processes (one process for N = 1) and a minimal recipe,
everything else left to rlx (the fast path and the memory plan, printed at its start).

For each shape and GPU count: `rlx ppo --plan` first (a shape that does not fit is reported, not run), then the run.
Per run: first step (process start to the first metrics line), median and p90 of the later steps, tokens/s per GPU
(prompt + response tokens of the median step / its seconds / GPUs), MFU of the median step (perf/mfu: over all
the GPUs' peak), rank 0's peak device memory over the phases (metrics.jsonl), and the plan's estimated peak beside
it. Each run is stopped after --timeout-s, and nothing runs past --deadline-s (most GPUs first: the 4-GPU run is the
headline). A compact table at the end; --json keeps everything.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = {
    "0.5b": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=896, intermediate_size=4864,
                 num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                 tie_word_embeddings=True),
    "7b": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=3584, intermediate_size=18944,
               num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
               attention_bias=True, tie_word_embeddings=False),  # Qwen2.5-7B-shaped, q/k/v biases (issue 34)
    "14b": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=5120, intermediate_size=13824,
                num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
                tie_word_embeddings=False),
    "32b": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=5120, intermediate_size=27648,
                num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
                tie_word_embeddings=False),  # Qwen2.5-32B-shaped
    "moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=2048, intermediate_size=6144,
                moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                num_hidden_layers=12, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                rms_norm_eps=1e-6, tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[]),
    # Qwen3-30B-A3B's layer with 12 of its 48 layers (7.7B parameters, 0.9B active per token: issue 36)
    "small": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, vocab_size=512,
                  tie_word_embeddings=True),
}  # fmt: skip
COMMON = dict(max_position_embeddings=32768, rope_theta=1000000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0)
LENGTH_REWARD = (
    "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return float(len(solution_str))\n"
)
_FILES_WRITTEN = re.compile(r"files written in ([\d.]+) s")
_PLAN_PEAK = re.compile(r"rollout ([\d.]+), score ([\d.]+), train ([\d.]+) of ([\d.]+) usable")
_PLAN_HOST = re.compile(r"host: peak GiB load ([\d.]+), steady ([\d.]+) of .* \((\d+) ranks per host")


def write_model_dir(folder: Path, shape: str) -> Path:
    """config.json of the shape + the character tokenizer: what `init = "random"` starts from (no weights)."""
    from rlx.models.tiny import build_char_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**SHAPES[shape], **COMMON, "torch_dtype": "float32"}, indent=2))
    build_char_tokenizer().save_pretrained(folder)
    return folder


def prompts_per_step(args, gpus: int) -> int:
    """The fixed work (strong scaling), or --num-prompts per GPU with --weak (weak scaling)."""
    return args.num_prompts * gpus if args.weak else args.num_prompts


def write_recipe(work: Path, shape: str, args, gpus: int = 1) -> Path:
    """The minimal recipe (the issue's work) on the shape's model dir."""
    import random

    model = write_model_dir(work / f"model-{shape}", shape)
    rng = random.Random(0)
    # digits: one token each both by the character tokenizer and by the byte-level BPE that transformers 5 builds
    # from it for a qwen2 model dir (which drops letters and spaces): every prompt is --prompt-len tokens
    alphabet = "0123456789"
    per_step = prompts_per_step(args, gpus)
    count = per_step * args.steps
    lines = [json.dumps({"id": f"p{i}", "prompt": "".join(rng.choice(alphabet) for _ in range(args.prompt_len - 1))})
             for i in range(count)]  # fmt: skip
    (work / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    (work / "reward.py").write_text(LENGTH_REWARD)
    path = work / f"recipe-{shape}.toml"
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
prompts_per_step = {per_step}
[rollout]
max_prompt_length = {args.prompt_len}
chat_template = "off"
[rollout.sampling]
n = {args.num_generations}
max_new_tokens = {args.response_len}
temperature = 1.0
[score]
reward = "{work / "reward.py"}:score"
[train.optim]
lr = 1e-6
""")
    return path


def plan(recipe: Path, gpus: int, args) -> dict:
    """`rlx ppo --plan` for this many GPUs: whether it fits, the estimated peaks, the printed block."""
    cmd = [sys.executable, "-m", "rlx", "ppo", str(recipe), "--plan", "--gpus", str(gpus), *extra_sets(args)]
    if args.gpu_memory_gib:
        cmd += ["--gpu-memory-gib", str(args.gpu_memory_gib)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env())
    found = _PLAN_PEAK.search(done.stdout)
    peaks = dict(zip(("rollout", "score", "train", "usable"), map(float, found.groups()))) if found else {}
    return {"fits": done.returncode == 0, "peaks_gib": peaks, "host_gib_per_rank": plan_host(done.stdout),
            "text": (done.stdout + done.stderr).strip()}  # fmt: skip


def plan_host(text: str) -> dict:
    """The plan's host peaks per rank ({'load', 'steady'}, GiB; empty when the plan did not check the host)."""
    found = _PLAN_HOST.search(text)
    if not found:
        return {}
    load, steady, ranks = float(found[1]), float(found[2]), int(found[3])
    return {"load": load / ranks, "steady": steady / ranks}


def extra_sets(args) -> list[str]:
    sets = list(args.set)
    if args.cpu:
        sets += ['train.device="cpu"', 'rollout.device="cpu"']
    return [a for s in sets for a in ("--set", s)]


def env(device: int | None = None) -> dict:
    """The runs' environment: this checkout first on the path, the caller's PYTHONPATH after it; `device`: the one
    GPU a run sees (CUDA_VISIBLE_DEVICES), for --independent."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    visible = {} if device is None else {"CUDA_VISIBLE_DEVICES": str(device)}
    return {**os.environ, "PYTHONPATH": path, "TQDM_DISABLE": "1", **visible}


def run(
    recipe: Path, gpus: int, run_dir: Path, args, limit_s: float, device: int | None = None
) -> tuple[list[dict], list[float], str]:
    """`rlx ppo` on `gpus` processes (torchrun; a plain process for 1), noting when each metrics line appears;
    stopped (SIGTERM) after `limit_s`; `device`: the one GPU it sees. Returns (metrics, arrival seconds, log tail)."""
    launched = gpus > 1 or args.torchrun_one
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}"] if launched else []
    launcher += shlex.split(args.launcher_args) if launched else []
    # --overwrite: a --work used before holds this run's folder; without it rlx ppo refuses, and the old run's
    # metrics.jsonl would be read as this run's
    cmd = [sys.executable, *launcher, "-m", "rlx", "ppo", str(recipe), "--out", str(run_dir), "--overwrite"]
    cmd += extra_sets(args)
    log_path = run_dir.parent / f"{run_dir.name}.log"
    stacks = run_dir.parent / f"{run_dir.name}.stacks"
    if args.py_spy:  # every process's Python stacks sampled (idle threads left out), summarized after the run
        cmd = [args.py_spy, "record", "--subprocesses", "--nonblocking", "--format", "raw", "--rate", "50",
               "--output", str(stacks), "--", *cmd]  # fmt: skip
    metrics_file, start, arrivals = run_dir / "metrics.jsonl", time.time(), []
    metrics_file.unlink(missing_ok=True)  # an earlier run's, counted as this one's steps before rlx clears it
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env(device))
        while proc.poll() is None and time.time() - start < limit_s:
            time.sleep(0.5)
            if metrics_file.exists():
                count = sum(1 for line in metrics_file.read_text().splitlines() if line.strip())
                arrivals += [time.time() - start] * (count - len(arrivals))
        if proc.poll() is None:
            proc.terminate()  # SIGTERM: rlx stops after the step (and its checkpoint)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
    metrics = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
    arrivals += [time.time() - start] * (len(metrics) - len(arrivals))
    if args.py_spy and stacks.exists():
        summary = summarize_stacks(stacks.read_text())
        (run_dir.parent / f"{run_dir.name}.profile.txt").write_text(summary)
        print(summary[:6000], flush=True)
    return metrics, arrivals, log_path.read_text()[-2000:]


def summarize_stacks(raw: str, top: int = 45) -> str:
    """py-spy's collapsed stacks ('frame;frame;... count' per line, the process first) as, per process with rlx
    frames, the rlx/torch functions with the largest share of its samples (inclusive: on the stack anywhere)."""
    from collections import Counter, defaultdict

    inclusive: dict[str, Counter] = defaultdict(Counter)
    totals: Counter = Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        process = [f for f in frames if f.startswith("process ")][-1:] or frames[:1]  # a child's stack: its own
        process = process[0][:60]
        totals[process] += int(count)
        names = {re.sub(r":\d+\)$", ")", f) for f in frames[1:] if "rlx/" in f or "torch/" in f}
        for name in names:
            inclusive[process][name] += int(count)
    out = []
    for process, total in totals.most_common():
        if not inclusive[process]:
            continue
        out.append(f"== {process}: {total} samples")
        for name, count in inclusive[process].most_common(top):
            out.append(f"{count / total:7.1%}  {name[:150]}")
    return "\n".join(out) + "\n"


def steady_step_s(metrics: list[dict]) -> float:
    """The median step of the later half of the steps after the first, the last one without its final save: the
    steady step, past the early steps that pin the checkpoint's host buffers (at 7B they took 6.8-9.7 s against
    4.6-4.8 s later: bench/RESULTS.md, Scale)."""
    steps = [m["timing/step_s"] for m in metrics]
    if len(steps) < 2:
        return steps[0] if steps else 0.0
    steps[-1] -= metrics[-1].get("timing/save_s", 0.0)
    later = steps[1:]
    return statistics.median(later[len(later) // 2 :])


def summarize(metrics: list[dict], arrivals: list[float], gpus: int) -> dict:
    """Step times, tokens/s per GPU and MFU of the median later step, rank 0's peak memory."""
    steps = [m["timing/step_s"] for m in metrics]
    later = list(range(1, len(steps))) or [0]
    median_index = sorted(later, key=lambda i: steps[i])[(len(later) - 1) // 2]
    median = steps[median_index]
    p90 = sorted(steps[i] for i in later)[min(len(later) - 1, round(0.9 * (len(later) - 1)))]
    m = metrics[median_index]
    tokens = m.get("rollout/tokens", 0.0) + m.get("prompt_length/mean", 0.0) * m.get("batch/num_samples", 0.0)
    peaks = [v for row in metrics for k, v in row.items() if k.startswith("memory/") and k.endswith("device_peak_gb")]
    host = [v for row in metrics for k, v in row.items() if k.startswith("memory/") and k.endswith("host_rss_gb")]
    return {
        "steps": len(steps),
        "first_step_s": arrivals[0],
        "median_s": median,
        "steady_s": steady_step_s(metrics),
        "p90_s": p90,
        "tokens_per_s_per_gpu": tokens / median / gpus if median else 0.0,
        "mfu": m.get("perf/mfu"),  # the step's FLOPs (all ranks' samples) over all the run's GPUs' peak
        "peak_gib_rank0": max(peaks, default=0.0),
        "host_rss_gib_rank0": max(host, default=0.0),  # the steps' host memory (the load before step 1 is not seen)
        "phases_of_median_s": {k: m.get(f"timing/{k}_s") for k in ("weight_sync", "rollout", "score", "train", "save")},
        # under a launcher, the rollout's parts: the rank's own share (its replica's fill inside) and the gather
        "rollout_parts_of_median_s": {
            k: m.get(key)
            for k, key in (
                ("own share", "timing/generate_local_s"),
                ("replica fill", "rollout/replica_fill_s"),
                ("gather and wait", "timing/generate_gather_s"),
            )
            if m.get(key) is not None
        },
        "final_save_s": metrics[-1].get("timing/save_s"),
    }


def measure(shape: str, gpus: int, work: Path, args, deadline: float, device: int | None = None) -> dict:
    """One run of `shape` on `gpus` GPUs (`device`: the one GPU of an --independent copy) and its summary row."""
    recipe = write_recipe(work, shape, args, gpus)
    row = {
        "shape": shape,
        "gpus": gpus,
        "prompts_per_step": prompts_per_step(args, gpus),
        "plan": plan(recipe, gpus, args),
    }
    if device is not None:
        row["independent_on"] = device
    else:
        print(row["plan"]["text"], flush=True)
    left = deadline - time.time()
    if not row["plan"]["fits"] or left < 60:
        row["error"] = "" if not row["plan"]["fits"] else "skipped: --deadline-s reached"
        return row
    limit = min(args.timeout_s, left)
    metrics, arrivals, tail = run(recipe, gpus, work / f"run-{shape}-{gpus}", args, limit, device)
    if not metrics:
        row["error"] = tail
        return row
    row.update(summarize(metrics, arrivals, gpus))
    written = _FILES_WRITTEN.findall(tail)  # the final checkpoint's files, written after the last metrics line
    row["final_write_s"] = float(written[-1]) if written else None
    return row


def warm_up(shape: str, work: Path, args) -> None:
    """Two steps of `shape` on one GPU, not measured: a fresh machine's first run compiles into empty Inductor and
    Triton caches and reads every file from disk, and it ran 25-35% slower a step than the same run after it
    (bench/RESULTS.md, twentieth session), which the first measured run would otherwise pay."""
    warm = argparse.Namespace(**{**vars(args), "steps": 2})
    start = time.time()
    recipe = write_recipe(work / "warm-up", shape, warm, 1)
    metrics, _, tail = run(recipe, 1, work / "warm-up" / "run", warm, min(args.timeout_s, 300.0))
    print(f"warm-up ({shape}, 1 GPU, 2 steps): {time.time() - start:.0f} s" + ("" if metrics else f", failed:\n{tail}"),
          flush=True)  # fmt: skip


def measure_independent(shape: str, copies: int, work: Path, args, deadline: float) -> list[dict]:
    """`copies` one-GPU runs of `shape` at once, GPU i for copy i (the CPU with --cpu), no launcher: what sharing
    the host alone costs a rank, against one run alone and against the launcher's run of as many ranks."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=copies) as pool:
        jobs = [pool.submit(measure, shape, 1, work / f"independent-{i}", args, deadline, i) for i in range(copies)]
        return [job.result() for job in jobs]


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'shape':<6}{'gpus':>5}{'first':>8}{'median':>8}{'steady':>8}{'p90':>7}{'tok/s/gpu':>11}{'MFU':>7}{'peak':>7}"
        f"{'plan':>7}"
    )
    print("\n" + head + "  (seconds; GiB per rank: measured on rank 0, planned)")
    for r in rows:
        planned = r["plan"]["peaks_gib"]
        plan_peak = max((v for k, v in planned.items() if k != "usable"), default=0.0)
        if "median_s" not in r:
            error = r.get("error", "")
            why = (
                "does not fit (plan)"
                if not r["plan"]["fits"]
                else error
                if error.startswith("skipped")
                else "failed: its log's end below the table"
            )
            print(f"{r['shape']:<6}{_gpus_label(r):>5}  {why}")
            continue
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
        print(f"{r['shape']:<6}{_gpus_label(r):>5}{r['first_step_s']:>8.0f}{r['median_s']:>8.2f}{r['steady_s']:>8.2f}"
              f"{r['p90_s']:>7.2f}"
              f"{r['tokens_per_s_per_gpu']:>11,.0f}{mfu:>7}{r['peak_gib_rank0']:>7.1f}{plan_peak:>7.1f}")  # fmt: skip
    for r in rows:  # where the median step went
        if "median_s" in r:
            phases = ", ".join(f"{k} {v:.2f}" for k, v in r["phases_of_median_s"].items() if v is not None)
            parts = ", ".join(f"{k} {v:.2f}" for k, v in r.get("rollout_parts_of_median_s", {}).items())
            print(
                f"{r['shape']} on {_gpus_label(r)}: median step's phases (s): {phases}"
                + (f" (rollout: {parts})" if parts else "")
            )
    if any("independent_on" in r for r in rows):
        print("1@g: one of the --independent one-GPU runs that ran at once, on GPU g, no launcher")
    for r in rows:  # the host's memory: rank 0's largest RSS over the steps against the plan's steady share a rank
        host = r["plan"].get("host_gib_per_rank") or {}
        if "host_rss_gib_rank0" in r and host:
            print(
                f"{r['shape']} on {r['gpus']}: host GiB rank 0 {r['host_rss_gib_rank0']:.1f}, plan steady a rank "
                f"{host['steady']:.1f} (load {host['load']:.1f}, before step 1: not measured)"
            )
    for r in rows:
        if "median_s" not in r and r["plan"]["fits"] and not r.get("error", "").startswith("skipped"):
            print(f"\n{r['shape']} on {_gpus_label(r)} failed; the end of its log:\n{r.get('error', '')[-1500:]}")


def _gpus_label(row: dict) -> str:
    return f"1@{row['independent_on']}" if "independent_on" in row else str(row["gpus"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="7b", help="comma-separated: 0.5b, 7b, 14b, 32b, moe (Qwen3-30B-A3B, "
                        "12 layers)")  # fmt: skip
    parser.add_argument("--gpus", default="1,2,4", help="comma-separated GPU counts")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--num-prompts", type=int, default=32, help="prompts per step (per GPU with --weak)")
    parser.add_argument("--weak", action="store_true", help="weak scaling: --num-prompts per GPU, not in all")
    parser.add_argument(
        "--torchrun-one",
        action="store_true",
        help="launch the one-GPU runs under torchrun (its overhead: run again without it)",
    )
    parser.add_argument("--independent", type=int, default=0, metavar="N", help="then N one-GPU runs at once, one "
                        "a GPU (CUDA_VISIBLE_DEVICES), no launcher: the shared host's cost alone")  # fmt: skip
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument("--timeout-s", type=float, default=420.0, help="stop a run after this long (SIGTERM)")
    parser.add_argument("--deadline-s", type=float, default=470.0, help="no run starts (or goes on) past this long "
                        "after the start; the most GPUs run first")  # fmt: skip
    parser.add_argument("--gpu-memory-gib", type=float, default=None, help="for the plan; default the GPU's")
    parser.add_argument("--set", action="append", default=[], help="extra `rlx ppo --set` overrides")
    parser.add_argument("--small", action="store_true", help="a tiny model (a check of the script)")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (with --small; plan for --gpu-memory-gib)")
    parser.add_argument("--work", type=Path, default=None, help="keep run folders and logs here")
    parser.add_argument(
        "--warm-up",
        action="store_true",
        help="first run two unmeasured steps on one GPU (a fresh machine's first run is slower: cold compile caches)",
    )
    parser.add_argument("--launcher-args", default="", help="more torchrun options, e.g. '--numa-binding exclusive'")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--py-spy", default="", help="a py-spy binary: sample every process's Python stacks and "
                        "print each rank's hottest rlx/torch functions (RUN.profile.txt beside the run)")  # fmt: skip
    args = parser.parse_args()
    if args.cpu and not args.gpu_memory_gib:
        args.gpu_memory_gib = 80.0
    work = args.work or Path(tempfile.mkdtemp(prefix="rlx-scale-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    shapes = ["small"] if args.small else args.shapes.split(",")
    deadline = time.time() + args.deadline_s
    counts = sorted({int(g) for g in args.gpus.split(",")}, reverse=True)
    if args.warm_up:
        warm_up(shapes[0], work, args)
    rows = [measure(shape, gpus, work, args, deadline) for shape in shapes for gpus in counts]
    if args.independent:
        rows += [r for shape in shapes for r in measure_independent(shape, args.independent, work, args, deadline)]
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    print_table(rows)


if __name__ == "__main__":
    main()
