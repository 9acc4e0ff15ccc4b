"""VisionConfig: how images become model inputs and whether the vision tower trains (no torch import)."""

from __future__ import annotations

from dataclasses import dataclass

from rlx.config import check


@dataclass(kw_only=True)
class VisionConfig:
    """Settings of vision-language models, shared by rollout, score and train-step."""

    freeze_vision_tower: bool = True
    """Keep the vision tower (patch embedding, vision blocks, merger) fixed: no gradients, no optimizer state.
    false trains it with the decoder."""
    min_pixels: int = 0
    """Smallest image area after the processor's resize, in pixels (0 = the processor's own setting)."""
    max_pixels: int = 0
    """Largest image area after the processor's resize, in pixels: a bigger image is scaled down, keeping its
    aspect ratio, to fit (0 = the processor's own setting). This bounds the image tokens of each image."""
    max_prompt_tokens: int = 0
    """A prompt whose tokens (its image tokens included) exceed this is an error naming it (0 = no limit)."""
    store_pixels: bool = False
    """batch.safetensors keeps the images' pixel tensors; by default it keeps their references and patch grids,
    and train-step reloads the images."""

    def __post_init__(self):
        check(self.min_pixels >= 0, "min_pixels", f"must be >= 0, got {self.min_pixels}")
        check(self.max_pixels >= 0, "max_pixels", f"must be >= 0, got {self.max_pixels}")
        check(
            not (self.min_pixels and self.max_pixels) or self.min_pixels <= self.max_pixels,
            "min_pixels",
            f"must not exceed max_pixels ({self.min_pixels} > {self.max_pixels})",
        )
        check(self.max_prompt_tokens >= 0, "max_prompt_tokens", f"must be >= 0, got {self.max_prompt_tokens}")
