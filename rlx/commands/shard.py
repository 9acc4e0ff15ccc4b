"""`rlx shard`: lay a Hugging Face model (or a GGUF file) out as an rlx training checkpoint."""

from __future__ import annotations

from typing import Annotated

import typer

from rlx.checkpoints import catalog
from rlx.commands._common import LORA_OPTIONS, reporting
from rlx.commands._options import nested_config
from rlx.errors import UserError
from rlx.models.lora_config import LoraConfig


@nested_config("lora", LoraConfig, **LORA_OPTIONS)
def shard(
    lora: LoraConfig | None,
    model: Annotated[
        str,
        typer.Option(
            metavar="PATH",
            help="Source: a Hugging Face model dir, a .gguf file (dequantised), or a dir with config.json "
            "and a tokenizer for --init random.",
        ),
    ],
    out: Annotated[str, typer.Option(metavar="PATH", help="Checkpoint folder to create (written atomically).")],
    layout: Annotated[
        str,
        typer.Option(
            metavar="NAME",
            help=f"Weight layout: {catalog.describe()}.",
        ),
    ] = catalog.DEFAULT,
    tp: Annotated[
        int | None,
        typer.Option(
            metavar="N",
            help="Tensor-parallel degree of --layout megatron (default 1): each layer's attention heads, MLP "
            "width and vocabulary are split over N ranks; N must divide the attention heads, key/value heads "
            "and MLP width.",
        ),
    ] = None,
    pp: Annotated[
        int | None,
        typer.Option(
            metavar="M",
            help="Pipeline-parallel degree of --layout megatron (default 1): the layers are cut into M stages "
            "of equal size; M must divide the number of layers.",
        ),
    ] = None,
    init: Annotated[
        str,
        typer.Option(
            metavar="pretrained|random",
            help="'pretrained' copies the weights; 'random' initialises them from config.json with --seed.",
        ),
    ] = "pretrained",
    seed: Annotated[int, typer.Option(help="Seed for --init random and for a new critic's value head.")] = 0,
    role: Annotated[
        str,
        typer.Option(
            metavar="actor|critic",
            help="'critic' makes a value model: the source's backbone with a new scalar head (a value model "
            "source is copied as is).",
        ),
    ] = "actor",
    dtype: Annotated[
        str,
        # the name given: typer 0.27 under click 8.5 names an option after a metavar that is its name in capitals
        typer.Option("--dtype", metavar="DTYPE", help="Store weights as keep | float32 | bfloat16 | float16."),
    ] = "keep",
    overwrite: Annotated[bool, typer.Option(help="Replace --out if it exists.")] = False,
) -> None:
    """Lay a model out for training: an rlx checkpoint at step 0 (weights, config, tokenizer, rlx.json).

    With the default dtype, `rlx shard` then `rlx merge` gives back bit-identical tensors (any layout).
    With --lora-* options (or --layout lora) it makes a LoRA checkpoint instead: adapters initialised with
    --seed and a pointer to the model as their frozen base (train-step then trains the adapters only).
    """
    with reporting("shard", beats=True):
        if init not in ("pretrained", "random"):
            raise UserError(f"--init {init!r}: expected 'pretrained' or 'random'")
        from rlx.stages.shard import shard_model

        if role not in ("actor", "critic"):
            raise UserError(f"--role {role!r}: expected 'actor' or 'critic'")
        options = {"init": init, "seed": seed, "dtype": dtype, "overwrite": overwrite, "role": role}
        shard_model(model, out, layout=layout, tp_degree=tp, pp_degree=pp, lora=lora, **options)
