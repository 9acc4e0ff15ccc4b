"""`rlx eval`: answer held-out prompts with a model, grade them, write eval.jsonl and a val/* metrics line. Options
other than the model and the files are EvalConfig's fields (rlx/evaluation/evaluate.py; its `sampling` table's flat)
and the rollout engine's settings (RolloutConfig's engine, batch_size, chat_template, device, precision, exact and
prompt limits)."""

from __future__ import annotations

from typing import Annotated

import typer

from rlx.commands._common import reporting
from rlx.commands._options import config_command, config_fields
from rlx.evaluation.evaluate import EvalConfig
from rlx.rollout.config import RolloutConfig

ENGINE_FIELDS = (
    "engine",
    "batch_size",
    "chat_template",
    "device",
    "precision",
    "exact",
    "max_prompt_length",
    "on_long_prompt",
)
"""The rollout settings `rlx eval` takes (the sampling ones are EvalConfig's own `sampling` table)."""


@config_command(
    EvalConfig,
    "eval",
    exclude=("every", "before_training", "remax_baseline"),  # `rlx ppo`'s schedule; a rollout setting
    metavars={"prompts": "FILE", "reward": "SPEC", "stop": "TEXT"},
    decls={"n": ("--n", "--num-samples")},
    help_extra={
        "reward": " Repeat for a weighted sum.",
        "n": " pass@k and mean@n need n > 1 and a temperature > 0.",
    },
)
@config_fields("engine_settings", RolloutConfig, ENGINE_FIELDS, metavars={"engine": "NAME"})
def eval_(
    cfg: EvalConfig,
    engine_settings: dict,
    model: Annotated[
        str, typer.Option(metavar="PATH", help="Model: a Hugging Face dir, an rlx checkpoint dir or a .gguf file.")
    ],
    out: Annotated[str, typer.Option(metavar="DIR", help="Folder for eval.jsonl (one line per sample).")],
    metrics: Annotated[
        str | None,
        typer.Option(metavar="FILE", help="Append the val/* metrics line (at the checkpoint's step) to this file."),
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing DIR/eval.jsonl.")] = False,
) -> None:
    """Evaluate a model on held-out prompts: greedy by default, or --n samples per prompt at a --temperature
    for pass@k (unbiased estimator, k = 1, 2, 4, ... and n) and mean@n.

    Writes DIR/eval.jsonl (id, prompt_id, response, reward, is_correct, ...) and, with --metrics, one line
    of val/reward_mean, val/pass@k, val/mean@n (per data_source too when there are several).
    """
    with reporting("eval", beats=True):
        from rlx.stages.eval import run_eval

        run_eval(cfg, model, out, engine_settings, metrics_path=metrics, overwrite=overwrite)
