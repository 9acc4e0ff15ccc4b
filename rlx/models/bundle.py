"""ModelFamily: the base bundle every model family extends (a text-only causal LM by default).

Stages and parallelism never branch on "is this a vision-language model?": they ask the family of the config once
(`rlx.models.family.family_of`) and call the bundle. The base class is the plain decoder-only text family
(Llama, Qwen, ...); `rlx.models.vision.families.VisionFamily` extends it with the vision tower, image inputs and
3-D rotary positions; `rlx.models.moe.MoeFamily` with the experts' weight layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True, kw_only=True)
class ModelFamily:
    """How rlx drives one family of transformers models; this base is the text-only decoder family."""

    name: str = "text"
    """Short name of the family."""
    title: str = "text decoder"
    """Human name used in messages."""
    takes_images: ClassVar[bool] = False
    """Whether the model reads image inputs (a vision-language model: images in its batches, 3-D mRoPE positions)."""
    routed_experts: ClassVar[bool] = False
    """Whether the model's MLPs are routed experts (a mixture-of-experts model)."""
    attention_scope: ClassVar[str] = "model"
    """Which modules the packed / sequence-parallel attention replaces: 'model' (all of them) or 'decoder' (the
    language model only; a vision tower keeps its own attention per image)."""

    def prepare(self, model: torch.nn.Module, freeze_tower: bool = True) -> None:
        """Set which parameters train before the optimizer and FSDP see them (a vision tower's, with
        `freeze_tower`); nothing to do for a text model."""

    def decoder(self, model: torch.nn.Module) -> torch.nn.Module | None:
        """The decoder of `model` (the module holding `layers`), or None when it has none under the usual name."""
        return getattr(model, getattr(model, "base_model_prefix", "model"), None)

    def decoder_path(self, model: torch.nn.Module) -> str:
        """Dotted path of `decoder(model)` (for messages)."""
        return getattr(model, "base_model_prefix", "model")

    def decoder_layers(self, model: torch.nn.Module) -> torch.nn.ModuleList:
        """The decoder blocks of a causal LM (or value model) of this family."""
        base = self.decoder(model)
        layers = getattr(base if base is not None else model, "layers", None)
        if not isinstance(layers, torch.nn.ModuleList):
            raise ValueError(
                f"{type(model).__name__}: no decoder layer list found at {self.decoder_path(model)}.layers"
            )
        return layers

    def tower_blocks(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """Blocks outside the decoder that are FSDP units of their own (a vision tower's); none here."""
        return []

    def fsdp_units(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The modules FSDP shards one by one (before the whole model): tower blocks, then decoder blocks."""
        return [*self.tower_blocks(model), *self.decoder_layers(model)]


TEXT_FAMILY = ModelFamily()
"""The bundle of every text-only decoder without a family of its own."""
