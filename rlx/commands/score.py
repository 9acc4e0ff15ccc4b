"""`rlx score`: rewards, old/ref logprobs and advantages -> scores.jsonl + batch.safetensors."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rlx.commands._common import build_config, reporting
from rlx.config import help_for
from rlx.engine.scoring.config import ScoreConfig as C


def score(
    rollouts: Annotated[str, typer.Option(metavar="FILE", help="rollouts.jsonl to score ('-' reads stdin).")],
    out: Annotated[
        Path, typer.Option(metavar="PATH", help="Folder for scores.jsonl and batch.safetensors (created if missing).")
    ],
    actor: Annotated[
        str,
        typer.Option(
            metavar="PATH",
            help="The policy that sampled the rollouts (HF dir, checkpoint, .gguf): old logprobs, vocab, pad id.",
        ),
    ],
    ref: Annotated[
        str | None,
        typer.Option(metavar="PATH", help="Reference model for ref logprobs and KL (usually the initial policy)."),
    ] = None,
    reward: Annotated[str | None, typer.Option(metavar="NAME", help=help_for(C, "reward"))] = C.reward,
    estimator: Annotated[str, typer.Option(metavar="NAME", help=help_for(C, "estimator"))] = C.estimator,
    norm_adv_by_std: Annotated[bool, typer.Option(help=help_for(C, "norm_adv_by_std"))] = C.norm_adv_by_std,
    kl_coef: Annotated[float, typer.Option(help=help_for(C, "kl_coef"))] = C.kl_coef,
    kl_estimator: Annotated[
        str, typer.Option(metavar="k1|k2|k3|abs", help=help_for(C, "kl_estimator"))
    ] = C.kl_estimator,
    on_reward_error: Annotated[
        str, typer.Option(metavar="raise|zero", help=help_for(C, "on_reward_error"))
    ] = C.on_reward_error,
    old_logprobs: Annotated[
        str, typer.Option(metavar="actor|rollout", help=help_for(C, "old_logprobs"))
    ] = C.old_logprobs,
    temperature: Annotated[
        float | None,
        typer.Option(help="Temperature for logprobs; default: the one recorded in the rollouts (1 for greedy)."),
    ] = None,
    micro_batch_size: Annotated[int, typer.Option(help=help_for(C, "micro_batch_size"))] = C.micro_batch_size,
    device: Annotated[str, typer.Option(metavar="auto|cpu|cuda|npu", help=help_for(C, "device"))] = C.device,
    precision: Annotated[
        str, typer.Option(metavar="auto|float32|bfloat16", help=help_for(C, "precision"))
    ] = C.precision,
    metrics: Annotated[
        Path | None,
        typer.Option(metavar="FILE", help="Append a metrics line (rewards, lengths, KL) to this JSONL file."),
    ] = None,
) -> None:
    """Score rollouts: rule or custom rewards, old and reference logprobs, KL, GRPO advantages.

    Writes OUT/scores.jsonl (one line per sample: reward and its components, advantage) and
    OUT/batch.safetensors (the padded training batch `rlx train-step` reads).
    """
    with reporting("score"):
        cfg = build_config(
            C,
            reward=reward,
            estimator=estimator,
            norm_adv_by_std=norm_adv_by_std,
            kl_coef=kl_coef,
            kl_estimator=kl_estimator,
            on_reward_error=on_reward_error,
            old_logprobs=old_logprobs,
            micro_batch_size=micro_batch_size,
            device=device,
            precision=precision,
        )
        from rlx.engine.scoring.run import run_score

        run_score(cfg, rollouts, str(out), actor, ref, temperature=temperature, metrics_path=metrics)
