"""`rlx rollout`: sample N responses per prompt and write rollouts.jsonl. Options other than the files and the
prompt selection are RolloutConfig's fields (rlx/rollout/config.py)."""

from __future__ import annotations

from typing import Annotated

import typer

from rlx.commands._common import reporting
from rlx.commands._options import config_command
from rlx.rollout.config import RolloutConfig


@config_command(
    RolloutConfig,
    "rollout",
    # `rlx ppo` only: how a resident engine follows training; train-step's and score's image settings
    exclude=("weight_sync", "sync_bucket_mib", "sleep", "freeze_vision_tower", "store_pixels"),
    metavars={"engine": "NAME", "env": "FILE.py:NAME", "agent": "FILE.py:NAME"},
    decls={"n": ("--n", "--num-samples")},
    help_extra={"n": " (--num-samples under torchrun, whose parser takes --n)"},
)
def rollout(
    cfg: RolloutConfig,
    model: Annotated[
        str, typer.Option(metavar="PATH", help="Model: a Hugging Face dir, an rlx checkpoint dir or a .gguf file.")
    ],
    prompts: Annotated[
        str, typer.Option(metavar="FILE", help="prompts.jsonl to answer ('-' reads stdin), or verl's .parquet.")
    ],
    out: Annotated[
        str, typer.Option(metavar="PATH", help="Where to write rollouts.jsonl ('-' writes stdout).")
    ] = "rollouts.jsonl",
    num_prompts: Annotated[int, typer.Option(help="Use this many prompts (0 = all of them, once).")] = 0,
    data_position: Annotated[
        int, typer.Option(help="Start at this position of the endless prompt sequence (as `rlx ppo` counts it).")
    ] = 0,
    shuffle_seed: Annotated[
        int | None,
        typer.Option(help="Reshuffle the prompts every epoch with this seed (as `rlx ppo` with data.shuffle)."),
    ] = None,
    metrics: Annotated[
        str | None, typer.Option(metavar="FILE", help="Append a metrics line (throughput) to this JSONL file.")
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace --out if it exists.")] = False,
) -> None:
    """Sample N responses per prompt; write rollouts.jsonl with token ids and the sampler's logprobs.

    Same seed, same file: every sample draws from its own random stream, derived from the seed,
    the prompt id and the sample index. With --env or --agent each sample is a multi-turn episode
    (tool calls, environment replies) recorded token-exactly, with a loss_mask over its tokens.
    """
    with reporting("rollout", beats=True):
        from rlx.stages.rollout import run_rollout

        run_rollout(
            cfg,
            model,
            prompts,
            out,
            num_prompts=num_prompts,
            data_position=data_position,
            shuffle_seed=shuffle_seed,
            metrics_path=metrics,
            overwrite=overwrite,
        )
