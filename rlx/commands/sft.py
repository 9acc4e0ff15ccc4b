"""`rlx sft`: supervised fine-tuning of a model on demonstrations, written as a step-0 checkpoint. Options other than
the files are SFTConfig's fields (rlx/sft/config.py)."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import typer

from rlx.commands._common import reporting
from rlx.commands._options import config_command
from rlx.errors import UserError
from rlx.sft.config import SFTConfig


@config_command(SFTConfig, "sft", exclude=("data",), metavars={"on_long_sample": "error|skip"})
def sft(
    cfg: SFTConfig,
    model: Annotated[
        str,
        typer.Option(
            metavar="PATH",
            help="The model to fine-tune: an HF dir, rlx checkpoint, .gguf file, or a dir with config.json and a "
            "tokenizer for --init random.",
        ),
    ],
    data: Annotated[
        str,
        typer.Option(
            metavar="FILE",
            help='Demonstrations JSONL: {"messages": [...], "tools": [...]} per line (OpenAI chat format, tools '
            'optional) or {"prompt": ..., "response": ...}.',
        ),
    ],
    out: Annotated[str, typer.Option(metavar="DIR", help="Checkpoint folder to create (written atomically).")],
    init: Annotated[
        str,
        typer.Option(
            metavar="pretrained|random",
            help="'pretrained' starts from the model's weights; 'random' initialises them from config.json with "
            "--seed.",
        ),
    ] = "pretrained",
    overwrite: Annotated[bool, typer.Option(help="Replace --out if it exists.")] = False,
    metrics: Annotated[
        str | None, typer.Option(metavar="FILE", help="Append a metrics line per optimizer step to this JSONL file.")
    ] = None,
) -> None:
    """Supervised fine-tuning on demonstrations: token-mean NLL over the assistant's tokens, AdamW.

    Conversations are tokenised with the model's chat template exactly as multi-turn rollouts build their
    context (the prefix of each assistant turn ends with the generation prompt); the assistant's tokens, tool
    calls included, through the end-of-turn token, get the loss, every other token is masked. The result is a
    step-0 checkpoint ('single' layout, no optimizer state) every other command reads, e.g. the start of
    `rlx rollout` / `score` / `train-step` (a recipe's [sft] table does the same inside `rlx ppo`). Under torchrun
    the demonstrations of each step are split over the ranks (FSDP).
    """
    with reporting("sft"):
        if init not in ("pretrained", "random"):
            raise UserError(f"--init {init!r}: expected 'pretrained' or 'random'")
        from rlx.stages.sft import run_sft

        run_sft(dataclasses.replace(cfg, data=data), model, out, init=init, overwrite=overwrite, metrics_path=metrics)
