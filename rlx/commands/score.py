"""`rlx score`: rewards, old/ref logprobs, values and advantages -> scores.jsonl + batch.safetensors.
Options other than the files are ScoreConfig's fields (rlx/scoring/config.py)."""

from __future__ import annotations

from typing import Annotated

import typer

from rlx.commands._common import reporting
from rlx.commands._options import config_command
from rlx.scoring.config import ScoreConfig


@config_command(
    ScoreConfig,
    "score",
    metavars={"reward": "NAME[=W]", "reward_model": "PATH", "estimator": "NAME"},
    exclude=("freeze_vision_tower", "max_prompt_tokens"),  # train-step's and rollout's
)
def score(
    cfg: ScoreConfig,
    rollouts: Annotated[str, typer.Option(metavar="FILE", help="rollouts.jsonl to score ('-' reads stdin).")],
    out: Annotated[
        str, typer.Option(metavar="DIR", help="Folder (or fsspec URL) for scores.jsonl and batch.safetensors.")
    ],
    actor: Annotated[
        str,
        typer.Option(
            metavar="PATH",
            help="The policy that sampled the rollouts (HF dir, checkpoint, .gguf): old logprobs, vocabulary, pad id.",
        ),
    ],
    ref: Annotated[
        str | None,
        typer.Option(metavar="PATH", help="Reference model for ref logprobs and KL (usually the initial policy)."),
    ] = None,
    critic: Annotated[
        str | None,
        typer.Option(
            metavar="PATH",
            help="Value model for critic values (estimator gae); make one with `rlx shard --role critic`.",
        ),
    ] = None,
    temperature: Annotated[
        float | None,
        typer.Option(help="Temperature for logprobs; default: the one recorded in the rollouts (1 for greedy)."),
    ] = None,
    metrics: Annotated[
        str | None,
        typer.Option(metavar="FILE", help="Append a metrics line (rewards, lengths, KL, mismatch) to this JSONL file."),
    ] = None,
    overwrite: Annotated[
        bool, typer.Option(help="Replace OUT/scores.jsonl and OUT/batch.safetensors if they exist.")
    ] = False,
) -> None:
    """Score rollouts: rule, custom and reward-model rewards, old/reference logprobs, critic values, KL,
    and advantages by any estimator (GRPO by default).

    Writes OUT/scores.jsonl (one line per sample: reward and its components, advantage) and
    OUT/batch.safetensors (the padded training batch `rlx train-step` reads). Rollouts with
    greedy baselines (`rlx rollout --remax-baseline`) go with --estimator remax.
    """
    with reporting("score", beats=True):
        from rlx.stages.score import run_score

        run_score(
            cfg, rollouts, out, actor, ref, critic, temperature=temperature, metrics_path=metrics, overwrite=overwrite
        )
