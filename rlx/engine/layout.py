"""`rlx shard` / `rlx merge`: HF dir or GGUF <-> rlx checkpoint dir ('single' or 'fsdp' layout).

Weights of an HF dir are copied tensor by tensor as stored (dtype kept), so shard followed by merge
gives back bit-identical tensors and byte-identical config and tokenizer files.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rlx.engine.checkpoint import CheckpointMeta, aux_files, is_checkpoint, provenance, save_checkpoint, write_weights
from rlx.engine.io import atomic_dir, is_remote
from rlx.engine.parallel.dcp import is_dcp_checkpoint, read_full_weights, save_dcp_checkpoint
from rlx.engine.parallel.dist import DistContext
from rlx.engine.tracking import console
from rlx.errors import UserError
from rlx.models.loading import build_empty_model, check_weights_match, load_config, read_weights, resolve_source
from rlx.models.policy import build_critic_files, load_initial_policy, model_weights
from rlx.models.value import is_value_config

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


def shard_model(
    path: str,
    out: str,
    layout: str = "single",
    init: str = "pretrained",
    seed: int = 0,
    dtype: str = "keep",
    overwrite: bool = False,
    role: str = "actor",
) -> None:
    """Lay a model out as a training checkpoint (step 0).

    role 'critic' makes a value model: a value model source is copied as is; a causal LM gives its
    backbone to a new value model whose head is initialised with `seed`."""
    if layout not in ("single", "fsdp"):
        raise UserError(
            f"--layout {layout!r} is not available (available: single, fsdp; megatron comes with the Megatron backend)"
        )
    if layout == "fsdp" and is_remote(out):
        raise UserError(f"--out {out}: the fsdp layout is written to local (or mounted) storage only")
    source = resolve_source(path)
    from_value_model = not source.is_gguf and is_value_config(load_config(source))
    if role == "actor" and from_value_model:
        raise UserError(f"{path}: this is a value model; shard it with --role critic")
    if init == "pretrained" and not source.is_gguf and (role == "actor" or from_value_model):
        weights = read_weights(source.path)
        check_weights_match(build_empty_model(load_config(source)), weights, source.path)
        aux = aux_files(source.path)
    else:
        model, tokenizer, aux = load_initial_policy(path, init, seed)
        if role == "critic":
            model, aux = build_critic_files(model, tokenizer, seed)
        weights = model_weights(model)
    meta = CheckpointMeta(
        step=0,
        layout=layout,
        provenance=provenance(
            "rlx shard",
            source.path,
            init=init,
            role=role,
            **({"seed": seed} if init == "random" or role == "critic" else {}),
        ),
    )
    weights, aux = _cast(weights, dtype), _set_config_dtype(aux, dtype)
    if layout == "fsdp":
        save_dcp_checkpoint(out, weights, aux, meta, DistContext(), overwrite=overwrite)
    else:
        save_checkpoint(out, weights=weights, aux=aux, meta=meta, overwrite=overwrite)
    console(f"rlx shard: {len(weights)} tensors, {_count(weights) / 1e6:.1f}M parameters -> {out}")


def merge_checkpoint(checkpoint: str, out: str, dtype: str = "keep", overwrite: bool = False) -> None:
    """Gather a checkpoint back into a plain Hugging Face model dir."""
    folder = resolve_source(checkpoint, "checkpoint").path if is_remote(checkpoint) else Path(checkpoint)
    if not folder.is_dir():
        raise UserError(f"{folder}: checkpoint not found")
    if not is_checkpoint(folder):
        raise UserError(f"{folder}: not an rlx checkpoint (no rlx.json); make one with `rlx shard`")
    CheckpointMeta.read(folder)  # validates format and layout
    weights = _cast(read_full_weights(folder) if is_dcp_checkpoint(folder) else read_weights(folder), dtype)
    aux = _set_config_dtype(aux_files(folder), dtype)
    with atomic_dir(out, overwrite=overwrite, marker="config.json") as tmp:
        for name, data in aux.items():
            (tmp / name).write_bytes(data)
        write_weights(tmp, weights)
    console(f"rlx merge: {len(weights)} tensors, {_count(weights) / 1e6:.1f}M parameters -> {out}")


def _count(weights: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() for t in weights.values())
