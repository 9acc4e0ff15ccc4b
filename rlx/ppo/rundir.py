"""A PPO run's directory: step and checkpoint paths, the recipe check on resume, and checkpoint rotation.

RUN_DIR/recipe.json, metrics.jsonl, step_NNNNNN/, checkpoints/step_NNNNNN/ (see rlx/ppo/loop.py)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from rlx.checkpoints.meta import is_checkpoint
from rlx.config import move_keys
from rlx.errors import UserError
from rlx.observe.tracking import console, truncate_metrics
from rlx.parallel.dist import barrier
from rlx.ppo.config import MOVED_KEYS
from rlx.utils.io import write_json

RECIPE_NAME = "recipe.json"


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / f"step_{step:06d}"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def last_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint of a run (complete = renamed into place with its rlx.json) after step 0 (the
    step-0 checkpoint of an [sft] warm start completes no step)."""
    found = []
    for path in (run_dir / "checkpoints").glob("step_*"):
        if path.is_dir() and is_checkpoint(path) and path.name[5:].isdigit() and int(path.name[5:]) > 0:
            found.append((int(path.name[5:]), path))
    return max(found) if found else None


SFT_METRICS = "sft_metrics.jsonl"
"""The metrics of an [sft] warm start, a line per optimizer step (rlx/ppo/warm_start.py)."""
RUN_FILES = (RECIPE_NAME, "metrics.jsonl", "traces.jsonl", SFT_METRICS)
RUN_FOLDERS = ("checkpoints", "report", "tensorboard", "wandb", "mlflow")


def clear_run(run_dir: Path) -> None:
    """Remove what `rlx ppo` and `rlx report` wrote in a run folder; other files in it stay."""
    for name in RUN_FILES:
        (run_dir / name).unlink(missing_ok=True)
    for path in [*(run_dir / name for name in RUN_FOLDERS), *run_dir.glob("step_*")]:
        if path.is_dir():
            shutil.rmtree(path)


def prepare_run_dir(
    run_dir: Path, recipe: dict, resume: bool, is_main: bool, overwrite: bool = False
) -> tuple[int, Path | None]:
    """Check the run dir against the recipe (every rank), write it and clear a killed save's leftovers (rank 0);
    return (last completed step, its checkpoint). A folder whose run completed no step (no checkpoint: its start
    failed) is started again, as is any run with `overwrite`."""
    recipe_path = run_dir / RECIPE_NAME
    found = last_checkpoint(run_dir) if recipe_path.exists() else None
    restart = recipe_path.exists() and (overwrite or found is None)
    if recipe_path.exists() and not restart and not resume:
        raise UserError(
            f"{run_dir}: already holds a run (last checkpoint: step {found[0]}); pass --resume to continue it, "
            f"--overwrite to replace it, or choose another --out"
        )
    if recipe_path.exists() and not restart:
        saved = json.loads(recipe_path.read_text())
        move_keys(saved, MOVED_KEYS)  # a run started before the config sections ([train.optim], ...)
        saved["steps"] = recipe["steps"]  # a resumed run may be extended
        saved["tracking"] = recipe["tracking"]  # and logged elsewhere
        _add_unused_new_tables(saved, recipe)
        if saved != recipe:
            key = _first_difference(saved, recipe)
            raise UserError(
                f"{run_dir}: the recipe differs from the run's at '{key}'; "
                "resume with the same recipe or start a new --out"
            )
    if restart:
        found = None
    last = found[0] if found else 0
    barrier()  # every rank has read the run dir before rank 0 changes it
    if is_main:
        if restart:
            clear_run(run_dir)
            why = "replacing its run (--overwrite)" if overwrite else "its earlier start completed no step"
            console(f"{run_dir}: {why}; starting at step 1")
        run_dir.mkdir(parents=True, exist_ok=True)
        write_json(recipe_path, recipe)
        for stale in (run_dir / "checkpoints").glob(".step_*"):  # temporaries of a killed save
            shutil.rmtree(stale, ignore_errors=True)
        truncate_metrics(run_dir / "metrics.jsonl", last)
    barrier()
    if resume and is_main and not restart:
        console(f"resuming {run_dir} after step {last}" if found else f"no checkpoint in {run_dir}; starting at step 1")
    return last, found[1] if found else None


def drop_old_checkpoints(run_dir: Path, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints (0: all) and an [sft] warm start's step 0 (the reference of a
    resumed run); the main process calls it after publishing one."""
    if keep:
        rotated = [p for p in sorted((run_dir / "checkpoints").glob("step_*")) if p != checkpoint_dir(run_dir, 0)]
        for path in rotated[:-keep]:
            shutil.rmtree(path, ignore_errors=True)


def _first_difference(a, b, prefix: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                return _first_difference(a.get(key), b.get(key), f"{prefix}.{key}" if prefix else key)
    return prefix or "<root>"


def _add_unused_new_tables(saved: dict, recipe: dict) -> None:
    """A run written before an optional table existed (e.g. [sft], [async]) has no key for it: when the recipe
    does not use that table (None), the saved run did not either."""
    for key, value in recipe.items():
        if key not in saved and value is None:
            saved[key] = None
        elif isinstance(value, dict) and isinstance(saved.get(key), dict):
            _add_unused_new_tables(saved[key], value)
