"""--resume at scale: `rlx ppo` run N steps at once against K steps, stopped, then resumed to N, on the same GPUs.

The final checkpoints' float32 weights and AdamW state are compared tensor by tensor, and the steps' rewards. On
GPUs two uninterrupted runs may already differ (kernels whose reductions are not ordered, e.g. attention backward
atomics): --control runs the uninterrupted run twice, so a difference is put beside the run-to-run one.

    python3 bench/resume_check.py --shape 7b --gpus 4 --steps 4 --split 2 --control --json $OUT/resume.json
    python3 bench/resume_check.py --shape small --cpu --gpus 1 --steps 2 --split 1      # a check of the script

Each run's folder and log stay under --work (a temporary folder by default); at 7B a checkpoint is 91 GB.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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


def compare(a: Path, b: Path) -> dict:
    """The final checkpoints of runs `a` and `b`: tensors compared, how many differ, the largest difference."""
    from rlx.checkpoints.registry import read_full_optimizer, read_full_weights

    final = max(p.name for p in (a / "checkpoints").glob("step_*"))
    out = {"checkpoint": final, "tensors": 0, "differ": 0, "max_abs_diff": 0.0}
    for read in (read_full_weights, read_full_optimizer):
        left, right = read(a / "checkpoints" / final), read(b / "checkpoints" / final)
        if left.keys() != right.keys():
            raise SystemExit(f"{a.name} / {b.name}: the checkpoints hold other tensors")
        for key in list(left):
            x, y = left.pop(key), right.pop(key)  # each pair freed once compared (91 GB at 7B)
            out["tensors"] += 1
            if not x.equal(y):
                out["differ"] += 1
                out["max_abs_diff"] = max(out["max_abs_diff"], float((x.double() - y.double()).abs().max()))
    out["rewards_equal"] = rewards(a) == rewards(b)
    return out


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
    args = parser.parse_args()
    if not 0 < args.split < args.steps:
        parser.error("--split must be between 0 and --steps")
    args.weak, args.torchrun_one, args.py_spy = False, False, ""  # what scale.write_recipe and extra_sets read
    args.set = [*args.set, f"save_every={args.split}"]
    work = args.work or Path(tempfile.mkdtemp(prefix="rlx-resume-"))
    work.mkdir(parents=True, exist_ok=True)
    recipe = write_recipe(work, args.shape, args, args.gpus)
    seconds = {"full": ppo(recipe, args.gpus, work / "full", args)}
    seconds["split"] = ppo(recipe, args.gpus, work / "split", args, "--set", f"steps={args.split}")
    seconds["resumed"] = ppo(recipe, args.gpus, work / "split", args, "--resume")
    result = {"shape": args.shape, "gpus": args.gpus, "steps": args.steps, "split": args.split, "seconds": seconds,
              "resumed_vs_full": compare(work / "full", work / "split")}  # fmt: skip
    if args.control:
        seconds["again"] = ppo(recipe, args.gpus, work / "again", args)
        result["full_vs_again"] = compare(work / "full", work / "again")
    for name in ("resumed_vs_full", "full_vs_again"):
        if name in result:
            r = result[name]
            print(f"{name}: {r['differ']} of {r['tensors']} tensors differ (max |diff| {r['max_abs_diff']:.3g}), "
                  f"rewards {'equal' if r['rewards_equal'] else 'differ'}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
