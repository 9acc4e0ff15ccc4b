"""The files every layout shares: config/tokenizer files byte for byte, Hugging Face weight files, optimizer
state as named tensors.

    CKPT/
      rlx.json                   layout, step, data position, optimizer hyper-parameters, provenance
      config.json, tokenizer...  copied byte for byte from the source model dir
      model.safetensors          weights with Hugging Face names (sharded + index when large): 'single' layout
      optimizer.safetensors      optimizer state per parameter name (after a train step): 'single' layout
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path

import torch

from rlx.checkpoints.meta import META_NAME
from rlx.models.loading import WEIGHTS_INDEX_NAME, WEIGHTS_NAME, read_safetensors
from rlx.utils.files import apply_umask
from rlx.utils.tensor_files import save_tensors

OPTIMIZER_NAME = "optimizer.safetensors"
MAX_SHARD_SIZE = "5GB"
_NOT_AUX = {META_NAME, OPTIMIZER_NAME, WEIGHTS_INDEX_NAME, "lora.json"}  # lora.json: a LoRA checkpoint's own
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".h5", ".msgpack", ".onnx", ".ckpt")
"""Weight files of any format a hub model dir may hold (PyTorch, TensorFlow, Flax, ONNX...): never copied as aux, so
a checkpoint never carries the source's weights in another format (stale once trained) or an index naming them."""


def is_weight_file(name: str) -> bool:
    """Whether a file name is weights or a weight index (`pytorch_model.bin.index.json`, `tf_model.h5.index.json`)."""
    return Path(name.removesuffix(".index.json")).suffix in WEIGHT_SUFFIXES


def aux_files(folder: Path) -> dict[str, bytes]:
    """Top-level non-weight files of a model dir (config, tokenizer, templates), as bytes."""
    out = {}
    for path in sorted(Path(folder).iterdir()):
        if (
            path.is_file()
            and path.name not in _NOT_AUX
            and not path.name.startswith(".")
            and not is_weight_file(path.name)
        ):
            out[path.name] = path.read_bytes()
    return out


def generated_aux(model, tokenizer) -> dict[str, bytes]:
    """config.json, generation_config.json and tokenizer files written by transformers, as bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        model.config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        return aux_files(Path(tmp))


def write_aux(folder: Path, aux: dict[str, bytes]) -> None:
    """Write config, tokenizer and other non-weight files byte for byte."""
    for name, data in aux.items():
        (folder / name).write_bytes(data)


CONFIG_DTYPE_KEYS = ("dtype", "torch_dtype")
"""Where config.json records the weights' dtype: transformers 5 writes 'dtype', older versions 'torch_dtype'."""


def stored_dtype(tensors) -> torch.dtype | None:
    """The floating-point dtype holding most elements of `tensors` (a dict of tensors or DTensors; other values, such
    as megatron's extra states, are skipped): the one dtype config.json records, as save_pretrained records the
    model's; None without floating-point tensors."""
    counts = Counter()
    for tensor in tensors.values():
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
            counts[tensor.dtype] += tensor.numel()
    return counts.most_common(1)[0][0] if counts else None


def with_config_dtype(aux: dict[str, bytes], tensors, add: bool = False) -> dict[str, bytes]:
    """`aux` with config.json saying the dtype the weights `tensors` are written in (a trainer's float32 master
    weights of a bfloat16 model, a cast), under each key of CONFIG_DTYPE_KEYS it has, in its sub-configs too
    (text_config, ...); with `add`, under 'dtype' where the top level has neither. The bytes are kept where it already
    agrees or records no dtype (loaders then take the weights')."""
    dtype = stored_dtype(tensors)
    if dtype is None or "config.json" not in aux:
        return aux
    config = json.loads(aux["config.json"])
    name = str(dtype).removeprefix("torch.")
    if add and not any(key in config for key in CONFIG_DTYPE_KEYS):
        config["dtype"] = None
    tables = [config, *(value for value in config.values() if isinstance(value, dict))]
    found = [(table, key) for table in tables for key in CONFIG_DTYPE_KEYS if key in table]
    if all(table[key] == name for table, key in found):
        return aux
    for table, key in found:
        table[key] = name
    return {**aux, "config.json": (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()}


def write_weights(folder: Path, state: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> None:
    """Write weights in the Hugging Face layout: one file, or shards plus an index past MAX_SHARD_SIZE."""
    from huggingface_hub import split_torch_state_dict_into_shards

    tensors = {
        k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().cpu().contiguous()
        for k, v in state.items()
    }
    split = split_torch_state_dict_into_shards(
        tensors, filename_pattern="model{suffix}.safetensors", max_shard_size=MAX_SHARD_SIZE
    )
    for filename, keys in split.filename_to_tensors.items():
        save_tensors({k: tensors[k] for k in keys}, folder / filename, metadata={"format": "pt"})
        apply_umask(folder / filename)  # safetensors makes its files 0600
    if split.is_sharded:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
            "weight_map": split.tensor_to_filename,
        }
        (folder / WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    else:
        assert list(split.filename_to_tensors) == [WEIGHTS_NAME]


def write_optimizer_state(folder: Path, state: dict[str, torch.Tensor]) -> None:
    """Write optimizer tensors keyed '<param>::<state key>' to OPTIMIZER_NAME."""
    save_tensors(
        {k: v.detach().cpu().contiguous() for k, v in state.items()},
        folder / OPTIMIZER_NAME,
        metadata={"format": "rlx-optimizer"},
    )
    apply_umask(folder / OPTIMIZER_NAME)


def read_optimizer_state(folder: Path) -> dict[str, torch.Tensor] | None:
    """The folder's optimizer.safetensors, or None when it has none."""
    path = Path(folder) / OPTIMIZER_NAME
    return read_safetensors(path) if path.is_file() else None
