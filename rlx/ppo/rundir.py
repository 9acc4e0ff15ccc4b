"""A PPO run's directory: step and checkpoint paths, the recipe check on resume, and checkpoint rotation.

RUN_DIR/recipe.json, metrics.jsonl, step_NNNNNN/, checkpoints/step_NNNNNN/ (see rlx/ppo/loop.py)
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from rlx.checkpoints.files import is_weight_file
from rlx.checkpoints.meta import CheckpointMeta, is_checkpoint
from rlx.config import ConfigError, move_keys
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


def clear_run(run_dir: Path, keep_warm_start: bool = False) -> None:
    """Remove what `rlx ppo` and `rlx report` wrote in a run folder; other files in it stay. `keep_warm_start`: a
    finished [sft] warm start (checkpoints/step_000000 and sft_metrics.jsonl) stays too."""
    kept = {checkpoint_dir(run_dir, 0), run_dir / SFT_METRICS} if keep_warm_start else set()
    for name in RUN_FILES:
        if run_dir / name not in kept:
            (run_dir / name).unlink(missing_ok=True)
    for path in [*(run_dir / name for name in RUN_FOLDERS), *run_dir.glob("step_*")]:
        if path.is_dir() and path == run_dir / "checkpoints" and kept:
            for inner in path.iterdir():
                if inner in kept:
                    continue
                if inner.is_dir():
                    shutil.rmtree(inner)
                else:
                    inner.unlink()
        elif path.is_dir():
            shutil.rmtree(path)


@dataclass(frozen=True)
class RunStart:
    """Where a run folder's run starts (prepare_run_dir)."""

    step: int
    """The last completed step (0: the run starts at step 1)."""
    checkpoint: Path | None
    """That step's checkpoint (None at step 0)."""
    warm_start_kept: bool = False
    """Whether the finished [sft] warm start of an earlier start (checkpoints/step_000000) is reused, not run again."""


def prepare_run_dir(
    run_dir: Path, recipe: dict, resume: bool, is_main: bool, overwrite: bool = False, warm_start: dict | None = None
) -> RunStart:
    """Check the run dir against the recipe (every rank), write it and clear a killed save's leftovers (rank 0).
    A folder whose run completed no step (no checkpoint: its start failed) is started again, as is any run with
    `overwrite`; with `resume`, such a restart keeps a finished [sft] warm start whose inputs are unchanged
    (`warm_start`: what warm_start.warm_start_record gives for this run)."""
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
        _check_same_recipe(run_dir, recipe)
    kept, sft = False, ""
    if restart and not overwrite:  # read by every rank before rank 0 clears the folder
        kept, sft = warm_start_restart(run_dir, recipe, resume, warm_start)
    if restart:
        found = None
    last = found[0] if found else 0
    barrier()  # every rank has read the run dir before rank 0 changes it
    if is_main:
        if restart:
            clear_run(run_dir, keep_warm_start=kept)
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
    return RunStart(last, found[1] if found else None, kept)


def _saved_recipe(run_dir: Path, recipe: dict) -> dict:
    """The run folder's recipe.json as this rlx reads it: old keys moved to their sections, optional tables it
    predates added as unused."""
    saved = json.loads((run_dir / RECIPE_NAME).read_text())
    move_keys(saved, MOVED_KEYS)  # a run started before the config sections ([train.optim], ...)
    _add_unused_new_tables(saved, recipe)
    return saved


def _check_same_recipe(run_dir: Path, recipe: dict) -> None:
    """A resumed run's recipe is the one it ran with, but for `steps` (it may be extended) and `tracking`."""
    saved = _saved_recipe(run_dir, recipe)
    saved["steps"] = recipe["steps"]  # a resumed run may be extended
    saved["tracking"] = recipe["tracking"]  # and logged elsewhere
    if saved != recipe:
        key = _first_difference(saved, recipe)
        raise UserError(
            f"{run_dir}: the recipe differs from the run's at '{key}'; resume with the same recipe or start a new --out"
        )


def warm_start_restart(run_dir: Path, recipe: dict, resume: bool, record: dict | None) -> tuple[bool, str]:
    """What starting a run folder again (no RL step checkpointed) does to the recipe's [sft] warm start: whether its
    finished result (checkpoints/step_000000) is kept, and the words that end the line saying so. With `resume` a
    finished warm start is kept when nothing it depends on changed (`record`: warm_start_record of this run), else it
    runs again, as one stopped part-way does (`rlx sft` saves no checkpoint part-way); '' without [sft] or when no
    warm start ran yet."""
    if recipe.get("sft") is None:
        return False, ""
    step0 = checkpoint_dir(run_dir, 0)
    if is_checkpoint(step0):
        if not resume:
            return False, (
                "; the [sft] warm start, which had finished, runs again from its first step (its checkpoint goes too; "
                "--resume keeps it when nothing it depends on changed)"
            )
        change = warm_start_change(run_dir, recipe, record)
        if change is None:
            return True, f"; its finished [sft] warm start is reused ({step0}: {_WARM_START_INPUTS} unchanged)"
        return False, f"; the [sft] warm start, which had finished, runs again from its first step: {change}"
    path = run_dir / SFT_METRICS
    done = len(read_metrics_tolerant(path)) if path.is_file() else 0
    if not done:
        return False, ""
    return False, (
        f"; the [sft] warm start, stopped after {done} step(s), runs again from its first step (it saves no "
        "checkpoint part-way)"
    )


_WARM_START_INPUTS = "its [sft] table, model and its files, seed, demonstrations, chat template variables and device"


def warm_start_change(run_dir: Path, recipe: dict, record: dict | None) -> str | None:
    """What changed, of what a run folder's finished warm start depends on, between it and `recipe` (None: nothing):
    the recipe keys (recipe.json against `recipe`), then what its checkpoint's rlx.json records beyond them (the
    demonstrations' sha256, the device type and the model's files: `record`, warm_start.warm_start_record, holds this
    run's)."""
    try:
        saved = _saved_recipe(run_dir, recipe)
    except (OSError, ValueError, ConfigError) as e:
        return f"its {RECIPE_NAME} cannot be read ({e})"
    before, now = _warm_start_keys(saved), _warm_start_keys(recipe)
    if before != now:
        old, new = _leaves(before), _leaves(now)
        changed = sorted(key for key in old.keys() | new.keys() if old.get(key) != new.get(key))
        if not changed:  # an empty table against none
            return f"{_first_difference(before, now)} changed"
        return f"{changed[0]} changed ({old.get(changed[0])!r} -> {new.get(changed[0])!r})"
    try:
        recorded = CheckpointMeta.read(checkpoint_dir(run_dir, 0)).provenance
    except UserError as e:
        return f"its checkpoint's metadata cannot be read ({e})"
    current = record or {}
    if recorded.get("data_sha256") is None or recorded.get("device") is None:
        return "its checkpoint does not record the demonstrations and device it trained on (written by an older rlx)"
    if recorded["data_sha256"] != current.get("data_sha256"):
        return f"the demonstrations in {recipe['sft'].get('data')} changed (their sha256 is not the checkpoint's)"
    if recorded["device"] != current.get("device"):
        return f"the device changed ({recorded['device']} -> {current.get('device')})"
    if recorded.get("model_files") is None:
        return "its checkpoint predates the check of the model's files (written by an older rlx): they may have changed"
    return _model_files_change(recorded["model_files"], current.get("model_files") or {})


def _model_files_change(before: dict, now: dict) -> str | None:
    """Which of the model's files changed between two warm_start.model_files records ({path: [size, mtime_ns]}), in
    words: the weights (a weight file, or any file in a sub-folder: a checkpoint's shards) or its other files (config,
    tokenizer); None when none did."""
    for name in sorted(before.keys() | now.keys()):
        if before.get(name) == now.get(name):
            continue
        what = "weights" if "/" in name or is_weight_file(name) else "files"
        how = "appeared" if name not in before else "was removed" if name not in now else "was rewritten"
        return f"the model's {what} changed ({name} {how} since the warm start, by its size and modification time)"
    return None


def _warm_start_keys(recipe: dict) -> dict:
    """The recipe keys a warm start's weights depend on (rlx/ppo/warm_start.py): [sft], [model], the seed, the device it
    trains on and, when [sft] gives none, the chat template variables of [rollout.agent] it renders with."""
    sft = recipe.get("sft") or {}
    keys = {
        "sft": sft,
        "model": recipe.get("model"),
        "seed": recipe.get("seed"),
        "train.device": (recipe.get("train") or {}).get("device"),
    }
    if not sft.get("chat_template_kwargs"):
        agent = (recipe.get("rollout") or {}).get("agent") or {}
        keys["rollout.agent.chat_template_kwargs"] = agent.get("chat_template_kwargs")
    return keys


def _leaves(tree: dict, prefix: str = "") -> dict:
    """A nested dict's values by dotted key ({"sft": {"optim": {"lr": 1}}} -> {"sft.optim.lr": 1}; an empty table
    gives none)."""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict):
            out.update(_leaves(value, name))
        else:
            out[name] = value
    return out


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


def check_space_before_loading(run_dir: Path, config, saves: list[int], keep: int) -> None:
    """check_checkpoint_space's refusal before the models are built, on the policy's size as its config gives it
    (the memory plan's parameter count; float32 weights and AdamW's two moments, 12 bytes a parameter; counted 2%
    low, and a critic not at all, so that it refuses no run the built models' count lets through): a run that cannot
    write its first checkpoint stops before loading (7B resumed on two H200: 30-60 s of loading before the check on
    the built models refused it). A config the plan cannot size is left to that later check, which also warns. Not
    for a LoRA policy (its adapters are small)."""
    from rlx.ppo.plan import CHECKPOINT_BYTES_PER_PARAM, model_shape

    try:
        params = model_shape(config.to_dict() if hasattr(config, "to_dict") else dict(config)).params
    except (KeyError, TypeError, ValueError, AttributeError):
        return
    check_checkpoint_space(run_dir, int(0.98 * CHECKPOINT_BYTES_PER_PARAM * params), saves, keep)


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
