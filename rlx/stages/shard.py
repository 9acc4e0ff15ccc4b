"""`rlx shard` / `rlx merge`: HF dir or GGUF <-> rlx checkpoint dir, in any registered layout.

Weights of an HF dir are copied tensor by tensor as stored (dtype kept; a sharded layout cuts them into its
shards), so shard followed by merge gives back bit-identical tensors and byte-identical config and tokenizer
files. config.json's dtype is rewritten only where the weights are written in another one (a cast, a random init, a
trained checkpoint's float32 master weights): it always names the dtype of the weights beside it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlx.checkpoints import catalog
from rlx.checkpoints.base import ShardOptions
from rlx.checkpoints.files import aux_files, with_config_dtype, write_aux, write_weights
from rlx.checkpoints.loading import build_critic_files, load_initial_policy, load_model
from rlx.checkpoints.meta import META_NAME, CheckpointMeta, is_checkpoint, provenance
from rlx.checkpoints.registry import get_layout, layout_names, read_full_weights, read_lora, read_meta
from rlx.errors import UserError
from rlx.models.hub_layout import hub_weights
from rlx.models.loading import (
    ModelSource,
    build_empty_model,
    check_weights_match,
    has_tokenizer_files,
    hub_model,
    resolve_model,
    resolve_source,
)
from rlx.models.lora_config import LoraConfig
from rlx.models.value import is_value_config
from rlx.observe.tracking import console
from rlx.parallel.fsdp import model_weights
from rlx.utils.files import check_writable
from rlx.utils.io import atomic_dir, exists, is_remote


def check_new_output(out: str, overwrite: bool, source: str | Path | None = None) -> None:
    """Refuse an existing output folder (without --overwrite), one that cannot be written, or one that is the
    input `source` or a folder holding it (replacing it would delete what it is made from), before any work."""
    if source is not None and not is_remote(out) and not is_remote(source):
        target, given = Path(out).resolve(), Path(source).resolve()
        if target == given or target in given.parents:
            raise UserError(
                f"--out {out}: it holds the input {source}, which writing it would delete (--overwrite replaces the "
                "whole folder); choose another --out"
            )
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


def _source_files(source: ModelSource, config, init: str, seed: int, role: str):
    """(weights, aux, config) of the model to lay out (`config`: the source's): the source's stored tensors, or a
    model built by `load_initial_policy` (random init, GGUF) and turned into a critic for role 'critic'."""
    from_value_model = not source.is_gguf and is_value_config(config)
    if role == "actor" and from_value_model:
        raise UserError(f"{source.path}: this is a value model; shard it with --role critic")
    if init == "pretrained" and not source.is_gguf and (role == "actor" or from_value_model):
        weights = read_full_weights(source.path, config)
        check_weights_match(build_empty_model(config), weights, source.path)
        return weights, aux_files(source.path), config
    model, aux = _source_model(source, config, init, seed, role, from_value_model=False)
    return model_weights(model), aux, model.config


def _source_model(source: ModelSource, config, init: str, seed: int, role: str, from_value_model: bool):
    """(model float32 on CPU, aux files) to lay out: a value model source as it is, else the policy
    (`load_initial_policy`), turned into a critic with a head seeded by `seed` for role 'critic'."""
    if from_value_model:
        return load_model(source, "critic", config=config), aux_files(source.folder)
    model, tokenizer, aux = load_initial_policy(source, init, seed, config)
    if role == "critic":
        model, aux = build_critic_files(model, tokenizer, seed, aux)
    return model, aux


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
    lora: LoraConfig | None = None,
) -> None:
    """Lay a model out as a training checkpoint (step 0).

    role 'critic' makes a value model: a value model source is copied as is; a causal LM gives its
    backbone to a new value model whose head is initialised with `seed`. The 'megatron' layout cuts
    the weights into `tp_degree` x `pp_degree` rank states (1 x 1 by default). With `lora` (or the
    'lora' layout) the checkpoint holds adapters initialised with `seed` on the model as its base."""
    if lora is not None and layout not in (catalog.DEFAULT, catalog.LORA):
        raise UserError(f"--layout {layout}: the LoRA options make a checkpoint in the 'lora' layout")
    if lora is not None or layout == catalog.LORA:
        _check_options(ShardOptions(tp_degree, pp_degree), get_layout(catalog.LORA))
        return _shard_lora(path, out, lora or LoraConfig(), init, seed, dtype, overwrite, role)
    target = get_layout(layout)
    check_new_output(out, overwrite, path)
    target.check_output(out)
    options = ShardOptions(tp_degree, pp_degree)
    _check_options(options, target)
    fields = target.shard_fields(options)
    source, config = resolve_model(path)  # a GGUF file's config is converted once and kept for its loaders
    target.check_model(config, fields, str(path))  # fail before the weights are read
    _note_missing_tokenizer(source)
    weights, aux, config = _source_files(source, config, init, seed, role)
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
    weights = _cast(weights, dtype)
    aux = with_config_dtype(aux, weights, add=dtype != "keep")  # a cast is recorded so that loaders pick it
    target.write_full(out, weights, aux, meta, config, overwrite)
    grid = " x ".join(f"{k.removesuffix('_degree')} {v}" for k, v in fields.items())
    grid = f", {grid}" if grid else ""
    console(f"rlx shard: {len(weights)} tensors, {_count(weights) / 1e6:.1f}M parameters{grid} -> {out}")


def _shard_lora(path: str, out: str, lora: LoraConfig, init: str, seed: int, dtype: str, overwrite: bool,
                role: str) -> None:  # fmt: skip
    """A step-0 'lora' checkpoint: adapters (initialised with `seed`) and a pointer to the model as their base."""
    from rlx.checkpoints.lora import write_lora_files
    from rlx.checkpoints.lora_base import lora_spec
    from rlx.models.lora import apply_lora
    from rlx.models.lora_state import adapter_state

    if dtype != "keep":
        raise UserError(f"--dtype {dtype}: a LoRA checkpoint stores float32 adapters (the base stays where it is)")
    check_new_output(out, overwrite, path)  # the checkpoint points at `path` as its base
    source, config = resolve_model(path)
    from_value_model = not source.is_gguf and is_value_config(config)
    if role == "actor" and from_value_model:
        raise UserError(f"{source.path}: this is a value model; shard it with --role critic")
    model, aux = _source_model(source, config, init, seed, role, from_value_model and init == "pretrained")
    spec = lora_spec(lora, path, init, seed, model, role)
    apply_lora(model, lora, torch.float32, seed)
    tensors = adapter_state(model)
    details = {"init": init, "role": role, "seed": seed}
    meta = CheckpointMeta(step=0, layout=catalog.LORA, provenance=provenance("rlx shard", source.path, **details))
    with atomic_dir(out, overwrite=overwrite, marker=META_NAME) as tmp:
        write_lora_files(tmp, spec, aux, tensors, None, meta)
    console(
        f"rlx shard: LoRA rank {lora.rank} on {len(tensors) // 2} layers, {_count(tensors) / 1e6:.2f}M trained "
        f"parameters (base {_count(dict(model.named_parameters())) / 1e6:.1f}M) -> {out}"
    )


def _check_options(options: ShardOptions, target) -> None:
    """Options the target layout does not take name the layouts that do."""
    given = [name for name, value in vars(options).items() if value is not None and name not in target.shard_options]
    if given:
        takers = [name for name in layout_names() if set(given) <= set(get_layout(name).shard_options)]
        flags = " and ".join(f"--{name.removesuffix('_degree')}" for name in given)
        verb = "apply" if len(given) > 1 else "applies"
        raise UserError(f"{flags} {verb} to --layout {' / '.join(takers)} only (got --layout {target.name})")


def _note_missing_tokenizer(source) -> None:
    """A model folder without tokenizer files shards (a value model's weights may come alone), but every command
    that reads text from the checkpoint will need them: say so now."""
    if not source.is_gguf and not has_tokenizer_files(source.folder):
        console(f"rlx shard: note: {source.path} has no tokenizer files; rollout, score, eval and ppo of the "
                "checkpoint will need them (copy them in from the model it was made from)")  # fmt: skip


def merge_checkpoint(
    checkpoint: str, out: str, dtype: str = "keep", overwrite: bool = False, adapter_only: bool = False
) -> None:
    """Gather a checkpoint (any layout) back into a plain Hugging Face model dir; with `adapter_only`, write a
    LoRA checkpoint's adapters as a PEFT adapter folder instead."""
    folder = resolve_source(checkpoint, "checkpoint").path if is_remote(checkpoint) else Path(checkpoint)
    if not folder.is_dir():
        raise UserError(f"{folder}: checkpoint not found")
    if not is_checkpoint(folder):
        raise UserError(f"{folder}: not an rlx checkpoint (no rlx.json); make one with `rlx shard`")
    meta = read_meta(folder)  # validates format and layout
    check_new_output(out, overwrite, folder)
    if adapter_only:
        return _merge_adapters(folder, meta, out, dtype, overwrite)
    config = resolve_model(folder, "checkpoint")[1]  # a remote checkpoint: its local copy
    weights = hub_weights(_cast(read_full_weights(folder, config), dtype), hub_model(config))  # as save_pretrained
    aux = with_config_dtype(aux_files(folder), weights, add=dtype != "keep")  # also mends an older rlx's checkpoint
    with atomic_dir(out, overwrite=overwrite, marker="config.json") as tmp:
        write_aux(tmp, aux)
        write_weights(tmp, weights)
    console(f"rlx merge: {len(weights)} tensors, {_count(weights) / 1e6:.1f}M parameters -> {out}")


def _merge_adapters(folder: Path, meta: CheckpointMeta, out: str, dtype: str, overwrite: bool) -> None:
    """A LoRA checkpoint's adapters as a PEFT folder (adapter_config.json, adapter_model.safetensors)."""
    from rlx.models.lora_merge import save_peft_adapter

    lora = read_lora(folder)
    if lora is None:
        raise UserError(
            f"--adapter-only: {folder} holds full weights (layout '{meta.layout}'), no adapters; "
            f"merge it without --adapter-only"
        )
    if dtype != "keep":
        raise UserError(f"--dtype {dtype}: --adapter-only writes the adapters as they are stored (float32)")
    model = lora.build_model()  # PEFT's config comes from the adapted model; the base is checked on the way
    tensors = lora.tensors()
    with atomic_dir(out, overwrite=overwrite, marker="adapter_config.json") as tmp:
        save_peft_adapter(model, tmp, base_model_name_or_path=lora.spec.base.path, tensors=tensors)
    console(f"rlx merge: adapters of {len(tensors) // 2} layers (PEFT folder) -> {out}")


def _count(weights: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() for t in weights.values())
