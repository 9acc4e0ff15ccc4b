"""`rlx report`: plots and a Markdown summary of a run dir, also while the run is still going.

Reads RUN_DIR/metrics.jsonl (a cut last line is skipped; lines of one step are merged) and
RUN_DIR/recipe.json (for the planned number of steps), and writes into RUN_DIR/report/:
one PNG per metric group present (PLOTS) and summary.md. Every file is written atomically.
matplotlib (the `report` extra) is imported inside `write_report`, with the non-interactive Agg renderer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from rlx.errors import UserError
from rlx.observe.tracking import METRICS_FILE, metrics_by_step
from rlx.utils.files import check_writable
from rlx.utils.io import atomic_path, read_jsonl

REPORT_DIR = "report"
SUMMARY_NAME = "summary.md"
WINDOW = 5


@dataclass(frozen=True)
class PlotSpec:
    """One PNG: the metrics drawn as lines against the step, and an optional ± band."""

    name: str
    """File stem: report/<name>.png."""
    title: str
    """Plot title."""
    keys: tuple[str, ...]
    """Metrics drawn as lines (absent ones are left out; no key present = no plot)."""
    ylabel: str
    """The y axis's label (what the values are, in which unit)."""
    band: tuple[str, str] | None = None
    """(mean, std): shade mean ± std."""
    band_limits: tuple[str, str] | None = None
    """(min, max) metrics: the band is clipped to them at each step where present (a bounded reward's band then
    stays within its bounds, e.g. [0, 1], instead of drawing values no sample had)."""


PLOTS = (
    PlotSpec(
        "reward", "reward (mean ± std)", ("reward/mean",), ylabel="reward per sample",
        band=("reward/mean", "reward/std"), band_limits=("reward/min", "reward/max"),
    ),
    PlotSpec(
        "response_length", "response length (tokens)", ("response_length/mean", "response_length/max"),
        ylabel="tokens per response",
    ),
    PlotSpec("kl", "KL to the reference (actor/ref_kl)", ("actor/ref_kl",), ylabel="KL (nats per token)"),
    PlotSpec("entropy", "policy entropy (actor/entropy)", ("actor/entropy",), ylabel="entropy (nats per token)"),
    PlotSpec(
        "clip_frac", "clipped fraction (actor/pg_clipfrac)", ("actor/pg_clipfrac",), ylabel="fraction of tokens"
    ),
    PlotSpec("mfu", "model FLOPs utilisation (perf/mfu)", ("perf/mfu",), ylabel="fraction of peak FLOPs"),
    PlotSpec("turns", "assistant turns per sample (multi-turn)", ("rollout/turns_mean",), ylabel="turns per sample"),
    PlotSpec(
        "env_reward", "environment reward (multi-turn, env/reward_mean)", ("env/reward_mean",),
        ylabel="environment reward per sample",
    ),
    PlotSpec(
        "val", "held-out evaluation ([eval]: val/*)", ("val/pass@1", "val/reward_mean"),
        ylabel="pass@1 / reward per prompt",
    ),
)  # fmt: skip
MULTI_TURN = (("rollout/turns_mean", "turns per sample"), ("env/reward_mean", "environment reward"))
"""Multi-turn metrics the summary shows as first -> last window, when the run has them."""


@dataclass(kw_only=True)
class RunReport:
    """What `write_report` found and wrote."""

    report_dir: Path
    """RUN_DIR/report."""
    steps_done: int
    """Steps with a metrics line (the highest step number)."""
    total_steps: int | None
    """recipe.json's steps; None without a recipe.json."""
    is_finished: bool | None
    """steps_done >= total_steps; None when unknown."""
    plots: list[Path] = field(default_factory=list)
    """The PNGs written, in PLOTS order."""
    summary: Path | None = None
    """report/summary.md."""


def series(steps: dict[int, dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of a metric, over the steps where it is a number."""
    points = [(s, float(m[key])) for s, m in steps.items() if _is_number(m.get(key))]
    return [s for s, _ in points], [v for _, v in points]


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def load_run(run_dir: Path) -> tuple[dict[int, dict], int | None]:
    """(metrics by step, planned steps from recipe.json or None); UserErrors for a missing run or metrics."""
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such run folder")
    metrics_path = run_dir / METRICS_FILE
    if not metrics_path.is_file():
        raise UserError(f"{metrics_path}: no such file (is {run_dir} an `rlx ppo` run folder?)")
    steps = metrics_by_step(_read_metrics(metrics_path))
    if not steps:
        raise UserError(f"{metrics_path}: no complete metrics line yet")
    total = None
    recipe = run_dir / "recipe.json"
    if recipe.is_file():
        try:
            value = json.loads(recipe.read_text(encoding="utf-8")).get("steps")
        except (json.JSONDecodeError, AttributeError):
            raise UserError(f"{recipe}: not a JSON object") from None
        total = value if isinstance(value, int) and not isinstance(value, bool) else None
    return steps, total


def _read_metrics(path: Path) -> list[dict]:
    """A metrics file's lines: the last may be cut short by a run still writing (skipped); any other line that is
    not a JSON object with an integer 'step' is a UserError naming it."""
    out = []
    for number, obj in read_jsonl(path, cut_end=True):
        step = obj.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            raise UserError(f"{path}:{number}: expected a metrics object with an integer 'step', got {step!r:.40}")
        out.append(obj)
    return out


def draw_plot(plt, spec: PlotSpec, steps: dict[int, dict], path: Path) -> bool:
    """Draw one metric group to `path` (PNG, atomically); False (nothing written) when no key is present."""
    fig = build_figure(plt, spec, steps)
    if fig is None:
        return False
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png")
    finally:
        plt.close(fig)
    return True


def build_figure(plt, spec: PlotSpec, steps: dict[int, dict]):
    """The matplotlib figure of one metric group (the caller closes it); None when no key is present."""
    lines = [(key, *series(steps, key)) for key in spec.keys]
    lines = [(key, xs, ys) for key, xs, ys in lines if xs]
    if not lines:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    for key, xs, ys in lines:
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=key)
    if spec.band is not None:
        xs, lower, upper = band(steps, *spec.band, limits=spec.band_limits)
        if xs:
            ax.fill_between(xs, lower, upper, alpha=0.2, label=f"± {spec.band[1]}")
    ax.set_title(spec.title)
    ax.set_xlabel("step")
    ax.set_ylabel(spec.ylabel)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    return fig


def band(
    steps: dict[int, dict], mean_key: str, std_key: str, limits: tuple[str, str] | None = None
) -> tuple[list[int], list[float], list[float]]:
    """(steps, lower, upper) of mean ± std, each clipped to the step's `limits` metrics (min, max) where present."""
    xs, lower, upper = [], [], []
    for step, m in steps.items():
        mean, std = m.get(mean_key), m.get(std_key)
        if not (_is_number(mean) and _is_number(std)):
            continue
        low, high = mean - std, mean + std
        if limits is not None and _is_number(m.get(limits[0])):
            low = max(low, m[limits[0]])
        if limits is not None and _is_number(m.get(limits[1])):
            high = min(high, m[limits[1]])
        xs.append(step)
        lower.append(low)
        upper.append(high)
    return xs, lower, upper


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def summary_markdown(run_dir: Path, steps: dict[int, dict], total: int | None, plots: list[Path]) -> str:
    """The text of summary.md: progress, reward first/last window, best step, step time, plot links."""
    done = max(steps)
    if total is None:
        status = "unknown (no recipe.json)"
    elif done >= total:
        status = f"finished ({done} of {total} steps)"
    else:
        status = f"not finished: {done} of {total} steps (still running, or stopped; `rlx ppo --resume` continues it)"
    lines = [f"# Run report: {run_dir.resolve().name}", "", f"- run folder: `{run_dir}`", f"- status: {status}"]
    lines.append(f"- steps done: {done}" + (f" of {total}" if total is not None else ""))
    xs, rewards = series(steps, "reward/mean")
    if rewards:
        window = min(WINDOW, len(rewards))
        lines.append(
            f"- reward/mean: {_mean(rewards[:window]):.4f} (first {window} steps) -> "
            f"{_mean(rewards[-window:]):.4f} (last {window} steps)"
        )
        best = max(range(len(rewards)), key=lambda i: rewards[i])  # the first of equal bests
        lines.append(f"- best reward/mean: {rewards[best]:.4f} at step {xs[best]}")
    for key, label in MULTI_TURN:
        _, values = series(steps, key)
        if values:
            window = min(WINDOW, len(values))
            lines.append(f"- {label} ({key}): {_mean(values[:window]):.4f} -> {_mean(values[-window:]):.4f}")
    val_steps, accuracy = series(steps, "val/pass@1")
    if accuracy:
        best = max(range(len(accuracy)), key=lambda i: accuracy[i])
        lines.append(
            f"- held-out val/pass@1: {accuracy[0]:.4f} (step {val_steps[0]}) -> {accuracy[-1]:.4f} "
            f"(step {val_steps[-1]}); best {accuracy[best]:.4f} at step {val_steps[best]}"
        )
    _, times = series(steps, "timing/step_s")
    if times:
        lines.append(f"- mean step time: {_mean(times):.3f} s over {len(times)} steps")
    if plots:
        lines += ["", "## Plots", ""]
        lines += [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"


def write_report(run_dir: str | Path, overwrite: bool = False) -> RunReport:
    """Write RUN_DIR/report/*.png and summary.md; returns what was written (see RunReport). An earlier report is
    replaced only with `overwrite`."""
    run_dir = Path(run_dir)
    steps, total = load_run(run_dir)
    if (run_dir / REPORT_DIR / SUMMARY_NAME).exists() and not overwrite:
        raise UserError(f"{run_dir / REPORT_DIR}: already holds a report (pass --overwrite to replace it)")
    check_writable(run_dir / REPORT_DIR / SUMMARY_NAME, "report")
    try:
        import matplotlib
    except ImportError:
        raise UserError("rlx report needs matplotlib: pip install matplotlib (or pip install 'rlx[report]')") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    out = run_dir / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    plots = [out / f"{spec.name}.png" for spec in PLOTS if draw_plot(plt, spec, steps, out / f"{spec.name}.png")]
    summary = out / SUMMARY_NAME
    with atomic_path(summary) as tmp:
        tmp.write_text(summary_markdown(run_dir, steps, total, plots), encoding="utf-8")
    done = max(steps)
    return RunReport(
        report_dir=out,
        steps_done=done,
        total_steps=total,
        is_finished=None if total is None else done >= total,
        plots=plots,
        summary=summary,
    )
