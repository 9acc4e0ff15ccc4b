"""Metrics: one JSON line per step in metrics.jsonl, a one-line console summary, and experiment trackers.

Metric names are namespaced (`reward/mean`, `actor/pg_clipfrac`, `timing/rollout_s`, `perf/mfu`) and
are the same in every tracker. Non-finite values are written as null (JSON has no NaN).

`Tracker` is what a run logs through: metrics.jsonl always, plus the trackers of `TrackingConfig`
(console, tensorboard, wandb, mlflow; see rlx.observe.sinks), and rollout traces
(a few samples per step) to RUN_DIR/traces.jsonl and the table-capable trackers. This module
imports no torch and no tracker library.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from rlx.config import check
from rlx.utils.io import append_jsonl, read_jsonl, write_jsonl

# metrics that measure the machine or the process, not the run: they differ between otherwise identical runs
# (compile/*: graphs built in this process, so 0 where an earlier run in it compiled them already)
VOLATILE_PREFIXES = ("timing/", "perf/", "memory/", "compile/")


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


def read_metrics_tolerant(path: str | Path) -> list[dict]:
    """Metrics lines of a file that may be being written (a run in progress): unparsable lines skipped."""
    return [obj for _, obj in _read_tolerant(Path(path))]


def metrics_by_step(lines: list[dict]) -> dict[int, dict]:
    """Lines merged per integer `step`, in step order (a shell pipeline writes one line per stage)."""
    merged: dict[int, dict] = {}
    for line in lines:
        if isinstance(line.get("step"), int) and not isinstance(line["step"], bool):
            merged.setdefault(line["step"], {}).update(line)
    return dict(sorted(merged.items()))


def step_line(step: int, total: int, m: dict) -> str:
    """A one-line console summary of a step."""

    def get(key, fmt="{:.3f}"):
        value = m.get(key)
        if not isinstance(value, (int, float)):
            return "-"
        text = fmt.format(value)
        return text[1:] if text.startswith("-") and float(text) == 0 else text  # -0.0000 reads as 0.0000

    errors = m.get("reward/num_errors")
    extra = f"  REWARD ERRORS {errors:.0f}" if isinstance(errors, (int, float)) and errors > 0 else ""
    if isinstance(m.get("val/pass@1"), (int, float)):
        extra += f"  val pass@1 {get('val/pass@1')}"
    if "reward/mean" not in m:  # an evaluation-only line (step 0 with [eval] before_training)
        return f"step {step}/{total}{extra}"
    return (
        f"step {step}/{total}  reward {get('reward/mean')} ±{get('reward/std')}{extra}  "
        f"len {get('response_length/mean', '{:.1f}')}  kl {get('actor/ref_kl', '{:.4f}')}  "
        f"entropy {get('actor/entropy')}  clip {get('actor/pg_clipfrac')}  | "
        f"rollout {get('timing/rollout_s', '{:.2f}')}s  score {get('timing/score_s', '{:.2f}')}s  "
        f"train {get('timing/actor_train_s', '{:.2f}')}s"
    )


def reward_summary(rewards: list[float]) -> str:
    """A run's mean reward: its first steps against its last (up to 5 each, never overlapping), or its only one."""
    window = min(5, len(rewards) // 2)
    if not window:
        return f"reward {rewards[0]:.3f} (1 step)" if rewards else "no reward recorded"
    first, last = sum(rewards[:window]) / window, sum(rewards[-window:]) / window
    steps = "step" if window == 1 else f"{window} steps"
    return f"reward {first:.3f} (first {steps}) -> {last:.3f} (last {steps})"


def console(text: str) -> None:
    """Progress to stderr, so stdout stays clean for pipelines."""
    print(text, file=sys.stderr, flush=True)


HEARTBEAT_S = (30.0, 60.0)
"""A long block's first 'still running' line after 30 s, then one a minute (a 14B run's first step on one GPU:
~50 s building the model, ~100 s compiling the train step, with no other line)."""


@contextlib.contextmanager
def heartbeat(label: str | None, first_s: float | None = None, every_s: float | None = None) -> Iterator[None]:
    """Say '<label>: still running (N s)' on the console while the block runs past `first_s`, then every `every_s`
    (HEARTBEAT_S by default); nothing for a block that ends sooner, or with no label (e.g. not the main rank)."""
    if label is None:
        yield
        return
    first_s, every_s = first_s or HEARTBEAT_S[0], every_s or HEARTBEAT_S[1]
    done, start = threading.Event(), time.perf_counter()

    def beat() -> None:
        wait = first_s
        while not done.wait(wait):
            console(f"{label}: still running ({time.perf_counter() - start:.0f} s)")
            wait = every_s

    thread = threading.Thread(target=beat, name="rlx-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


# ---------------------------------------------------------------------------------------------------
# experiment tracking

TRACKERS = ("console", "tensorboard", "wandb", "mlflow")
"""What `tracking.backends` may list (the recipe key keeps its name; these are trackers, not training backends)."""
METRICS_FILE = "metrics.jsonl"
TRACES_FILE = "traces.jsonl"


@dataclass(kw_only=True)
class TrackingConfig:
    """Where a run's metrics go besides metrics.jsonl (always written), and how many rollout traces per step."""

    backends: list[str] = field(default_factory=lambda: ["console"])
    """Any of console (a line per step on stderr), tensorboard (RUN_DIR/tensorboard), wandb (offline run in
    RUN_DIR/wandb), mlflow (file store in RUN_DIR/mlflow); metrics.jsonl is always written."""
    project: str = "rlx"
    """W&B project / MLflow experiment name."""
    run_name: str | None = None
    """Run name in W&B and MLflow; unset = the run dir's name."""
    traces_per_step: int = 8
    """Rollout samples (prompt, response, reward, advantage) logged per step to traces.jsonl and the
    tensorboard/wandb tables; 0 = off."""

    def __post_init__(self) -> None:
        check(
            "jsonl" not in self.backends and "metrics.jsonl" not in self.backends,
            "backends",
            f"metrics.jsonl is always written; list only the extra trackers (valid trackers: {', '.join(TRACKERS)})",
        )
        for name in self.backends:
            check(name in TRACKERS, "backends", f"unknown tracker {name!r} (valid trackers: {', '.join(TRACKERS)})")
        repeated = sorted({b for b in self.backends if self.backends.count(b) > 1})
        check(not repeated, "backends", f"{', '.join(repeated)} listed twice")
        check(bool(self.project.strip()), "project", "must not be empty")
        check(self.run_name is None or bool(self.run_name.strip()), "run_name", "must not be empty when set")
        check(self.traces_per_step >= 0, "traces_per_step", f"must be >= 0, got {self.traces_per_step}")


class ConsoleSink:
    """The one-line step summary on stderr (`step_line`)."""

    def __init__(self, total_steps: int):
        self.total_steps = total_steps

    def log(self, step: int, metrics: dict) -> None:
        console(step_line(step, self.total_steps, metrics))

    def log_traces(self, step: int, rows: list[dict]) -> None:
        pass

    def close(self) -> None:
        pass


def build_sink(name: str, run_dir: Path, config: dict, cfg: TrackingConfig, total_steps: int, start_step: int):
    """One tracker's sink by name (the heavy library is imported here, with a pip hint when missing)."""
    from rlx.observe import sinks as tb

    run_name = cfg.run_name or run_dir.resolve().name
    if name == "console":
        return ConsoleSink(total_steps)
    if name == "tensorboard":
        return tb.TensorBoardSink(run_dir, config, start_step)
    if name == "wandb":
        return tb.WandbSink(run_dir, config, cfg.project, run_name)
    if name == "mlflow":
        return tb.MlflowSink(run_dir, config, cfg.project, run_name)
    raise ValueError(f"unknown tracker {name!r}")


def numeric(metrics: dict) -> dict[str, float]:
    """The finite numbers of a metrics dict (what the trackers accept), keys sorted."""
    return {k: v for k, v in clean(metrics).items() if isinstance(v, float)}


class Tracker:
    """A run's metrics sink: metrics.jsonl always, plus the configured trackers and rollout traces.

    Tracker(cfg, run_dir, config, total_steps=None, start_step=0)
      cfg          TrackingConfig
      run_dir      the run folder; metrics.jsonl, traces.jsonl and the trackers' folders go in it
      config       the resolved recipe as a plain dict (to_dict(PPOConfig)): W&B config, MLflow params,
                   TensorBoard text
      total_steps  for the console line `step k/N`; default config["steps"]
      start_step   last completed step when resuming: traces.jsonl rows after it are dropped and
                   TensorBoard purges later events (metrics.jsonl is truncated by the loop)
    Trackers are opened here, so a missing package fails before any work (UserError with a pip hint).
    Use as a context manager or call close().
    """

    def __init__(
        self,
        cfg: TrackingConfig,
        run_dir: Path,
        config: dict,
        *,
        total_steps: int | None = None,
        start_step: int = 0,
    ):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        total = total_steps if total_steps is not None else int(config.get("steps") or 0)
        if start_step:
            truncate_traces(self.run_dir / TRACES_FILE, start_step)
        self.sinks: list = []
        try:
            for name in cfg.backends:
                self.sinks.append(build_sink(name, self.run_dir, config, cfg, total, start_step))
        except BaseException:
            self.close()
            raise

    def log(self, step: int, metrics: dict) -> None:
        """Append {"step", **metrics} to metrics.jsonl, then send the finite numbers to every tracker
        (the console tracker prints the step line from the full dict)."""
        log_metrics(self.run_dir / METRICS_FILE, step, metrics)
        values = numeric(metrics)
        for sink in self.sinks:
            sink.log(step, metrics if isinstance(sink, ConsoleSink) else values)

    def log_traces(self, step: int, rows: list[dict]) -> None:
        """Append rows (id, prompt, response, reward, advantage; `step` is added) to traces.jsonl, and
        log them as a table to tensorboard (Markdown text, tag `traces`) and wandb (wandb.Table, key
        `traces`). No-op when traces_per_step is 0 or rows is empty."""
        if not self.cfg.traces_per_step or not rows:
            return
        rows = [{"step": step, **{k: v for k, v in row.items() if k != "step"}} for row in rows]
        for row in rows:
            append_jsonl(self.run_dir / TRACES_FILE, clean_row(row))
        for sink in self.sinks:
            sink.log_traces(step, rows)

    def close(self) -> None:
        """Flush and finish every tracker (idempotent)."""
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def clean_row(row: dict) -> dict:
    """A trace row with non-finite numbers as null (JSON has no NaN), key order kept."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}


def truncate_traces(path: Path, last_step: int) -> None:
    """Drop traces.jsonl rows past `last_step` (resume after a crash); unparsable lines go too."""
    if path.is_file():
        write_jsonl(path, [obj for _, obj in _read_tolerant(path) if _step_at_most(obj, last_step)])


def _step_at_most(obj: dict, last_step: int) -> bool:
    return isinstance(obj.get("step"), int) and obj["step"] <= last_step


def select_traces(rollouts: list, scores: list, k: int, seed: int) -> list[dict]:
    """Pick up to `k` samples of a step for the trace table, deterministically from `seed`.

    rollouts: records with .id, .prompt, .response (RolloutRecord); scores: records with .id, .reward,
    .advantage (ScoreRecord), matched to rollouts by id (rollouts without a score, and ReMax greedy
    baselines, are skipped). The k rows are a seeded random sample (random.Random(seed)), returned in
    rollout order; pass e.g. seed = run seed + step for a different sample each step.
    Returns [{"id", "prompt", "response", "reward", "advantage"}, ...] (Tracker.log_traces adds "step").
    """
    if k <= 0:
        return []
    by_id = {s.id: s for s in scores}
    candidates = [(r, by_id[r.id]) for r in rollouts if r.id in by_id and not getattr(r, "is_greedy_baseline", False)]
    chosen = sorted(random.Random(seed).sample(range(len(candidates)), min(k, len(candidates))))
    return [
        {
            "id": r.id,
            "prompt": r.prompt,
            "response": r.response,
            "reward": float(s.reward),
            "advantage": float(s.advantage),
        }
        for r, s in (candidates[i] for i in chosen)
    ]
