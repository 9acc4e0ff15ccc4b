"""The `rlx` command line: registers one command per stage. No torch import here, so --help is instant."""

from __future__ import annotations

import os
import sys

import typer

from rlx.commands.eval import eval_
from rlx.commands.merge import merge
from rlx.commands.ppo import ppo
from rlx.commands.report import report
from rlx.commands.rollout import rollout
from rlx.commands.score import score
from rlx.commands.serve import serve
from rlx.commands.sft import sft
from rlx.commands.shard import shard
from rlx.commands.train_step import train_step
from rlx.utils.allocator import configure_pinned_memory
from rlx.utils.cache import configure_compile_caches

app = typer.Typer(
    name="rlx",
    help="RL post-training for language models (PPO, GRPO) as plain, composable commands.\n\n"
    "Stages read and write files: prompts.jsonl -> rollout -> rollouts.jsonl -> score -> "
    "batch.safetensors -> train-step -> checkpoint. `rlx ppo` runs the loop from a recipe.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        from rlx import __version__

        print(f"rlx {__version__}")
        raise typer.Exit(0)


@app.callback()
def _options(
    version: bool = typer.Option(
        False, "--version", is_eager=True, callback=_print_version, help="Print `rlx VERSION` and exit."
    ),
) -> None:
    pass


app.command("shard")(shard)
app.command("sft")(sft)
app.command("rollout")(rollout)
app.command("score")(score)
app.command("train-step")(train_step)
app.command("merge")(merge)
app.command("eval")(eval_)
app.command("ppo")(ppo)
app.command("report")(report)
app.command("serve")(serve)


def main() -> None:
    configure_compile_caches()  # before any command imports torch
    configure_pinned_memory()
    try:
        app()
    except SystemExit as e:
        code = e.code
    else:
        code = 0
    launched = "WORLD_SIZE" in os.environ or "SLURM_PROCID" in os.environ
    if launched and "torch.distributed" in sys.modules:  # see exit_process: no finalization after gloo
        from rlx.parallel.dist import exit_process

        if not isinstance(code, int):
            if code is not None:
                print(code, file=sys.stderr)
            code = 0 if code is None else 1
        exit_process(code)
    sys.exit(code)


if __name__ == "__main__":
    main()
