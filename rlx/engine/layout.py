"""`rlx shard` / `rlx merge`: HF dir or GGUF <-> rlx checkpoint dir ('single', 'fsdp' or 'megatron' layout).

Weights of an HF dir are copied tensor by tensor as stored (dtype kept; the 'megatron' layout slices
them per tensor x pipeline rank), so shard followed by merge gives back bit-identical tensors and
byte-identical config and tokenizer files.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from rlx.engine.checkpoint import (
    LAYOUTS,
    CheckpointMeta,
    aux_files,
    is_checkpoint,
    provenance,
    read_full_checkpoint_weights,
    save_checkpoint,
    write_weights,
)
from rlx.engine.io import atomic_dir, is_remote
from rlx.engine.parallel.dcp import save_dcp_checkpoint
from rlx.engine.parallel.dist import DistContext
from rlx.engine.tracking import console
from rlx.errors import UserError
from rlx.models.loading import (
    ModelSource,
    build_empty_model,
    check_weights_match,
    load_config,
    resolve_source,
)
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


def _source_files(source: ModelSource, init: str, seed: int, role: str):
    """(weights, aux, config) of the model to lay out: the source's stored tensors, or a model built
    by `load_initial_policy` (random init, GGUF) and turned into a critic for role 'critic'."""
    config = None if source.is_gguf else load_config(source)
    from_value_model = config is not None and is_value_config(config)
    if role == "actor" and from_value_model:
        raise UserError(f"{source.path}: this is a value model; shard it with --role critic")
    if init == "pretrained" and not source.is_gguf and (role == "actor" or from_value_model):
        weights = read_full_checkpoint_weights(source.path)
        check_weights_match(build_empty_model(config), weights, source.path)
        return weights, aux_files(source.path), config
    model, tokenizer, aux = load_initial_policy(source.path, init, seed)
    if role == "critic":
        model, aux = build_critic_files(model, tokenizer, seed)
    return model_weights(model), aux, model.config


def _name_architecture(config, aux: dict[str, bytes]):
    """(config, aux) with `architectures` set: GGUF configs name none, and the megatron layout needs it
    (it picks the model family when the checkpoint is read back)."""
    if getattr(config, "architectures", None):
        return config, aux
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = copy.deepcopy(config)
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, type(config).__name__)]
    if "config.json" in aux:
        data = {**json.loads(aux["config.json"]), "architectures": config.architectures}
        aux = {**aux, "config.json": (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()}
    return config, aux


def _check_layout(layout: str, out: str, tp_degree: int | None, pp_degree: int | None) -> None:
    if layout not in LAYOUTS:
        raise UserError(f"--layout {layout!r} is not available (available: {', '.join(LAYOUTS)})")
    if layout == "fsdp" and is_remote(out):
        raise UserError(f"--out {out}: the fsdp layout is written to local (or mounted) storage only")
    if layout != "megatron" and (tp_degree is not None or pp_degree is not None):
        raise UserError(f"--tp and --pp apply to --layout megatron only (got --layout {layout})")


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
    _check_layout(layout, out, tp_degree, pp_degree)
    tp, pp = 1 if tp_degree is None else tp_degree, 1 if pp_degree is None else pp_degree
    source = resolve_source(path)
    if layout == "megatron":
        from rlx.models.megatron.model import check_supported

        check_supported(_name_architecture(load_config(source), {})[0], tp, pp, where=str(path))  # fail early
    weights, aux, config = _source_files(source, init, seed, role)
    if layout == "megatron":
        config, aux = _name_architecture(config, aux)
    meta = CheckpointMeta(
        step=0,
        layout=layout,
        **({"tp_degree": tp, "pp_degree": pp} if layout == "megatron" else {}),
        provenance=provenance(
            "rlx shard",
            source.path,
            init=init,
            role=role,
            **({"seed": seed} if init == "random" or role == "critic" else {}),
        ),
    )
    weights, aux = _cast(weights, dtype), _set_config_dtype(aux, dtype)
    _save(out, weights, aux, meta, config, overwrite)
    grid = f", tp {tp} x pp {pp}" if layout == "megatron" else ""
    console(f"rlx shard: {len(weights)} tensors, {_count(weights) / 1e6:.1f}M parameters{grid} -> {out}")


def _save(
    out: str, weights: dict[str, torch.Tensor], aux: dict[str, bytes], meta: CheckpointMeta, config, overwrite: bool
):
    """Write a step-0 checkpoint in `meta.layout` from one process."""
    if meta.layout == "megatron":
        from rlx.engine.megatron.checkpoint import save_megatron_checkpoint
        from rlx.models.megatron.convert import hf_to_megatron

        shards = hf_to_megatron(weights, config, meta.tp_degree, meta.pp_degree)
        save_megatron_checkpoint(out, shards, aux, meta, overwrite=overwrite)
    elif meta.layout == "fsdp":
        save_dcp_checkpoint(out, weights, aux, meta, DistContext(), overwrite=overwrite)
    else:
        save_checkpoint(out, weights=weights, aux=aux, meta=meta, overwrite=overwrite)


def merge_checkpoint(checkpoint: str, out: str, dtype: str = "keep", overwrite: bool = False) -> None:
    """Gather a checkpoint (any layout) back into a plain Hugging Face model dir."""
    folder = resolve_source(checkpoint, "checkpoint").path if is_remote(checkpoint) else Path(checkpoint)
    if not folder.is_dir():
        raise UserError(f"{folder}: checkpoint not found")
    if not is_checkpoint(folder):
        raise UserError(f"{folder}: not an rlx checkpoint (no rlx.json); make one with `rlx shard`")
    CheckpointMeta.read(folder)  # validates format and layout
    weights = _cast(read_full_checkpoint_weights(folder), dtype)
    aux = _set_config_dtype(aux_files(folder), dtype)
    with atomic_dir(out, overwrite=overwrite, marker="config.json") as tmp:
        for name, data in aux.items():
            (tmp / name).write_bytes(data)
        write_weights(tmp, weights)
    console(f"rlx merge: {len(weights)} tensors, {_count(weights) / 1e6:.1f}M parameters -> {out}")


def _count(weights: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() for t in weights.values())
