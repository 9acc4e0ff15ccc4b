"""Value models (critics) of vision-language models: the family's backbone (vision tower + decoder) with a scalar
head per token.

transformers has no token-classification class for the vision-language families, so rlx builds one per family from
two pieces transformers does have: the family's backbone (`Qwen2VLModel`, `Glm4vModel`, ..., what the policy's
`...ForConditionalGeneration` holds as `model`) and the family's `PreTrainedModel` base (its weight init, attention
and checkpointing flags). The result is named like transformers' text critics (`Qwen2VLForTokenClassification`),
holds `model.*` (the policy's backbone weights, under the same names) and `score.*` (the [1, H] head, with bias, as
`Qwen2ForTokenClassification`), and saves, loads, shards and merges like any Hugging Face model (load it with
`vision_value_class(config).from_pretrained(dir)`; `AutoModelForTokenClassification` does not know it).

Its forward is the backbone's: given `pixel_values` and `image_grid_thw` it runs the tower and computes its own 3-D
positions (transformers' path); rlx's scoring and training drive it through `rlx.models.vision.packing.vision_forward`
instead, exactly as they drive the policy, so the values see the images in padded and packed rows alike.
"""

from __future__ import annotations

import torch

from rlx.errors import UserError
from rlx.models.vision.families import VisionFamily, vision_family_of

_CLASSES: dict[str, type] = {}


def value_architecture(family: VisionFamily) -> str:
    """The class (and config `architectures`) name of the family's value model, e.g. 'Qwen2VLForTokenClassification'."""
    return family.model_class.replace("ForConditionalGeneration", "ForTokenClassification")


class _VisionValueModel:
    """The family-independent part of a vision-language value model (mixed into the family's PreTrainedModel)."""

    backbone_class: type
    """The family's backbone (set per family by `vision_value_class`)."""

    def __init__(self, config):
        super().__init__(config)
        self.num_labels = 1
        self.model = self.backbone_class(config)
        self.score = torch.nn.Linear(config.get_text_config().hidden_size, 1)
        self.post_init()

    @classmethod
    def from_config(cls, config, **kwargs):
        """A fresh model of `config` (as transformers' auto classes' `from_config`: `dtype` etc. in kwargs)."""
        return cls._from_config(config, **kwargs)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, **kwargs):
        """Per-token values: `logits` [B, T, 1] of the backbone's last hidden states (kwargs: the backbone's, e.g.
        `pixel_values`, `image_grid_thw`, or rlx's packed-attention arguments)."""
        from transformers.modeling_outputs import TokenClassifierOutput

        kwargs.pop("use_cache", None)
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            inputs_embeds=inputs_embeds, use_cache=False, **kwargs,
        )  # fmt: skip
        return TokenClassifierOutput(logits=self.score(out.last_hidden_state))


def _pretrained_base(family: VisionFamily) -> type:
    """The family's own PreTrainedModel subclass (e.g. Qwen2VLPreTrainedModel), base of its policy class."""
    from transformers import PreTrainedModel

    for base in family.load_model_class().__mro__[1:]:
        if issubclass(base, PreTrainedModel) and base is not PreTrainedModel:
            return base
    raise UserError(f"{family.title}: transformers has no PreTrainedModel base for it, so rlx cannot build a critic")


def _backbone_class(family: VisionFamily, config) -> type:
    """The family's backbone class (vision tower + decoder without the LM head)."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    try:
        return MODEL_MAPPING[type(config)]
    except KeyError:
        raise UserError(
            f"{family.title} ({family.model_type}): transformers has no backbone class for it, so rlx cannot build a "
            f"value model (critic) of it"
        ) from None


def vision_value_class(config) -> type:
    """The value-model class of `config`'s vision-language family (built once per family); UserError naming the
    family when rlx cannot build one."""
    family = vision_family_of(config)
    if family.name not in _CLASSES:
        policy = family.load_model_class()
        attrs = {
            "__module__": __name__,
            "__doc__": f"{family.title} value model: backbone + scalar head per token.",
            "backbone_class": _backbone_class(family, config),
            # transformers decides whether attention / MoE experts can be switched by reading the class's module
            # source (this module has no attention layer nor experts): the answers are the policy class's
            "_can_set_attn_implementation_cached_value": policy._can_set_attn_implementation(),
            "_can_set_experts_implementation_cached_value": policy._can_set_experts_implementation(),
        }
        _CLASSES[family.name] = type(value_architecture(family), (_VisionValueModel, _pretrained_base(family)), attrs)
    return _CLASSES[family.name]
