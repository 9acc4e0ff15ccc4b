"""`rlx merge`: turn an rlx checkpoint back into a plain Hugging Face model dir."""

from __future__ import annotations

from typing import Annotated

import typer

from rlx.commands._common import reporting


def merge(
    checkpoint: Annotated[
        str,
        typer.Option(
            metavar="DIR", help="rlx checkpoint folder of any layout (from `rlx shard`, `train-step` or `ppo`)."
        ),
    ],
    out: Annotated[str, typer.Option(metavar="PATH", help="Hugging Face model folder to create (written atomically).")],
    dtype: Annotated[
        str,
        # the name given: typer 0.27 under click 8.5 names an option after a metavar that is its name in capitals
        typer.Option("--dtype", metavar="DTYPE", help="Store weights as keep | float32 | bfloat16 | float16."),
    ] = "keep",
    overwrite: Annotated[bool, typer.Option(help="Replace --out if it exists.")] = False,
    adapter_only: Annotated[
        bool,
        typer.Option(
            help="For a LoRA checkpoint: write its adapters as a PEFT adapter folder (adapter_config.json, "
            "adapter_model.safetensors; peft.PeftModel.from_pretrained(base, OUT) loads it) instead of the "
            "merged model."
        ),
    ] = False,
) -> None:
    """Gather a checkpoint into a Hugging Face model dir (safetensors, config, tokenizer) any tool loads; a LoRA
    checkpoint's adapters are merged into its base (W + alpha/r B A), or written alone with --adapter-only."""
    with reporting("merge", beats=True):
        from rlx.stages.shard import merge_checkpoint

        merge_checkpoint(checkpoint, out, dtype=dtype, overwrite=overwrite, adapter_only=adapter_only)
