"""The images of rollouts and training batches (vision-language models), between the file contracts and the forwards.

rollouts.jsonl keeps image references inside each prompt (resolved against the prompts file's folder), and a
multi-turn sample's (the opening messages' and the environment's, in token order) in `image_refs`, never pixels.
A multi-turn sample's images may sit in its response (inserted tokens, loss_mask 0): its vision inputs name where
each image's tokens start (`VisionInputs.image_offsets`, found among the prompt's and the inserted tokens' image
placeholders; a placeholder the model sampled is text), and so do those of every sample batched with it.
Scoring turns a batch's references back into the model's vision inputs through the policy's processor
(`rollout_images`: each image loaded and processed once, and its image tokens checked against the ones the
rollout's prompt holds, so a different --max-pixels is an error, not a silent mismatch); batch.safetensors then
carries the grids and references (pixels with `store_pixels`), see `rlx.models.vision.inputs`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from rlx.errors import UserError
from rlx.formats.records import RolloutRecord
from rlx.models.family import family_of
from rlx.models.vision.families import family_for_prompt
from rlx.models.vision.images import image_refs
from rlx.models.vision.inputs import VisionInputs
from rlx.models.vision.positions import find_image_offsets, image_token_count


@dataclass(frozen=True)
class BatchImages:
    """The images of a batch's samples (rows), in row order."""

    vision: VisionInputs
    """Pixels and patch grids of every sample's images."""
    refs: list[list[str]]
    """Each sample's image references, as its rollout keeps them."""

    def select(self, rows: list[int]) -> BatchImages:
        return BatchImages(self.vision.select(rows), [self.refs[i] for i in rows])


def rollout_images(rollouts: list[RolloutRecord], processor, config) -> BatchImages | None:
    """The images of `rollouts` through `processor` (a VisionProcessor, None for a text-only model whose prompts
    then must have no image), or None when no prompt has one. Errors name the sample."""
    refs = [sample_image_refs(r) for r in rollouts]
    for rollout, sample_refs in zip(rollouts, refs):
        if sample_refs and rollout.is_multi_turn and not family_of(config).takes_images:
            model_type = getattr(config, "model_type", None) or type(config).__name__
            raise UserError(f"sample {rollout.id!r} has images, but model type {model_type!r} is a text-only model")
        if sample_refs:
            family_for_prompt(config, rollout.prompt, rollout.id)  # image parts on a text-only model
    if not any(refs):
        return None
    vision = processor.vision_inputs(refs, [r.id for r in rollouts])
    if any(r.is_multi_turn and sample for r, sample in zip(rollouts, refs)):
        offsets = [image_offsets(r, vision.grids_of(i), refs[i], processor) for i, r in enumerate(rollouts)]
        return BatchImages(dataclasses.replace(vision, image_offsets=tuple(o for s in offsets for o in s)), refs)
    for i, rollout in enumerate(rollouts):
        check_image_tokens(rollout.id, rollout.prompt_ids, vision.grids_of(i), refs[i], processor)
    return BatchImages(vision, refs)


def sample_image_refs(rollout: RolloutRecord) -> list[str]:
    """A sample's image references in token order: a multi-turn sample's `image_refs`, else its prompt's."""
    if rollout.is_multi_turn:
        return list(rollout.image_refs or [])
    return image_refs(rollout.prompt, rollout.id)


def image_offsets(rollout: RolloutRecord, grids: torch.Tensor, refs: list[str], processor) -> list[int]:
    """Where each of the sample's images starts in prompt_ids + response_ids: its images' placeholder runs among the
    prompt's and the inserted (loss_mask 0) tokens, which must be the images' token counts under this processor."""
    counts = [image_token_count(g.tolist(), processor.merge_size) for g in grids]
    ids = rollout.prompt_ids + rollout.response_ids
    inserted = [1] * len(rollout.prompt_ids) + [1 - m for m in rollout.trained_mask]
    try:
        return find_image_offsets(ids, processor.image_token_id, counts, torch.tensor(inserted, dtype=torch.bool))
    except ValueError as e:
        raise UserError(
            f"sample {rollout.id!r}: its tokens do not hold images {refs} as they now come out ({counts} image tokens: "
            f"{e}; the images changed, or the stages use other --min-pixels / --max-pixels than the rollout)"
        ) from None


def check_image_tokens(sample_id: str, prompt_ids: list[int], grids: torch.Tensor, refs: list[str], processor) -> None:
    """The prompt's runs of image placeholders must be the images' token counts under this processor."""
    token, merge = processor.image_token_id, processor.merge_size
    runs, count = [], 0
    for t in [*prompt_ids, None]:
        if t == token:
            count += 1
        elif count:
            runs.append(count)
            count = 0
    want = [image_token_count(g.tolist(), merge) for g in grids]
    if sum(runs) != sum(want) or (len(runs) == len(want) and runs != want):
        raise UserError(
            f"sample {sample_id!r}: its prompt holds {runs} image tokens for images {refs}, which now give {want} "
            f"(the images changed, or the stages use other --min-pixels / --max-pixels than the rollout)"
        )
