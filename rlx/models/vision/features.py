"""Images through the vision tower, as rows the decoder's image tokens take (rlx places them itself).

The models' own forward runs the tower and scatters its output into EVERY image placeholder token of the
sequence. rlx places the rows itself, into the images' own placeholders only (a single-turn prompt's; where a
multi-turn sample's `VisionInputs.image_offsets` say): a response may contain the placeholder token as an
ordinary sampled token (the rollout engines embedded it as text, at a text position), and a rollout engine that
prefills the N samples of a prompt in pieces (prefix caching, recomputation after preemption) runs the tower
once per image. `ImageFeatures.embeds[k]` is the k-th image token's row (images in
order), and for Qwen3-VL `deepstack[layer][k]` is what its DeepStack adds to that token's hidden state after
decoder layer `layer`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlx.models.vision.families import vision_family_of
from rlx.models.vision.inputs import VisionInputs


@dataclass(frozen=True)
class ImageFeatures:
    """One sample's images after the vision tower and merger, one row per image token."""

    embeds: torch.Tensor
    """[n, H] the embeddings that replace the n image placeholders, in prompt order."""
    deepstack: tuple[torch.Tensor, ...] = ()
    """Per DeepStack layer [n, H] (Qwen3-VL); empty for the other families."""


def image_features(model: torch.nn.Module, vision: VisionInputs) -> ImageFeatures:
    """Run `model`'s vision tower on the images of `vision` (pixels moved to the model's device; gradients reach
    the tower where it trains)."""
    family = vision_family_of(model.config)
    backbone = getattr(model, model.base_model_prefix)
    device = next(backbone.parameters()).device
    vision = vision.to(device)
    out = backbone.get_image_features(vision.pixel_values, vision.image_grid_thw, return_dict=True)
    embeds = torch.cat(list(out.pooler_output))
    deepstack = tuple(out.deepstack_features) if family.deepstack else ()
    return ImageFeatures(embeds, deepstack)
