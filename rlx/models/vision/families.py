"""One bundle per vision-language family: its transformers classes, image tokens, positions and vision tower.

`vision_family_of(config)` maps a model config to its `VisionFamily`; everything else in `rlx.models.vision`
asks the bundle instead of branching on the model type. Supported (transformers 5.17): Qwen2-VL,
Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, GLM-4.1V ('glm4v') and GLM-4.5V ('glm4v_moe'). Families transformers
lacks (Kimi-VL is remote code only) or that rlx does not handle yet are a UserError naming the family; a
text-only config given images is a UserError too: nothing falls back to a text-only forward.

All supported families share one layout: `model.model.visual` (the vision tower, its patch merger
included), `model.model.language_model` (the decoder, which takes 3-D mRoPE position ids), image
placeholders `<start><image>*N<end>` with N = t*h*w / merge^2 of the image's grid, and the same mRoPE
position rule for still images (see `rlx.models.vision.positions`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import ClassVar

import torch

from rlx.errors import UserError
from rlx.models.bundle import ModelFamily
from rlx.models.vision.images import image_refs

# model types transformers does not ship (remote code only) that users may reasonably try
KNOWN_UNSUPPORTED = {
    "kimi_vl": "Kimi-VL (model_type 'kimi_vl') is remote code only, not part of transformers 5.17",
    "kimi_k25": "Kimi-K2.5 ('kimi_k25') is in transformers 5.17, but its image processor needs torchvision (there is "
    "no PIL version) and rlx has no bundle for its layout (MoonViT tower + projector, 1-D positions) yet",
}


@dataclass(frozen=True, kw_only=True)
class VisionFamily(ModelFamily):
    """How rlx drives one vision-language family of transformers (a `ModelFamily` with a vision tower)."""

    takes_images: ClassVar[bool] = True
    attention_scope: ClassVar[str] = "decoder"

    name: str
    """Short name, e.g. 'qwen2_vl'."""
    title: str
    """Human name used in messages, e.g. 'Qwen2-VL'."""
    model_type: str
    """config.model_type of the family."""
    model_class: str
    """transformers class of the causal LM with its vision tower, e.g. 'Qwen2VLForConditionalGeneration'."""
    config_class: str
    """transformers config class, e.g. 'Qwen2VLConfig'."""
    image_processor_class: str
    """'module:Class' of the image processor that runs without torchvision (PIL-based)."""
    image_token: str
    """The placeholder token repeated once per merged patch of an image."""
    image_start: str
    """Token written before an image's placeholders."""
    image_end: str
    """Token written after an image's placeholders."""
    extra_tokens: tuple[str, ...]
    """Further special tokens of the family's vocabulary (video placeholders, chat markers)."""
    start_token_key: str
    """Config key holding the id of `image_start` (names differ between families)."""
    end_token_key: str
    """Config key holding the id of `image_end`."""
    vision_modules: tuple[str, ...] = ("model.visual",)
    """Dotted module paths that form the vision tower (frozen by `freeze_vision_tower`)."""
    language_model: str = "model.language_model"
    """Dotted path of the decoder that takes the merged text + image embeddings."""
    deepstack: bool = False
    """Whether the decoder also adds vision features to early layers (Qwen3-VL's DeepStack)."""

    @property
    def special_tokens(self) -> tuple[str, ...]:
        """Every special token the family's tokenizer must know, image tokens first."""
        return (self.image_start, self.image_token, self.image_end, *self.extra_tokens)

    def load_model_class(self):
        """The transformers model class (imported on use)."""
        import transformers

        return getattr(transformers, self.model_class)

    def load_config_class(self):
        """The transformers config class (imported on use)."""
        import transformers

        return getattr(transformers, self.config_class)

    def load_image_processor_class(self):
        """The image processor class that needs only Pillow and numpy."""
        module, _, name = self.image_processor_class.partition(":")
        return getattr(importlib.import_module(module), name)

    def vision_tower(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The modules of `model` that form its vision tower."""
        return [model.get_submodule(path) for path in self.vision_modules]

    def decoder(self, model: torch.nn.Module) -> torch.nn.Module:
        """The decoder of `model` that receives the merged embeddings (hooked by the packed forward)."""
        return model.get_submodule(self.language_model)

    def decoder_path(self, model: torch.nn.Module) -> str:
        return self.language_model

    def tower_blocks(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The vision tower's blocks (each its own FSDP unit)."""
        return [block for tower in self.vision_tower(model) for block in getattr(tower, "blocks", [])]

    def prepare(self, model: torch.nn.Module, freeze_tower: bool = True) -> None:
        """Freeze (or unfreeze) the vision tower before the optimizer and FSDP see which parameters train."""
        freeze_vision_tower(model, freeze_tower)

    def image_token_id(self, config) -> int:
        """Id of the image placeholder token in `config`."""
        return int(config.image_token_id)

    def merge_size(self, config) -> int:
        """Side of the square of patches merged into one image token."""
        return int(config.vision_config.spatial_merge_size)


_QWEN_TOKENS = dict(
    image_token="<|image_pad|>",
    image_start="<|vision_start|>",
    image_end="<|vision_end|>",
    extra_tokens=("<|video_pad|>", "<|im_start|>", "<|im_end|>"),
    start_token_key="vision_start_token_id",
    end_token_key="vision_end_token_id",
)
_QWEN_PIL = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl:Qwen2VLImageProcessorPil"
_GLM_TOKENS = dict(
    image_token="<|image|>",
    image_start="<|begin_of_image|>",
    image_end="<|end_of_image|>",
    extra_tokens=("<|video|>", "<|begin_of_video|>", "<|end_of_video|>", "<|user|>", "<|assistant|>"),
    start_token_key="image_start_token_id",
    end_token_key="image_end_token_id",
)
_GLM_PIL = "transformers.models.glm4v.image_processing_pil_glm4v:Glm4vImageProcessorPil"

FAMILIES: dict[str, VisionFamily] = {
    f.model_type: f
    for f in (
        VisionFamily(
            name="qwen2_vl", title="Qwen2-VL", model_type="qwen2_vl", model_class="Qwen2VLForConditionalGeneration",
            config_class="Qwen2VLConfig", image_processor_class=_QWEN_PIL, **_QWEN_TOKENS,
        ),
        VisionFamily(
            name="qwen2_5_vl", title="Qwen2.5-VL", model_type="qwen2_5_vl",
            model_class="Qwen2_5_VLForConditionalGeneration", config_class="Qwen2_5_VLConfig",
            image_processor_class=_QWEN_PIL, **_QWEN_TOKENS,
        ),
        VisionFamily(
            name="qwen3_vl", title="Qwen3-VL", model_type="qwen3_vl", model_class="Qwen3VLForConditionalGeneration",
            config_class="Qwen3VLConfig", image_processor_class=_QWEN_PIL, deepstack=True, **_QWEN_TOKENS,
        ),
        VisionFamily(
            name="qwen3_vl_moe", title="Qwen3-VL-MoE", model_type="qwen3_vl_moe",
            model_class="Qwen3VLMoeForConditionalGeneration", config_class="Qwen3VLMoeConfig",
            image_processor_class=_QWEN_PIL, deepstack=True, **_QWEN_TOKENS,
        ),
        VisionFamily(
            name="glm4v", title="GLM-4.1V", model_type="glm4v", model_class="Glm4vForConditionalGeneration",
            config_class="Glm4vConfig", image_processor_class=_GLM_PIL, **_GLM_TOKENS,
        ),
        VisionFamily(
            name="glm4v_moe", title="GLM-4.5V", model_type="glm4v_moe", model_class="Glm4vMoeForConditionalGeneration",
            config_class="Glm4vMoeConfig", image_processor_class=_GLM_PIL, **_GLM_TOKENS,
        ),
    )
}  # fmt: skip


def is_vision_config(config) -> bool:
    """Whether `config` describes a model with a vision tower (it has a vision_config)."""
    return getattr(config, "vision_config", None) is not None


def vision_family_of(config) -> VisionFamily:
    """The bundle of `config`'s family; UserError for a text-only model or a family rlx cannot train."""
    model_type = getattr(config, "model_type", None) or type(config).__name__
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    supported = ", ".join(f"{f.title} ({t})" for t, f in FAMILIES.items())
    if model_type in KNOWN_UNSUPPORTED:
        raise UserError(f"{KNOWN_UNSUPPORTED[model_type]}: rlx cannot train it; supported: {supported}")
    if not is_vision_config(config):
        raise UserError(
            f"model type {model_type!r} is a text-only model: it cannot take image parts "
            f"(vision-language families: {supported})"
        )
    raise UserError(f"vision-language model type {model_type!r} is not supported by rlx yet; supported: {supported}")


def family_for_prompt(config, prompt, prompt_id=None) -> VisionFamily | None:
    """The family that will read `prompt` (None for a text-only model and a prompt without images); image parts
    given to a text-only model are a UserError naming the prompt."""
    if is_vision_config(config) or getattr(config, "model_type", None) in KNOWN_UNSUPPORTED:
        return vision_family_of(config)
    if image_refs(prompt, prompt_id):
        model_type = getattr(config, "model_type", None) or type(config).__name__
        raise UserError(f"prompt {prompt_id!r} has image parts, but model type {model_type!r} is a text-only model")
    return None


def freeze_vision_tower(model: torch.nn.Module, frozen: bool = True) -> int:
    """Stop (or restart, `frozen=False`) gradients of the vision tower's parameters; returns how many
    parameter tensors it covers. The decoder and LM head are left as they are."""
    family = vision_family_of(model.config)
    count = 0
    for module in family.vision_tower(model):
        for param in module.parameters():
            param.requires_grad_(not frozen)
            count += 1
    return count
