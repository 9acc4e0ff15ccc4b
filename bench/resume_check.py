"""--resume at scale: `rlx ppo` run N steps at once against K steps, stopped, then resumed to N, on the same GPUs.

The final checkpoints' float32 weights and AdamW state are compared tensor by tensor (a digest of each tensor's bytes,
so that only one run's checkpoints are on disk at a time: at 7B a checkpoint is 91 GB, and a run keeps two while it
writes its last), and the steps' rewards. On GPUs two uninterrupted runs may already differ (kernels whose
reductions are not ordered, e.g. attention backward atomics): --control runs the uninterrupted run twice, so a
difference is put beside the run-to-run one, and `--set deterministic=true` asks for deterministic kernels (7B with
LoRA on one H200: two default runs differed in every adapted weight after two steps, as the resumed run did; with
deterministic = true all three were equal in every tensor, as at 0.5B with full weights).

    python3 bench/resume_check.py --shape 7b --gpus 4 --steps 4 --split 2 --control --json $OUT/resume.json
    python3 bench/resume_check.py --shape small --cpu --gpus 1 --steps 2 --split 1      # a check of the script

--phase full, then --phase split with the same --work (and arguments), does the same in two commands (e.g. two
device calls of at most 10 minutes each); at 7B on 4 x H200 split's two runs took over 590 s together, so
--phase stop, then --phase resume run them one at a time (two more calls on the same, still warm machine: the
stopped run's checkpoint is in --work). Each run's log and metrics.jsonl stay under --work; its checkpoints are
removed once digested (--keep-checkpoints keeps them).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from scale import SHAPES, env, extra_sets, write_recipe  # noqa: E402


def ppo(recipe: Path, gpus: int, out: Path, args, *extra: str) -> float:
    """`rlx ppo` (under torchrun for several GPUs) into `out`; its seconds. Fails with the log's tail."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}"] if gpus > 1 else []
    cmd = [sys.executable, *launcher, "-m", "rlx", "ppo", str(recipe), "--out", str(out), *extra_sets(args), *extra]
    log = out.parent / f"{out.name}.log"
    start = time.time()
    with open(log, "a") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env(), timeout=args.timeout_s)
    if done.returncode:
        raise SystemExit(f"{out.name} failed (exit {done.returncode}):\n{log.read_text()[-3000:]}")
    return time.time() - start


def digests(run: Path, keep: bool) -> dict:
    """{'checkpoint', 'tensors': {name: [dtype, shape, blake2b of the bytes, float64 sum]}, 'rewards'} of the final
    checkpoint of `run` (weights, then AdamW state; hashed on threads); its checkpoints removed unless `keep`."""
    from concurrent.futures import ThreadPoolExecutor

    from rlx.checkpoints.registry import read_full_optimizer, read_full_weights

    final = max(p.name for p in (run / "checkpoints").glob("step_*"))
    tensors: dict[str, list] = {}

    def one(item: tuple[str, torch.Tensor]) -> tuple[str, list]:
        name, t = item
        flat = t.contiguous().reshape(-1)  # a 0-d tensor (AdamW's step) cannot be viewed as bytes
        digest = hashlib.blake2b(flat.view(torch.uint8).numpy(), digest_size=16).hexdigest()
        return name, [str(t.dtype), list(t.shape), digest, float(flat.double().sum())]

    with ThreadPoolExecutor(max_workers=16) as pool:
        for prefix, read in (("weights/", read_full_weights), ("optimizer/", read_full_optimizer)):
            found = read(run / "checkpoints" / final) or {}
            tensors.update((prefix + name, row) for name, row in pool.map(one, found.items()))
            del found
    if not keep:
        shutil.rmtree(run / "checkpoints")
    return {"checkpoint": final, "tensors": tensors, "rewards": rewards(run)}


def compare(a: dict, b: dict) -> dict:
    """Two runs' `digests`: how many tensors differ, the first few names, whether the rewards are equal."""
    if a["tensors"].keys() != b["tensors"].keys():
        raise SystemExit("the checkpoints hold other tensors")
    differ = [name for name in a["tensors"] if a["tensors"][name] != b["tensors"][name]]
    return {"checkpoint": b["checkpoint"], "tensors": len(a["tensors"]), "differ": len(differ),
            "first_differing": differ[:5], "rewards_equal": a["rewards"] == b["rewards"]}  # fmt: skip


def rewards(run: Path) -> list[float]:
    return [json.loads(line)["reward/mean"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="7b", choices=sorted(SHAPES))
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--split", type=int, default=2, help="the interrupted run stops after this step, then resumes")
    parser.add_argument("--control", action="store_true", help="run the uninterrupted run twice (run-to-run noise)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument("--set", action="append", default=[], help="extra `rlx ppo --set` overrides")
    parser.add_argument("--cpu", action="store_true", help="train and roll out on the CPU (a check of the script)")
    parser.add_argument("--timeout-s", type=float, default=560.0, help="longest one `rlx ppo` may run")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--phase", choices=("all", "full", "split", "stop", "resume"), default="all",
                        help="full: the uninterrupted run(s) only; split: the stopped and resumed run against what "
                        "full left in --work; stop, then resume: split's two runs one at a time (each fits a "
                        "10-minute call at 7B; the stopped run's checkpoint stays in --work between them)")  # fmt: skip
    parser.add_argument("--keep-checkpoints", action="store_true", help="keep each run's checkpoints once digested")
    args = parser.parse_args()
    if args.phase != "all" and args.work is None:
        parser.error("--phase full / split / stop / resume need --work (the folder they share)")
    if not 0 < args.split < args.steps:
        parser.error("--split must be between 0 and --steps")
    args.weak, args.torchrun_one, args.py_spy = False, False, ""  # what scale.write_recipe and extra_sets read
    stop_at = ("--set", f"save_every={args.split}")  # the split runs save at the stop (and the end); the full runs
    # save only at the end (the recipe's save_every = steps): a 7B checkpoint is 91 GB and takes 40 s to write
    work = args.work or Path(tempfile.mkdtemp(prefix="rlx-resume-"))
    work.mkdir(parents=True, exist_ok=True)
    recipe = write_recipe(work, args.shape, args, args.gpus)
    state = work / "resume_state.json"  # what --phase full leaves for --phase split
    result = json.loads(state.read_text()) if args.phase in ("split", "stop", "resume") else {}
    if args.phase in ("full", "all"):
        result = {"shape": args.shape, "gpus": args.gpus, "steps": args.steps, "split": args.split, "seconds": {}}
        result["seconds"]["full"] = ppo(recipe, args.gpus, work / "full", args)
        result["full"] = digests(work / "full", args.keep_checkpoints)
        if args.control:
            result["seconds"]["again"] = ppo(recipe, args.gpus, work / "again", args)
            result["full_vs_again"] = compare(result["full"], digests(work / "again", args.keep_checkpoints))
        state.write_text(json.dumps(result))
    if args.phase in ("split", "all", "stop"):
        result["seconds"]["split"] = ppo(
            recipe, args.gpus, work / "split", args, *stop_at, "--set", f"steps={args.split}"
        )
        print(f"stopped run: {result['seconds']['split']:.0f} s", flush=True)
        state.write_text(json.dumps(result))
    if args.phase in ("split", "all", "resume"):
        result["seconds"]["resumed"] = ppo(recipe, args.gpus, work / "split", args, *stop_at, "--resume")
        print(f"resumed run: {result['seconds']['resumed']:.0f} s", flush=True)
        result["resumed_vs_full"] = compare(result["full"], digests(work / "split", args.keep_checkpoints))
    for name in ("resumed_vs_full", "full_vs_again"):
        if name in result:
            r = result[name]
            print(f"{name}: {r['differ']} of {r['tensors']} tensors differ {r['first_differing']}, "
                  f"rewards {'equal' if r['rewards_equal'] else 'differ'}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({k: v for k, v in result.items() if k != "full"}, indent=2))


if __name__ == "__main__":
    main()
