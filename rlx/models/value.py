"""Value models (critics): a causal-LM backbone with a scalar head per token.

A value model is a Hugging Face `*ForTokenClassification` model with `num_labels = 1` and no
classifier dropout, so it saves, loads, shards and merges like any HF model. `build_value_model`
makes one from a policy: the backbone weights are copied, the head is initialised with a seed.
"""

from __future__ import annotations

import copy

import torch

from rlx.errors import UserError
from rlx.models.loading import ModelSource, load_config, quiet_transformers


def value_config(config):
    """The config of a value model with `config`'s backbone."""
    out = copy.deepcopy(config)
    out.num_labels = 1
    out.classifier_dropout = 0.0
    base = config.architectures[0] if getattr(config, "architectures", None) else type(config).__name__
    family = base.replace("ForCausalLM", "").replace("ForTokenClassification", "").replace("Config", "")
    out.architectures = [f"{family}ForTokenClassification"]
    return out


def is_value_config(config) -> bool:
    archs = getattr(config, "architectures", None) or []
    return any(a.endswith("ForTokenClassification") for a in archs) and getattr(config, "num_labels", 0) == 1


def build_value_model(policy: torch.nn.Module, seed: int) -> torch.nn.Module:
    """A value model whose backbone is a copy of `policy`'s and whose head is freshly initialised."""
    from transformers import AutoModelForTokenClassification

    quiet_transformers()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = AutoModelForTokenClassification.from_config(value_config(policy.config), dtype=torch.float32)
        except ValueError as e:
            raise UserError(
                f"{type(policy).__name__}: transformers has no token-classification head for this "
                f"model family, so it cannot be a critic ({e})"
            ) from None
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


def load_value_model(source: ModelSource, dtype: torch.dtype = torch.float32):
    """Load a value model from a Hugging Face dir (see `check_value_config`)."""
    from transformers import AutoModelForTokenClassification

    quiet_transformers()
    check_value_config(load_config(source), source.path)
    try:
        return AutoModelForTokenClassification.from_pretrained(source.folder, dtype=dtype)
    except (OSError, ValueError, RuntimeError) as e:
        raise UserError(f"{source.path}: cannot load the value model ({str(e).splitlines()[0]})") from None
