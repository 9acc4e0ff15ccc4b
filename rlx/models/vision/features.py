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
    the tower where it trains). Where no gradient reaches the tower (frozen, or no autograd), an image repeated in
    `vision` (the N samples of a prompt in one batch) goes through the tower once: the tower attends within each
    image alone, so a copy's rows are its first copy's."""
    backbone = getattr(model, model.base_model_prefix)
    vision = vision.to(next(backbone.parameters()).device)
    grids = vision.image_grid_thw
    if len(grids) < 2 or _tower_takes_gradients(model):
        return _concat(_tower(model, backbone, vision.pixel_values, grids))
    patches = vision.pixel_values.split(grids.prod(-1).tolist())
    first = _first_copies(patches, grids)
    unique = sorted(set(first))
    if len(unique) == len(patches):
        return _concat(_tower(model, backbone, vision.pixel_values, grids))
    once = _tower(model, backbone, torch.cat([patches[i] for i in unique]), grids[unique])
    slot = {index: k for k, index in enumerate(unique)}
    return _concat([once[slot[index]] for index in first])


def _tower(model: torch.nn.Module, backbone, pixel_values: torch.Tensor, grids: torch.Tensor) -> list[ImageFeatures]:
    """Each image's features: [rows of image k] per image, in order."""
    out = backbone.get_image_features(pixel_values, grids, return_dict=True)
    embeds = list(out.pooler_output)
    if not vision_family_of(model.config).deepstack:
        return [ImageFeatures(e) for e in embeds]
    sizes = [e.shape[0] for e in embeds]
    layers = [layer.split(sizes) for layer in out.deepstack_features]
    return [ImageFeatures(e, tuple(layer[k] for layer in layers)) for k, e in enumerate(embeds)]


def _concat(images: list[ImageFeatures]) -> ImageFeatures:
    deepstack = tuple(torch.cat(rows) for rows in zip(*(f.deepstack for f in images)))
    return ImageFeatures(torch.cat([f.embeds for f in images]), deepstack)


def _tower_takes_gradients(model: torch.nn.Module) -> bool:
    tower = vision_family_of(model.config).vision_tower(model)
    return torch.is_grad_enabled() and any(p.requires_grad for m in tower for p in m.parameters())


def _first_copies(patches: tuple[torch.Tensor, ...], grids: torch.Tensor) -> list[int]:
    """For each image, the index of its first copy (same patch grid, equal pixels). Candidates are paired by grid and
    a fingerprint read in one transfer (each image's sum and sum of squares); the pairs are then confirmed equal in
    one comparison, or one by one should a fingerprint collide: a few device syncs, not one per pair."""
    prints = torch.stack([torch.stack((p.float().sum(), p.float().square().sum())) for p in patches]).tolist()
    keys = [(tuple(grid), tuple(fingerprint)) for grid, fingerprint in zip(grids.tolist(), prints, strict=True)]
    seen: dict = {}
    first = [seen.setdefault(key, i) for i, key in enumerate(keys)]
    copies = [i for i, j in enumerate(first) if j != i]
    if not copies:
        return first
    if torch.equal(torch.cat([patches[i] for i in copies]), torch.cat([patches[first[i]] for i in copies])):
        return first
    return [j if j == i or torch.equal(patches[i], patches[j]) else i for i, j in enumerate(first)]
