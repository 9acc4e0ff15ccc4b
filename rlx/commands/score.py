"""`rlx score`: rewards, old/ref logprobs, values and advantages -> scores.jsonl + batch.safetensors."""

from __future__ import annotations

from typing import Annotated

import typer

from rlx.commands._common import build_config, reporting
from rlx.config import help_for
from rlx.engine.scoring.config import ScoreConfig as C


def _opt(name: str, metavar: str | None = None, **kw):
    return typer.Option(help=help_for(C, name), **({"metavar": metavar} if metavar else {}), **kw)


def score(
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
    reward: Annotated[list[str] | None, _opt("reward", "NAME[=W]")] = None,
    reward_model: Annotated[str | None, _opt("reward_model", "PATH")] = None,
    reward_model_weight: Annotated[float, _opt("reward_model_weight")] = C.reward_model_weight,
    estimator: Annotated[str, _opt("estimator", "NAME")] = C.estimator,
    norm_adv_by_std: Annotated[bool, _opt("norm_adv_by_std")] = C.norm_adv_by_std,
    gamma: Annotated[float, _opt("gamma")] = C.gamma,
    lam: Annotated[float, _opt("lam")] = C.lam,
    whiten_advantages: Annotated[bool, _opt("whiten_advantages")] = C.whiten_advantages,
    kl_coef: Annotated[float, _opt("kl_coef")] = C.kl_coef,
    kl_ctrl: Annotated[str, _opt("kl_ctrl", "fixed|adaptive")] = C.kl_ctrl,
    kl_target: Annotated[float, _opt("kl_target")] = C.kl_target,
    kl_horizon: Annotated[int, _opt("kl_horizon")] = C.kl_horizon,
    kl_estimator: Annotated[str, _opt("kl_estimator", "k1|k2|k3|abs")] = C.kl_estimator,
    filter_groups: Annotated[bool, _opt("filter_groups")] = C.filter_groups,
    overlong_buffer: Annotated[int, _opt("overlong_buffer")] = C.overlong_buffer,
    overlong_penalty: Annotated[float, _opt("overlong_penalty")] = C.overlong_penalty,
    max_response_length: Annotated[int, _opt("max_response_length")] = C.max_response_length,
    on_reward_error: Annotated[str, _opt("on_reward_error", "raise|zero")] = C.on_reward_error,
    old_logprobs: Annotated[str, _opt("old_logprobs", "actor|rollout")] = C.old_logprobs,
    temperature: Annotated[
        float | None,
        typer.Option(help="Temperature for logprobs; default: the one recorded in the rollouts (1 for greedy)."),
    ] = None,
    logprob_impl: Annotated[str, _opt("logprob_impl", "auto|naive|chunked|triton")] = C.logprob_impl,
    micro_batch_size: Annotated[int, _opt("micro_batch_size")] = C.micro_batch_size,
    device: Annotated[str, _opt("device", "auto|cpu|cuda|npu")] = C.device,
    precision: Annotated[str, _opt("precision", "auto|float32|bfloat16")] = C.precision,
    metrics: Annotated[
        str | None,
        typer.Option(metavar="FILE", help="Append a metrics line (rewards, lengths, KL, mismatch) to this JSONL file."),
    ] = None,
) -> None:
    """Score rollouts: rule, custom and reward-model rewards, old/reference logprobs, critic values, KL,
    and advantages by any estimator (GRPO by default).

    Writes OUT/scores.jsonl (one line per sample: reward and its components, advantage) and
    OUT/batch.safetensors (the padded training batch `rlx train-step` reads). Rollouts with
    greedy baselines (`rlx rollout --remax-baseline`) go with --estimator remax.
    """
    with reporting("score"):
        cfg = build_config(
            C,
            reward=list(reward or []),
            reward_model=reward_model,
            reward_model_weight=reward_model_weight,
            estimator=estimator,
            norm_adv_by_std=norm_adv_by_std,
            gamma=gamma,
            lam=lam,
            whiten_advantages=whiten_advantages,
            kl_coef=kl_coef,
            kl_ctrl=kl_ctrl,
            kl_target=kl_target,
            kl_horizon=kl_horizon,
            kl_estimator=kl_estimator,
            filter_groups=filter_groups,
            overlong_buffer=overlong_buffer,
            overlong_penalty=overlong_penalty,
            max_response_length=max_response_length,
            on_reward_error=on_reward_error,
            old_logprobs=old_logprobs,
            logprob_impl=logprob_impl,
            micro_batch_size=micro_batch_size,
            device=device,
            precision=precision,
        )
        from rlx.engine.scoring.run import run_score

        run_score(cfg, rollouts, out, actor, ref, critic, temperature=temperature, metrics_path=metrics)
