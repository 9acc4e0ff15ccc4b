"""Value models (critics): a causal-LM backbone with a scalar head per token.

A value model is a Hugging Face `*ForTokenClassification` model with `num_labels = 1` and no
classifier dropout, so it saves, loads, shards and merges like any HF model. `build_value_model`
makes one from a policy: the backbone weights are copied, the head is initialised with a seed. A vision-language
policy's critic is rlx's own class of that shape (`rlx.models.vision.value`): its backbone holds the vision tower, so
its values see the images; `rlx.models.loading.model_class(config, 'critic')` picks the class for a config.
"""

from __future__ import annotations

import contextlib
import copy

import torch

from rlx.errors import UserError
from rlx.models.loading import ModelSource, model_class, quiet_transformers
from rlx.models.vision.families import is_vision_config, vision_family_of
from rlx.models.vision.value import value_architecture


def value_config(config):
    """The config of a value model with `config`'s backbone."""
    out = copy.deepcopy(config)
    out.num_labels = 1
    out.classifier_dropout = 0.0
    if is_vision_config(config):
        out.architectures = [value_architecture(vision_family_of(config))]
        return out
    base = config.architectures[0] if getattr(config, "architectures", None) else type(config).__name__
    family = base.replace("ForCausalLM", "").replace("ForTokenClassification", "").replace("Config", "")
    out.architectures = [f"{family}ForTokenClassification"]
    return out


def is_value_config(config) -> bool:
    archs = getattr(config, "architectures", None) or []
    return any(a.endswith("ForTokenClassification") for a in archs) and getattr(config, "num_labels", 0) == 1


def build_value_model(policy: torch.nn.Module, seed: int, unfilled: bool = False) -> torch.nn.Module:
    """A value model whose backbone is a copy of `policy`'s (a vision-language policy's: its vision tower and
    decoder) and whose head is freshly initialised; `unfilled`: its weights neither copied nor drawn (the memory as
    allocated), for a rank whose shards are filled from another's afterwards (rlx/ppo/models.py)."""
    from transformers.initialization import no_init_weights

    quiet_transformers()
    config = value_config(policy.config)
    cls = model_class(config, "critic")
    with torch.random.fork_rng(devices=[]), no_init_weights() if unfilled else contextlib.nullcontext():
        torch.manual_seed(seed)
        try:
            model = cls.from_config(config, dtype=torch.float32)
        except ValueError as e:
            raise UserError(
                f"{type(policy).__name__}: transformers has no token-classification head for this "
                f"model family, so it cannot be a critic ({e})"
            ) from None
    if not unfilled:
        backbone = getattr(model, model.base_model_prefix)
        backbone.load_state_dict(getattr(policy, policy.base_model_prefix).state_dict())
    return model


def check_value_config(config, where) -> None:
    """A plain causal LM where a value model is expected is a clear error."""
    if not is_value_config(config):
        raise UserError(
            f"{where}: not a value model (expected a *ForTokenClassification config with "
            f"num_labels = 1); make one with `rlx shard --role critic --model POLICY`"
        )


def load_value_model(source: ModelSource, config, dtype: torch.dtype = torch.float32):
    """Load a value model from a Hugging Face dir (see `check_value_config`); `config`: the source's config, read
    by the caller (the model gets a copy)."""
    quiet_transformers()
    config = copy.deepcopy(config)
    check_value_config(config, source.path)
    try:
        model, info = model_class(config, "critic").from_pretrained(
            source.folder, config=config, dtype=dtype, output_loading_info=True
        )
    except (OSError, ValueError, RuntimeError) as e:
        raise UserError(f"{source.path}: cannot load the value model ({str(e).splitlines()[0]})") from None
    if is_vision_config(config) and info.get("missing_keys"):  # rlx's own class: nothing may be left at random
        raise UserError(f"{source.path}: value model weights are missing {', '.join(sorted(info['missing_keys'])[:3])}")
    return model
