"""`rlx ppo`: the whole loop from a recipe, models resident in one process."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rlx.commands._common import reporting
from rlx.errors import UserError


def ppo(
    recipe: Annotated[Path, typer.Argument(help="Recipe TOML (see recipes/quickstart.toml).")],
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set", help="Override a recipe key, e.g. --set train.lr=1e-5 (repeatable; values are TOML literals)."
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
) -> None:
    """Run PPO/GRPO: rollout -> score -> train-step for `steps` iterations, writing the same artifacts
    as the separate commands (step_NNNNNN/, checkpoints/, metrics.jsonl) to the run folder.

    Unknown recipe keys are rejected with their path. --resume continues after the last complete
    step and gives the same final weights as an uninterrupted run. The model, every prompt line and the
    reward functions are checked before anything is written; a run folder whose start completed no step
    can be started again. One process at a time holds a run folder (RUN_DIR/.rlx-lock). SIGTERM stops after
    the current step's checkpoint (exit 143).
    """
    with reporting("ppo", on_interrupt="; continue the run with --resume"):
        from rlx.ppo.config import load_recipe
        from rlx.ppo.defaults import async_defaults, fast_path_defaults
        from rlx.utils.device import resolve_device

        if resume and overwrite:
            raise UserError("--resume continues the run in --out and --overwrite replaces it: give one of them")
        device_type = resolve_device(load_recipe(recipe, set_ or []).train.device).type
        cfg = load_recipe(recipe, set_ or [], device_type)
        chosen = fast_path_defaults(device_type, _recipe_tree(recipe, set_ or []), Path(recipe).parent)
        if chosen and not print_config:
            from rlx.observe.tracking import console

            settings = ", ".join(f"{k}={v}" for k, v in chosen.items())
            console(f"rlx ppo: fast path on {device_type} (keys the recipe leaves out): {settings}")
        corrected = async_defaults(_recipe_tree(recipe, set_ or []))
        if corrected and not print_config:
            from rlx.observe.tracking import console

            console('rlx ppo: [async] samples are off-policy: train.rollout_is = "token" (set it to opt out)')
        if print_config:
            import json

            from rlx.config import to_dict

            print(json.dumps(to_dict(cfg), indent=2))
            return
        from rlx.ppo.loop import run_ppo
        from rlx.utils.io import is_remote

        if out and is_remote(out):
            raise UserError(
                f"--out {out}: the run folder must be local (model.path and data.prompts may be URLs; "
                f"copy checkpoints out with `rlx merge --out URL`)"
            )
        if cfg.async_ is not None:  # rollout ranks and trainers (under torchrun)
            from rlx.ppo.async_train import run_async_ppo as run_ppo
        run_ppo(cfg, Path(out) if out else Path("runs") / recipe.stem, resume=resume, overwrite=overwrite)


def _recipe_tree(recipe: Path, overrides: list[str]) -> dict:
    """The recipe's TOML tree with the --set overrides (what the user gave)."""
    from rlx.config import apply_overrides, load_toml

    return apply_overrides(load_toml(recipe), overrides)
