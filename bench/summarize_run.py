"""Print a per-step table of an `rlx ppo` run dir (reward, length, KL, timings), the held-out evaluation curve
([eval]: val/pass@1 with reward, entropy, length and KL at each evaluated step) and a short summary.

python bench/summarize_run.py runs/smollm2 [--every 5]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--every", type=int, default=1, help="print every k-th step (default 1)")
    args = parser.parse_args()
    every_line = [json.loads(line) for line in (args.run_dir / "metrics.jsonl").read_text().splitlines() if line]
    merged: dict[int, dict] = {}
    for m in every_line:
        merged.setdefault(m["step"], {}).update(m)
    evals = [m for _, m in sorted(merged.items()) if "val/pass@1" in m]
    lines = [m for _, m in sorted(merged.items()) if "reward/mean" in m]
    cols = [
        "reward/mean",
        "response_length/mean",
        "actor/ref_kl",
        "actor/entropy",
        "actor/pg_clipfrac",
        "timing/rollout_s",
        "timing/score_s",
        "timing/train_s",
        "timing/step_s",
        "perf/rollout_tokens_per_s",
    ]
    labels = [
        "reward",
        "resp_len",
        "ref_kl",
        "entropy",
        "clipfrac",
        "rollout_s",
        "score_s",
        "train_s",
        "step_s",
        "rollout_tok/s",
    ]
    print("step  " + "  ".join(label.rjust(12) for label in labels))
    for m in lines:
        if m["step"] % args.every == 0 or m["step"] == 1:
            print(f"{m['step']:4d}  " + "  ".join(f"{m.get(c) or 0:12.4f}" for c in cols))
    if evals:
        print("\nheld-out (greedy) evaluation:")
        print("step  " + "  ".join(c.rjust(12) for c in ("val_pass@1", "reward", "entropy", "resp_len", "ref_kl")))
        for m in evals:
            keys = ("val/pass@1", "reward/mean", "actor/entropy", "response_length/mean", "actor/ref_kl")
            print(f"{m['step']:4d}  " + "  ".join(f"{m[c]:12.4f}" if c in m else " " * 11 + "-" for c in keys))
        # a step's timing/step_s includes its evaluation; only the one before training (step 0) is extra
        total = sum(m.get("timing/step_s", 0.0) for m in lines) + sum(
            m.get("timing/eval_s", 0.0) for m in evals if "reward/mean" not in m
        )
        evaluating = sum(m.get("timing/eval_s", 0.0) for m in evals)
        print(f"steps + evaluations: {total:.0f} s (of which evaluations {evaluating:.0f} s)")
    rewards = [m["reward/mean"] for m in lines]
    k = min(5, len(rewards))
    steps = [m["timing/step_s"] for m in lines[1:]] or [lines[0]["timing/step_s"]]
    print(
        f"reward first {k} steps {sum(rewards[:k]) / k:.3f} -> last {k} steps {sum(rewards[-k:]) / k:.3f}; "
        f"median step {sorted(steps)[len(steps) // 2]:.2f} s over {len(lines)} steps"
    )


if __name__ == "__main__":
    main()
