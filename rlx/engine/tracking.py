"""Metrics: one JSON line per step in metrics.jsonl, and a one-line console summary.

Metric names are namespaced (`reward/mean`, `actor/pg_clipfrac`, `timing/rollout_s`, `perf/...`).
Non-finite values are written as null (JSON has no NaN).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from rlx.engine.io import append_jsonl, read_jsonl, write_jsonl

# metrics that measure the machine, not the run: they differ between otherwise identical runs
VOLATILE_PREFIXES = ("timing/", "perf/")


def clean(metrics: dict) -> dict:
    """Floats for numbers, None for non-finite values, keys sorted."""
    out = {}
    for key in sorted(metrics):
        value = metrics[key]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = float(value) if math.isfinite(value) else None
        out[key] = value
    return out


def log_metrics(path: str | Path | None, step: int, metrics: dict) -> None:
    """Append {"step": step, ...metrics} to `path` (no-op without a path)."""
    if path:
        append_jsonl(path, {"step": step, **clean(metrics)})


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop lines past `last_step` (resume after a crash); unparsable trailing lines go too."""
    if not path.is_file():
        return
    keep = []
    for _, obj in _read_tolerant(path):
        if isinstance(obj.get("step"), int) and obj["step"] <= last_step:
            keep.append(obj)
    write_jsonl(path, keep)


def _read_tolerant(path: Path) -> list[tuple[int, dict]]:
    import json

    out = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill
        if isinstance(obj, dict):
            out.append((number, obj))
    return out


def read_metrics(path: str | Path) -> list[dict]:
    """All metrics lines of a file."""
    return [obj for _, obj in read_jsonl(path)]


def step_line(step: int, total: int, m: dict) -> str:
    """A one-line console summary of a step."""

    def get(key, fmt="{:.3f}"):
        value = m.get(key)
        return fmt.format(value) if isinstance(value, (int, float)) else "-"

    return (
        f"step {step}/{total}  reward {get('reward/mean')} ±{get('reward/std')}  "
        f"len {get('response_length/mean', '{:.1f}')}  kl {get('actor/ref_kl', '{:.4f}')}  "
        f"entropy {get('actor/entropy')}  clip {get('actor/pg_clipfrac')}  | "
        f"rollout {get('timing/rollout_s', '{:.2f}')}s  score {get('timing/score_s', '{:.2f}')}s  "
        f"train {get('timing/actor_train_s', '{:.2f}')}s"
    )


def console(text: str) -> None:
    """Progress to stderr, so stdout stays clean for pipelines."""
    print(text, file=sys.stderr, flush=True)
