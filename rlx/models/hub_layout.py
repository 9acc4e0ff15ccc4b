"""A model folder's weights as transformers writes them (the hub's layout) against the module's own names.

transformers renames and reshapes weights between the files and the module's parameters with its conversion
mapping (`transformers.conversion_mapping`, applied by `from_pretrained` and reversed by `save_pretrained`):
- mixture-of-experts models keep one tensor per expert in their files (`mlp.experts.N.gate_proj.weight`, Mixtral's
  `block_sparse_moe.experts.N.w1.weight`) for the module's fused `mlp.experts.gate_up_proj` [E, 2I, H] and
  `down_proj` [E, H, I] (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, and GLM-4.5V's decoder);
- Qwen2-VL and Qwen2.5-VL keep their legacy names (`model.layers.*`, `model.embed_tokens.*`, `visual.*`) for the
  module's `model.language_model.*` and `model.visual.*` (the hub's Qwen2-VL-2B-Instruct files are named so, and
  transformers 5.17 still saves them so).
rlx applies the same mapping, looked up as transformers looks it up (the model's class, then the model type of it
and of each sub-model, scoped to the sub-model's prefix): in, every model folder's weights to the module's names
(`read_weights`); out, `rlx merge` writes what `save_pretrained` writes. Both directions only rename, stack and
split tensors, so shard -> merge is bit-exact, and weights already in the module's layout pass unchanged.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from rlx.errors import UserError

WeightDict = dict[str, torch.Tensor]


def converts(model_type: str | None) -> bool:
    """Whether models of this type have weights transformers renames or reshapes (rlx's MoE and vision families);
    the text families' files hold the module's names, and no model is built to find out."""
    from rlx.models.moe import MOE_FAMILIES
    from rlx.models.vision.families import FAMILIES

    return model_type in MOE_FAMILIES or model_type in FAMILIES


def folder_config(folder: Path):
    """The transformers config of a model folder whose weights may need converting, else None (no config.json, or
    a family whose files hold the module's names)."""
    path = Path(folder) / "config.json"
    try:
        model_type = json.loads(path.read_text()).get("model_type") if path.is_file() else None
    except (json.JSONDecodeError, AttributeError, UnicodeDecodeError):
        return None
    if not converts(model_type):
        return None
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(folder))


def converting_config(config):
    """`config` where its model's weights may need converting, else None (no config, or a family whose files hold
    the module's names): the callers build the model on the meta device only then."""
    return config if config is not None and converts(getattr(config, "model_type", None)) else None


def _transforms(model: torch.nn.Module, reverse: bool) -> list:
    """transformers' weight transforms for `model` (files -> module; reversed: module -> files)."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    transforms = get_model_conversion_mapping(model, add_legacy=False)
    return [t.reverse_transform() for t in transforms[::-1]] if reverse else transforms


def module_weights(weights: WeightDict, model: torch.nn.Module | None, where: str = "") -> WeightDict:
    """`weights` with the module's names and shapes (as `from_pretrained` loads them into `model`, built on the meta
    device; None: as is). `where`: the folder they came from, for the error of a tensor that cannot be made."""
    if model is None:
        return weights
    return _apply(weights, _transforms(model, reverse=False), model, reverse=False, where=f"{where}: " if where else "")


def hub_weights(weights: WeightDict, model: torch.nn.Module | None) -> WeightDict:
    """The module's `weights` in the layout `save_pretrained` of `model` writes (None: as is)."""
    if model is None:
        return weights
    return _apply(weights, _transforms(model, reverse=True), model, reverse=True)


def _apply(weights: WeightDict, transforms: list, model: torch.nn.Module, reverse: bool, where: str = "") -> WeightDict:
    """Run transformers' weight transforms over a flat state dict as its loader does: rename each key (every
    renaming, then at most one converter; reversed: the converter first), gather the keys one converter merges
    (experts in natural order: 0, 1, ..., 10) and convert each group (`model`: the meta model a transform may
    read a parameter's shape from). Keys no transform matches pass."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key

    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    if not converters and not renamings:
        return dict(weights)
    groups, out = {}, {}
    for key in sorted(weights, key=dot_natural_key):
        target, converter, pattern = _rename(key, renamings, converters, reverse)
        if converter is None:
            out[target] = weights[key]
            continue
        group = groups.setdefault(target, copy.deepcopy(converter))
        group.add_tensor(target, key, pattern, weights[key])
    for target, converter in groups.items():
        try:
            converted = converter.convert(target, model=model, config=model.config)
        except (RuntimeError, ValueError, KeyError, IndexError) as e:  # e.g. one expert's tensor missing
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            sources = ", ".join(sorted(converter.source_patterns))
            raise UserError(f"{where}{target}: cannot make it from the stored {sources} tensors ({first})") from None
        for name, tensor in converted.items():
            out[name] = tensor[0] if isinstance(tensor, list) else tensor
    return out


def _rename(key: str, renamings: list, converters: list, reverse: bool):
    """(new key, the converter that takes it or None, its matched source pattern): transformers'
    `rename_source_key`, which returns the pattern but not which converter (two sub-models may hold the same one)."""
    converter = pattern = None
    if not reverse:
        for renaming in renamings:
            key, _ = renaming.rename_source_key(key)
    for candidate in converters:
        key, pattern = candidate.rename_source_key(key)
        if pattern is not None:
            converter = candidate
            break
    if reverse:
        for renaming in renamings:
            key, _ = renaming.rename_source_key(key)
    return key, converter, pattern
