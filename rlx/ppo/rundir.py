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
from rlx.observe.tracking import console, read_metrics_tolerant, truncate_metrics
from rlx.parallel.dist import barrier
from rlx.ppo.config import MOVED_KEYS
from rlx.utils.files import describe_io_error, existing_ancestor
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
    lost = steps_recorded(run_dir) if restart and not overwrite else 0
    if lost and not resume:  # steps ran, none saved: never thrown away unasked
        raise UserError(
            f"{run_dir}: holds a run that completed {lost} step(s) but wrote no checkpoint (the first is due at step "
            f"{recipe.get('save_every')}, save_every); --resume or --overwrite starts it again at step 1 (nothing "
            f"can be continued), or choose another --out"
        )
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
            sft = "" if overwrite else warm_start_restart(run_dir, recipe)  # before the folder is cleared
            clear_run(run_dir)
            why = "replacing its run (--overwrite)" if overwrite else "its earlier start completed no step"
            if lost:
                why = f"its earlier start completed {lost} step(s) but wrote no checkpoint: nothing to continue"
            console(f"{run_dir}: {why}; starting at step 1{sft}")
        run_dir.mkdir(parents=True, exist_ok=True)
        write_json(recipe_path, recipe)
        for stale in (run_dir / "checkpoints").glob(".step_*"):  # temporaries of a killed save
            shutil.rmtree(stale, ignore_errors=True)
        truncate_metrics(run_dir / "metrics.jsonl", last)
    barrier()
    if resume and is_main and not restart:
        console(f"resuming {run_dir} after step {last}" if found else f"no checkpoint in {run_dir}; starting at step 1")
    return last, found[1] if found else None


def warm_start_restart(run_dir: Path, recipe: dict) -> str:
    """What starting a run folder again (no RL step checkpointed) does to the recipe's [sft] warm start, to end the
    line that says so: it runs again from its first step, as `rlx sft` saves no checkpoint part-way (its one
    checkpoint, step_000000, is written when it ends); '' without [sft] or when no warm start ran yet."""
    if recipe.get("sft") is None:
        return ""
    if is_checkpoint(checkpoint_dir(run_dir, 0)):
        return "; the [sft] warm start, which had finished, runs again from its first step (its checkpoint goes too)"
    path = run_dir / SFT_METRICS
    done = len(read_metrics_tolerant(path)) if path.is_file() else 0
    if not done:
        return ""
    return (
        f"; the [sft] warm start, stopped after {done} step(s), runs again from its first step (it saves no "
        "checkpoint part-way)"
    )


def steps_recorded(run_dir: Path) -> int:
    """How many steps a run folder's metrics.jsonl records (0 without one)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    return len({m["step"] for m in read_metrics_tolerant(path) if isinstance(m.get("step"), int) and m["step"] > 0})


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


def free_bytes(path: Path) -> int:
    """Free bytes on the file system of `path` (of its nearest existing folder when it does not exist yet)."""
    return shutil.disk_usage(existing_ancestor(path)).free


def checkpoint_bytes(modules) -> int:
    """About the bytes of one checkpoint of these trained modules: every trained parameter's weights and AdamW's two
    moments in its dtype (a DTensor counted whole). A backend that holds only its own shard (megatron) makes it a
    lower bound."""
    total = 0
    for module in modules:
        for param in module.parameters():
            if param.requires_grad:
                total += 3 * param.numel() * param.element_size()
    return total


def checkpoints_on_disk_at_most(existing: int, new: int, keep: int) -> int:
    """The most rotated checkpoints a run folder holds at once while `new` more are written after `existing`: each
    is published before the oldest beyond the newest `keep` are removed (0: all kept)."""
    if new == 0 or keep == 0:
        return existing + new
    return max(existing + 1, min(existing + new, keep + 1))


def check_checkpoint_space(run_dir: Path, each: int, saves: list[int], keep: int) -> str | None:
    """Before the first step: a UserError when the run folder's file system cannot hold one more checkpoint of
    `each` bytes; a warning (returned) when it cannot hold what `saves` (the steps this run checkpoints) and
    `keep` (keep_checkpoints) will put there at once; None when it can. Checkpoints already there count as written."""
    if not saves or each <= 0:
        return None
    free = free_bytes(run_dir)
    existing = sum(1 for p in (run_dir / "checkpoints").glob("step_*") if p != checkpoint_dir(run_dir, 0))
    size = f"about {_size(each)} (the trained weights and AdamW's two moments)"
    if free < each:
        raise UserError(
            f"{run_dir}: a checkpoint of this run takes {size}, and its file system has {_size(free)} free: "
            f"the first one (step {saves[0]}) would fail. Free space there or choose an --out on a larger disk"
        )
    peak = checkpoints_on_disk_at_most(existing, len(saves), keep)
    room = existing + int(free // each)
    if peak <= room:
        return None
    return (
        f"{run_dir}: a checkpoint takes {size}; {_size(free)} free holds {room - existing} more, and this "
        f"run keeps up to {peak} at once (keep_checkpoints = {keep}): the checkpoint of step {saves[room - existing]} "
        "would fail. Lower keep_checkpoints, raise save_every or free space"
    )


def checkpoint_write_error(out: Path, each: int, error: Exception) -> UserError | None:
    """A failed checkpoint write as the user needs it: a full disk or a forbidden folder (describe_io_error) names
    the checkpoint, the free space and the checkpoint's size; None for any other error (raised as it is)."""
    reason = describe_io_error(error)
    if reason is None:
        return None
    free = free_bytes(out)
    return UserError(
        f"{out}: the checkpoint was not written ({reason}); {_size(free)} free on its file system, a checkpoint of "
        f"this run takes about {_size(each)}. Resume with --resume once there is room: the run goes on "
        "from its last complete checkpoint"
    )


def _size(n: float) -> str:
    """Bytes as a person reads them: 91.2 GB, 3.4 MB, 512 B."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"
