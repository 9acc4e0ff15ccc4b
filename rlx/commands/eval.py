"""`rlx eval`: answer held-out prompts with a model, grade them, write eval.jsonl and a val/* metrics line."""

from __future__ import annotations

from typing import Annotated

import typer

from rlx.commands._common import build_config, reporting
from rlx.config import help_for
from rlx.evaluation.evaluate import EvalConfig as C
from rlx.rollout.config import RolloutConfig as R


def eval_(
    model: Annotated[
        str, typer.Option(metavar="PATH", help="Model: a Hugging Face dir, an rlx checkpoint dir or a .gguf file.")
    ],
    prompts: Annotated[str, typer.Option(metavar="FILE", help=help_for(C, "prompts"))],
    out: Annotated[str, typer.Option(metavar="DIR", help="Folder for eval.jsonl (one line per sample).")],
    reward: Annotated[
        list[str] | None,
        typer.Option(metavar="SPEC", help=help_for(C, "reward") + " Repeat for a weighted sum."),
    ] = None,
    n: Annotated[int, typer.Option("--n", "--num-samples", help=help_for(C, "n"))] = C.n,
    temperature: Annotated[float, typer.Option(help=help_for(C, "temperature"))] = C.temperature,
    top_p: Annotated[float, typer.Option(help=help_for(C, "top_p"))] = C.top_p,
    top_k: Annotated[int, typer.Option(help=help_for(C, "top_k"))] = C.top_k,
    max_new_tokens: Annotated[int, typer.Option(help=help_for(C, "max_new_tokens"))] = C.max_new_tokens,
    stop: Annotated[
        list[str] | None, typer.Option(metavar="TEXT", help=help_for(C, "stop") + " Repeat for several.")
    ] = None,
    max_prompt_length: Annotated[int, typer.Option(help=help_for(R, "max_prompt_length"))] = R.max_prompt_length,
    on_long_prompt: Annotated[
        str, typer.Option(metavar="error|filter", help=help_for(R, "on_long_prompt"))
    ] = R.on_long_prompt,
    seed: Annotated[int, typer.Option(help=help_for(C, "seed"))] = C.seed,
    correct_threshold: Annotated[float, typer.Option(help=help_for(C, "correct_threshold"))] = C.correct_threshold,
    on_reward_error: Annotated[
        str, typer.Option(metavar="raise|zero", help=help_for(C, "on_reward_error"))
    ] = C.on_reward_error,
    engine: Annotated[str, typer.Option(metavar="NAME", help=help_for(R, "engine"))] = R.engine,
    batch_size: Annotated[int, typer.Option(help=help_for(R, "batch_size"))] = R.batch_size,
    chat_template: Annotated[
        str, typer.Option(metavar="auto|on|off", help=help_for(R, "chat_template"))
    ] = R.chat_template,
    device: Annotated[str, typer.Option(metavar="auto|cpu|cuda|npu", help=help_for(R, "device"))] = R.device,
    precision: Annotated[
        str, typer.Option(metavar="auto|float32|bfloat16", help=help_for(R, "precision"))
    ] = R.precision,
    exact: Annotated[bool, typer.Option(help=help_for(R, "exact"))] = R.exact,
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
    with reporting("eval"):
        cfg = build_config(
            C,
            prompts=prompts,
            n=n,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_new_tokens=max_new_tokens,
            stop=list(stop or []),
            seed=seed,
            reward=list(reward or []),
            correct_threshold=correct_threshold,
            on_reward_error=on_reward_error,
        )
        engine_settings = dict(
            engine=engine,
            batch_size=batch_size,
            chat_template=chat_template,
            device=device,
            precision=precision,
            exact=exact,
            max_prompt_length=max_prompt_length,
            on_long_prompt=on_long_prompt,
        )
        build_config(R, **engine_settings)  # option errors name the option before any model is loaded
        from rlx.stages.eval import run_eval

        run_eval(cfg, model, out, engine_settings, metrics_path=metrics, overwrite=overwrite)
