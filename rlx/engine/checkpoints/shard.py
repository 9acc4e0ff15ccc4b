"""`rlx shard` / `rlx merge`: HF dir or GGUF <-> rlx checkpoint dir, in any registered layout.

Weights of an HF dir are copied tensor by tensor as stored (dtype kept; a sharded layout cuts them into its
shards), so shard followed by merge gives back bit-identical tensors and byte-identical config and tokenizer
files.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rlx.engine.checkpoints.base import ShardOptions
from rlx.engine.checkpoints.files import aux_files, write_aux, write_weights
from rlx.engine.checkpoints.loading import build_critic_files, load_initial_policy
from rlx.engine.checkpoints.meta import CheckpointMeta, is_checkpoint, provenance
from rlx.engine.checkpoints.registry import get_layout, layout_names, read_full_weights, read_meta
from rlx.engine.parallel.fsdp import model_weights
from rlx.engine.tracking import console
from rlx.errors import UserError
from rlx.models.loading import ModelSource, build_empty_model, check_weights_match, load_config, resolve_source
from rlx.models.value import is_value_config
from rlx.utils.files import check_writable
from rlx.utils.io import atomic_dir, exists, is_remote


def check_new_output(out: str, overwrite: bool) -> None:
    """Refuse an existing output folder (without --overwrite) or one that cannot be written, before any work."""
    if exists(out) and not overwrite:
        raise UserError(f"{out}: already exists (choose another --out or pass --overwrite)")
    check_writable(out)


DTYPES = {"keep": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _cast(weights: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    target = DTYPES[dtype]
    if target is None:
        return weights
    return {k: v.to(target) if v.is_floating_point() else v for k, v in weights.items()}


def _set_config_dtype(aux: dict[str, bytes], dtype: str) -> dict[str, bytes]:
    """Record a cast in config.json so loaders pick the stored dtype."""
    if DTYPES.get(dtype) is None or "config.json" not in aux:
        return aux
    config = json.loads(aux["config.json"])
    config["dtype"] = dtype
    config.pop("torch_dtype", None)
    return {**aux, "config.json": (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()}


def _source_files(source: ModelSource, init: str, seed: int, role: str):
    """(weights, aux, config) of the model to lay out: the source's stored tensors, or a model built
    by `load_initial_policy` (random init, GGUF) and turned into a critic for role 'critic'."""
    config = None if source.is_gguf else load_config(source)
    from_value_model = config is not None and is_value_config(config)
    if role == "actor" and from_value_model:
        raise UserError(f"{source.path}: this is a value model; shard it with --role critic")
    if init == "pretrained" and not source.is_gguf and (role == "actor" or from_value_model):
        weights = read_full_weights(source.path)
        check_weights_match(build_empty_model(config), weights, source.path)
        return weights, aux_files(source.path), config
    model, tokenizer, aux = load_initial_policy(source.path, init, seed)
    if role == "critic":
        model, aux = build_critic_files(model, tokenizer, seed)
    return model_weights(model), aux, model.config


def shard_model(
    path: str,
    out: str,
    layout: str = "single",
    init: str = "pretrained",
    seed: int = 0,
    dtype: str = "keep",
    overwrite: bool = False,
    role: str = "actor",
    tp_degree: int | None = None,
    pp_degree: int | None = None,
) -> None:
    """Lay a model out as a training checkpoint (step 0).

    role 'critic' makes a value model: a value model source is copied as is; a causal LM gives its
    backbone to a new value model whose head is initialised with `seed`. The 'megatron' layout cuts
    the weights into `tp_degree` x `pp_degree` rank states (1 x 1 by default)."""
    target = get_layout(layout)
    check_new_output(out, overwrite)
    target.check_output(out)
    options = ShardOptions(tp_degree, pp_degree)
    _check_options(options, target)
    fields = target.shard_fields(options)
    source = resolve_source(path)
    target.check_model(lambda: load_config(source), fields, str(path))  # fail before the weights are read
    weights, aux, config = _source_files(source, init, seed, role)
    config, aux = target.prepare_files(config, aux)
    meta = CheckpointMeta(
        step=0,
        layout=layout,
        **fields,
        provenance=provenance(
            "rlx shard",
            source.path,
            init=init,
            role=role,
            **({"seed": seed} if init == "random" or role == "critic" else {}),
        ),
    )
    weights, aux = _cast(weights, dtype), _set_config_dtype(aux, dtype)
    target.write_full(out, weights, aux, meta, config, overwrite)
    grid = " x ".join(f"{k.removesuffix('_degree')} {v}" for k, v in fields.items())
    grid = f", {grid}" if grid else ""
    console(f"rlx shard: {len(weights)} tensors, {_count(weights) / 1e6:.1f}M parameters{grid} -> {out}")


def _check_options(options: ShardOptions, target) -> None:
    """Options the target layout does not take name the layouts that do."""
    given = [name for name, value in vars(options).items() if value is not None and name not in target.shard_options]
    if given:
        takers = [name for name in layout_names() if set(given) <= set(get_layout(name).shard_options)]
        flags = " and ".join(f"--{name.removesuffix('_degree')}" for name in given)
        raise UserError(f"{flags} apply to --layout {' / '.join(takers)} only (got --layout {target.name})")


def merge_checkpoint(checkpoint: str, out: str, dtype: str = "keep", overwrite: bool = False) -> None:
    """Gather a checkpoint (any layout) back into a plain Hugging Face model dir."""
    folder = resolve_source(checkpoint, "checkpoint").path if is_remote(checkpoint) else Path(checkpoint)
    if not folder.is_dir():
        raise UserError(f"{folder}: checkpoint not found")
    if not is_checkpoint(folder):
        raise UserError(f"{folder}: not an rlx checkpoint (no rlx.json); make one with `rlx shard`")
    read_meta(folder)  # validates format and layout
    check_new_output(out, overwrite)
    weights = _cast(read_full_weights(folder), dtype)
    aux = _set_config_dtype(aux_files(folder), dtype)
    with atomic_dir(out, overwrite=overwrite, marker="config.json") as tmp:
        write_aux(tmp, aux)
        write_weights(tmp, weights)
    console(f"rlx merge: {len(weights)} tensors, {_count(weights) / 1e6:.1f}M parameters -> {out}")


def _count(weights: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() for t in weights.values())
