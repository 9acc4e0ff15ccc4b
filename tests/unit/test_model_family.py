"""Model-family bundles: `family_of` gives every config a bundle, text and vision-language ones answer the questions
the stages ask (tower freeze, FSDP units, attention scope) the way the model needs."""

from __future__ import annotations

import pytest
import torch

from rlx.errors import UserError
from rlx.models.bundle import TEXT_FAMILY, ModelFamily
from rlx.models.family import family_of
from rlx.models.tiny import tiny_llama_config
from rlx.models.vision.families import VisionFamily
from rlx.models.vision.tiny import tiny_vision_config


def test_text_configs_get_the_text_family():
    from transformers import AutoModelForCausalLM

    config = tiny_llama_config(64)
    family = family_of(config)
    assert family is TEXT_FAMILY and not family.takes_images and family.attention_scope == "model"
    model = AutoModelForCausalLM.from_config(config)
    before = [p.requires_grad for p in model.parameters()]
    family.prepare(model, True)  # nothing to freeze in a text model
    assert [p.requires_grad for p in model.parameters()] == before
    assert list(family.fsdp_units(model)) == list(model.model.layers)
    assert family.decoder(model) is model.model


def test_vision_configs_get_their_vision_family():
    from transformers import AutoModelForImageTextToText

    config = tiny_vision_config("qwen2_vl")
    family = family_of(config)
    assert isinstance(family, VisionFamily) and isinstance(family, ModelFamily)
    assert family.takes_images and family.attention_scope == "decoder"
    model = AutoModelForImageTextToText.from_config(config)
    family.prepare(model, True)
    tower = {id(p) for p in model.model.visual.parameters()}
    assert all(not p.requires_grad for p in model.parameters() if id(p) in tower)
    assert all(p.requires_grad for p in model.parameters() if id(p) not in tower)
    units = family.fsdp_units(model)
    blocks, layers = list(model.model.visual.blocks), list(model.model.language_model.layers)
    assert units == [*blocks, *layers] and blocks
    family.prepare(model, False)
    assert all(p.requires_grad for p in model.parameters())


def test_unknown_vision_families_are_user_errors():
    from transformers import LlavaConfig

    with pytest.raises(UserError, match=r"Kimi-VL .*remote code only"):
        family_of(type("KimiVLConfig", (), {"model_type": "kimi_vl"})())
    with pytest.raises(UserError, match=r"vision-language model type 'llava' is not supported"):
        family_of(LlavaConfig())


def test_a_text_model_has_no_decoder_layers_where_none_exist():
    with pytest.raises(ValueError, match="no decoder layer list"):
        TEXT_FAMILY.decoder_layers(torch.nn.Linear(2, 2))
