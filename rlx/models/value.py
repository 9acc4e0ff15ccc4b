"""Value models (critics): a causal-LM backbone with a scalar head per token.

A value model is a Hugging Face `*ForTokenClassification` model with `num_labels = 1` and no
classifier dropout, so it saves, loads, shards and merges like any HF model. `build_value_model`
makes one from a policy: the backbone weights are copied, the head is initialised with a seed.
"""

from __future__ import annotations

import copy

import torch

from rlx.engine.device import autocast
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


def load_value_model(source: ModelSource, dtype: torch.dtype = torch.float32):
    """Load a value model; a plain causal LM is a clear error (make a critic with `rlx shard --role critic`)."""
    from transformers import AutoModelForTokenClassification

    quiet_transformers()
    if not is_value_config(load_config(source)):
        raise UserError(
            f"{source.path}: not a value model (expected a *ForTokenClassification config with "
            f"num_labels = 1); make one with `rlx shard --role critic --model POLICY`"
        )
    from rlx.engine.checkpoint import is_sharded_checkpoint
    from rlx.models.loading import load_from_sharded_checkpoint

    if is_sharded_checkpoint(source.path):  # 'fsdp' or 'megatron' layout
        return load_from_sharded_checkpoint(AutoModelForTokenClassification, source, dtype)
    try:
        return AutoModelForTokenClassification.from_pretrained(source.folder, dtype=dtype)
    except (OSError, ValueError, RuntimeError) as e:
        raise UserError(f"{source.path}: cannot load the value model ({str(e).splitlines()[0]})") from None


def response_values(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """V(s_t) for each response token t: the head's output at the position before t.  -> [B, R] float32.

    Same alignment as the logprobs (verl: values = output[:, -R - 1:-1]).
    """
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).long()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    r = response_ids.shape[1]
    with autocast(input_ids.device, dtype):
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    return logits[:, -r - 1 : -1, 0].float()


def packed_response_values(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    dtype: torch.dtype,
    sp_group=None,
    rows=None,
) -> torch.Tensor:
    """As `response_values`, with the micro-batch run as one packed row (sliced over `sp_group`; `rows`:
    its PackedRows built beforehand)."""
    from rlx.engine.logprobs import PackedRows, packed_model_inputs, unpack_responses
    from rlx.engine.parallel.ulysses import group_rank_size

    if rows is None:
        rows = PackedRows.build(prompt_ids, prompt_mask, response_ids, response_mask, *group_rank_size(sp_group))
    with autocast(prompt_ids.device, dtype):
        logits = model(**packed_model_inputs(rows, sp_group)).logits  # [1, T_pad/sp, 1]
    return unpack_responses(logits[0, :, 0], rows, response_ids.shape, sp_group)
