"""`rlx ppo`: the whole loop from a recipe, models resident in one process."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rlx.commands._common import reporting
from rlx.errors import UserError

_PLAN_HELP = (
    "Print the memory plan (per-rank peak of each phase, the settings chosen for unset keys) for the hardware of "
    "--gpus and --gpu-memory-gib and exit, without loading weights or touching a GPU: exit 0 when the run fits, 1 "
    "naming what would fit when nothing does. Reads only the model's config.json."
)

_HOST_HELP = (
    "With --plan: GiB of memory per host (machine), for the ranks it holds ($LOCAL_WORLD_SIZE, else all --gpus); "
    "default this machine's when planning for its own GPUs, else not checked."
)


def ppo(
    recipe: Annotated[Path, typer.Argument(help="Recipe TOML (see recipes/quickstart.toml).")],
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            help="Override a recipe key, e.g. --set train.optim.lr=1e-5 (repeatable; values are TOML literals).",
        ),
    ] = None,
    out: Annotated[
        str | None,
        typer.Option(metavar="DIR", help="Run folder (local; model and data may be URLs); default runs/<recipe name>."),
    ] = None,
    resume: Annotated[bool, typer.Option(help="Continue the run in --out from its last complete checkpoint.")] = False,
    overwrite: Annotated[
        bool, typer.Option(help="Replace the run in --out (its checkpoints, steps, metrics) with a new one.")
    ] = False,
    print_config: Annotated[bool, typer.Option(help="Print the resolved recipe as JSON and exit.")] = False,
    plan: Annotated[bool, typer.Option(help=_PLAN_HELP)] = False,
    gpus: Annotated[
        int | None, typer.Option(min=1, help="With --plan: GPUs (ranks); default $WORLD_SIZE, else 1.")
    ] = None,
    gpu_memory_gib: Annotated[
        float | None, typer.Option(min=1.0, help="With --plan: GiB per GPU (H100 80GB: 79.1); default this GPU's.")
    ] = None,
    host_memory_gib: Annotated[float | None, typer.Option(min=1.0, help=_HOST_HELP)] = None,
) -> None:
    """Run PPO/GRPO: rollout -> score -> train-step for `steps` iterations, writing the same artifacts
    as the separate commands (step_NNNNNN/, checkpoints/, metrics.jsonl) to the run folder.

    Unknown recipe keys are rejected with their path. --resume continues after the last complete
    step and gives the same final weights as an uninterrupted run. The model, every prompt line and the
    reward functions are checked before anything is written; a run folder whose start completed no step
    can be started again. One process at a time holds a run folder (RUN_DIR/.rlx-lock). SIGTERM stops after
    the current step's checkpoint (exit 143).

    On CUDA the memory plan (rlx/ppo/plan.py) chooses what the recipe leaves unset among rollout.sleep,
    train.gradient_checkpointing, the micro-batch token budgets, rollout.kv_cache_gib, train.compile and
    train.param_offload so the run fits the GPUs and the host's memory, prints it, and stops before loading weights
    when nothing fits.
    """
    run_dir = Path(out) if out else Path("runs") / recipe.stem
    with reporting("ppo", on_interrupt=lambda: _resume_hint(run_dir)):
        from rlx.ppo.config import load_recipe
        from rlx.utils.device import resolve_device

        if resume and overwrite:
            raise UserError("--resume continues the run in --out and --overwrite replaces it: give one of them")
        if plan or gpus is not None or gpu_memory_gib is not None or host_memory_gib is not None:
            return _print_plan(recipe, set_ or [], plan, gpus, gpu_memory_gib, host_memory_gib)
        device_type = resolve_device(_train_device(recipe, set_ or [])).type
        if device_type == "cuda":
            set_ = [*(set_ or []), *_planned(recipe, set_ or [], run_dir if resume else None)]
        cfg = load_recipe(recipe, set_ or [], device_type)
        if not print_config:
            _announce_defaults(device_type, recipe, set_ or [], {"score.old_logprobs": cfg.score.old_logprobs})
        if print_config:
            import json

            from rlx.config import to_dict

            print(json.dumps(to_dict(cfg), indent=2))
            return
        from rlx.utils.io import is_remote

        if out and is_remote(out):
            raise UserError(
                f"--out {out}: the run folder must be local (model.path and data.prompts may be URLs; "
                f"copy checkpoints out with `rlx merge --out URL`)"
            )
        _run(cfg, run_dir, resume, overwrite)


def _resume_hint(run_dir: Path) -> str:
    """What an interrupted run's last line adds: the checkpoint --resume continues from, or that there is none."""
    from rlx.checkpoints.meta import is_checkpoint
    from rlx.ppo.rundir import RECIPE_NAME, checkpoint_dir, last_checkpoint

    if not (run_dir / RECIPE_NAME).is_file():
        return ""
    found = last_checkpoint(run_dir)
    if found is None:
        again = "; no checkpoint was written yet, so --resume starts the run again at step 1"
        if not _has_warm_start(run_dir / RECIPE_NAME):
            return again
        if is_checkpoint(checkpoint_dir(run_dir, 0)):
            return f"{again}, reusing its finished [sft] warm start unless something it depends on changed"
        return f"{again}, and its [sft] warm start again from its first step (it saves no checkpoint part-way)"
    return f"; its last checkpoint is {checkpoint_dir(run_dir, found[0])}: continue with the same command plus --resume"


def _has_warm_start(recipe_json: Path) -> bool:
    """Whether a run folder's recipe.json has an [sft] table (False where it cannot be read)."""
    import json

    try:
        return json.loads(recipe_json.read_text()).get("sft") is not None
    except (OSError, ValueError, AttributeError):
        return False


def _run(cfg, run_dir: Path, resume: bool, overwrite: bool) -> None:
    """The loop (the asynchronous one with [async]), with deterministic kernels when the recipe asks for them."""
    from rlx.ppo.loop import run_ppo

    if cfg.async_ is not None:  # rollout ranks and trainers (under torchrun)
        from rlx.ppo.async_train import run_async_ppo as run_ppo
    if cfg.deterministic:
        from rlx.utils.determinism import determinism_error, enable_determinism

        enable_determinism()
    try:
        run_ppo(cfg, run_dir, resume=resume, overwrite=overwrite)
    except RuntimeError as e:
        if cfg.deterministic and (message := determinism_error(e)) is not None:
            raise message from e
        raise


def _recipe_tree(recipe: Path, overrides: list[str]) -> dict:
    """The recipe's TOML tree with the --set overrides (what the user gave), old keys moved to their new places."""
    from rlx.config import apply_overrides, load_toml
    from rlx.ppo.config import move_old_keys

    tree = load_toml(recipe)
    return apply_overrides(tree, move_old_keys(tree, overrides, recipe))


def _train_device(recipe: Path, overrides: list[str]) -> str:
    """The recipe's `train.device` before the config is built: the fast path it selects may fill keys (e.g.
    rollout.engine = "native") that other settings (rollout.tp_degree > 1) need to validate."""
    tree = _recipe_tree(recipe, overrides)
    train = tree.get("train") if isinstance(tree.get("train"), dict) else {}
    return str(train.get("device", "auto"))


def _announce_defaults(device_type: str, recipe: Path, overrides: list[str], resolved: dict[str, str]) -> None:
    """The fast path's keys and the asynchronous run's rollout correction, where the recipe leaves them out (an
    'auto' value shown as `resolved` gives it)."""
    from rlx.observe.tracking import console
    from rlx.ppo.defaults import async_defaults, fast_path_defaults

    tree = _recipe_tree(recipe, overrides)
    chosen = fast_path_defaults(device_type, tree, Path(recipe).parent)
    if chosen:
        settings = ", ".join(f"{k}={resolved.get(k, v) if v == 'auto' else v}" for k, v in chosen.items())
        console(f"rlx ppo: fast path on {device_type} (keys the recipe leaves out): {settings}")
    if async_defaults(tree):
        console('rlx ppo: [async] samples are off-policy: train.correction.rollout_is = "token" (set it to opt out)')


def _print_plan(
    recipe: Path, overrides: list[str], plan: bool, gpus: int | None, gpu_memory_gib: float | None,
    host_memory_gib: float | None = None,
) -> None:  # fmt: skip
    """`--plan`: the plan for the named hardware on stdout; exit 1 (UserError) when nothing fits."""
    import os

    if not plan:
        raise UserError("--gpus, --gpu-memory-gib and --host-memory-gib describe the hardware of --plan: add --plan")
    from rlx.ppo.config import load_recipe
    from rlx.ppo.plan import plan_recipe

    load_recipe(recipe, overrides, "cuda")  # the recipe is valid as `rlx ppo` would run it on GPUs
    world = gpus or int(os.environ.get("WORLD_SIZE", "1"))
    if gpu_memory_gib is None:
        gpu_memory_gib = _device_memory_gib()
        if gpu_memory_gib is None:
            raise UserError("--plan: no GPU here; name the hardware with --gpu-memory-gib (an H100 80GB: 79.1)")
        host_memory_gib = host_memory_gib or _host_memory_gib()  # this machine's GPUs: its own memory too
    host = _host(host_memory_gib, world)
    result = plan_recipe(_recipe_tree(recipe, overrides), recipe.parent, world, gpu_memory_gib, host)
    print(result.summary())
    if host is None:
        print("  host memory not checked (name it with --host-memory-gib)")
    if not result.fits:
        raise UserError(f"{recipe}: {result.message}")


def _planned(recipe: Path, overrides: list[str], resumed: Path | None = None) -> list[str]:
    """On CUDA: the memory plan's choices for the unset keys as --set overrides, the plan printed by rank 0; a
    UserError before any weight is loaded when nothing fits. A recipe the plan does not cover runs as it is. A run
    resumed from `resumed` keeps the settings it started with (its recipe.json), so it resumes as it ran."""
    import os

    from rlx.observe.tracking import console
    from rlx.ppo.plan import plan_overrides, plan_recipe, saved_choices

    tree = _recipe_tree(recipe, overrides)
    if resumed is not None and (resumed / "recipe.json").is_file():
        return saved_choices(resumed / "recipe.json", tree)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        host = _host(_host_memory_gib(), world)
        launched = "LOCAL_RANK" in os.environ  # torchrun: FSDP even on one process (CPU offload possible)
        result = plan_recipe(tree, recipe.parent, world, _device_memory_gib() or 0.0, host, launched)
    except UserError as e:
        if os.environ.get("RANK", "0") == "0":
            console(f"rlx ppo: no memory plan ({e})")
        return []
    if os.environ.get("RANK", "0") == "0":
        console(result.summary())
    if not result.fits:
        raise UserError(f"{recipe}: {result.message} (see `rlx ppo --plan --help`)")
    return plan_overrides(result, tree)


def _host(memory_gib: float | None, world: int):
    """The plan's Host: `memory_gib` shared by this host's ranks ($LOCAL_WORLD_SIZE, else all `world`); None
    without a memory size."""
    import os

    from rlx.ppo.plan import Host

    if memory_gib is None:
        return None
    return Host(memory_gib, min(world, int(os.environ.get("LOCAL_WORLD_SIZE") or world)))


def _host_memory_gib() -> float | None:
    """This machine's memory in GiB (its total: every rank of a host plans alike), None where the OS does not say."""
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None


def _device_memory_gib() -> float | None:
    """This rank's GPU memory in GiB (its total: every rank plans alike, and a resumed run plans as it started),
    None without CUDA. Reads the device's properties only (no CUDA context is created)."""
    import os

    import torch

    if not torch.cuda.is_available():
        return None
    index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    return torch.cuda.get_device_properties(index).total_memory / 2**30
