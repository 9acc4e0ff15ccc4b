"""VisionConfig: how images become model inputs and whether the vision tower trains (no torch import).

One table, `[vision]` in a recipe, read by every stage of `rlx ppo`; the stage commands take the fields they
use as options (`rlx rollout --max-pixels`, `rlx score --store-pixels`, `rlx train-step
--no-freeze-vision-tower`). The pixel limits decide each image's patch grid, so the stages of one run must
use the same ones: score and train-step check that the images still give the rollout's image tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlx.config import check


@dataclass(kw_only=True)
class VisionConfig:
    """Settings of vision-language models, shared by rollout, score and train-step."""

    freeze_vision_tower: bool = True
    """Vision-language models: keep the vision tower (patch embedding, vision blocks, merger) fixed: no
    gradients, no optimizer state; false trains it with the decoder."""
    min_pixels: int = 0
    """Vision-language models: smallest image area after the processor's resize, in pixels (0 = the processor's
    own setting)."""
    max_pixels: int = 0
    """Vision-language models: largest image area after the processor's resize, in pixels; a bigger image is
    scaled down, keeping its aspect ratio, to fit (0 = the processor's own setting). Bounds each image's tokens."""
    max_prompt_tokens: int = 0
    """Vision-language models: a prompt whose tokens (its image tokens included) exceed this is an error naming
    it (0 = the model's context length)."""
    store_pixels: bool = False
    """Vision-language models: batch.safetensors keeps the images' pixel tensors; by default it keeps their
    references and patch grids, and train-step reloads the images."""

    def __post_init__(self):
        check(self.min_pixels >= 0, "min_pixels", f"must be >= 0, got {self.min_pixels}")
        check(self.max_pixels >= 0, "max_pixels", f"must be >= 0, got {self.max_pixels}")
        check(
            not (self.min_pixels and self.max_pixels) or self.min_pixels <= self.max_pixels,
            "min_pixels",
            f"must not exceed max_pixels ({self.min_pixels} > {self.max_pixels})",
        )
        check(self.max_prompt_tokens >= 0, "max_prompt_tokens", f"must be >= 0, got {self.max_prompt_tokens}")
