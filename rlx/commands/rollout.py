"""`rlx rollout`: sample N responses per prompt and write rollouts.jsonl."""

from __future__ import annotations

from typing import Annotated

import typer

from rlx.commands._common import build_config, reporting
from rlx.config import help_for
from rlx.engine.rollout.config import RolloutConfig as C


def rollout(
    model: Annotated[
        str, typer.Option(metavar="PATH", help="Model: a Hugging Face dir, an rlx checkpoint dir or a .gguf file.")
    ],
    prompts: Annotated[
        str, typer.Option(metavar="FILE", help="prompts.jsonl to answer ('-' reads stdin), or verl's .parquet.")
    ],
    out: Annotated[
        str, typer.Option(metavar="PATH", help="Where to write rollouts.jsonl ('-' writes stdout).")
    ] = "rollouts.jsonl",
    n: Annotated[
        int,
        typer.Option(
            "--n", "--num-samples", help=help_for(C, "n") + " (--num-samples under torchrun, whose parser takes --n)"
        ),
    ] = C.n,
    max_new_tokens: Annotated[int, typer.Option(help=help_for(C, "max_new_tokens"))] = C.max_new_tokens,
    temperature: Annotated[float, typer.Option(help=help_for(C, "temperature"))] = C.temperature,
    top_p: Annotated[float, typer.Option(help=help_for(C, "top_p"))] = C.top_p,
    top_k: Annotated[int, typer.Option(help=help_for(C, "top_k"))] = C.top_k,
    seed: Annotated[int, typer.Option(help=help_for(C, "seed"))] = C.seed,
    engine: Annotated[str, typer.Option(metavar="NAME", help=help_for(C, "engine"))] = C.engine,
    tp: Annotated[int, typer.Option(help=help_for(C, "tp"))] = C.tp,
    gpu_memory_utilization: Annotated[
        float, typer.Option(help=help_for(C, "gpu_memory_utilization"))
    ] = C.gpu_memory_utilization,
    kv_cache_gib: Annotated[float, typer.Option(help=help_for(C, "kv_cache_gib"))] = C.kv_cache_gib,
    max_model_len: Annotated[int, typer.Option(help=help_for(C, "max_model_len"))] = C.max_model_len,
    chat_template: Annotated[
        str, typer.Option(metavar="auto|on|off", help=help_for(C, "chat_template"))
    ] = C.chat_template,
    remax_baseline: Annotated[bool, typer.Option(help=help_for(C, "remax_baseline"))] = C.remax_baseline,
    batch_size: Annotated[int, typer.Option(help=help_for(C, "batch_size"))] = C.batch_size,
    device: Annotated[str, typer.Option(metavar="auto|cpu|cuda|npu", help=help_for(C, "device"))] = C.device,
    precision: Annotated[
        str, typer.Option(metavar="auto|float32|bfloat16", help=help_for(C, "precision"))
    ] = C.precision,
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
) -> None:
    """Sample N responses per prompt; write rollouts.jsonl with token ids and the sampler's logprobs.

    Same seed, same file: every sample draws from its own random stream, derived from the seed,
    the prompt id and the sample index.
    """
    with reporting("rollout"):
        cfg = build_config(
            C,
            n=n,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            engine=engine,
            tp=tp,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_gib=kv_cache_gib,
            max_model_len=max_model_len,
            chat_template=chat_template,
            batch_size=batch_size,
            remax_baseline=remax_baseline,
            device=device,
            precision=precision,
        )
        from rlx.engine.rollout.run import run_rollout

        run_rollout(
            cfg,
            model,
            prompts,
            out,
            num_prompts=num_prompts,
            data_position=data_position,
            shuffle_seed=shuffle_seed,
            metrics_path=metrics,
        )
