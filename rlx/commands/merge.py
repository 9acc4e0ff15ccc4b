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
        str, typer.Option(metavar="DTYPE", help="Store weights as keep | float32 | bfloat16 | float16.")
    ] = "keep",
    overwrite: Annotated[bool, typer.Option(help="Replace --out if it exists.")] = False,
) -> None:
    """Gather a checkpoint into a Hugging Face model dir (safetensors, config, tokenizer) any tool loads."""
    with reporting("merge"):
        from rlx.engine.checkpoints.shard import merge_checkpoint

        merge_checkpoint(checkpoint, out, dtype=dtype, overwrite=overwrite)
