"""The images of rollouts and training batches (vision-language models), between the file contracts and the forwards.

rollouts.jsonl keeps image references inside each prompt (resolved against the prompts file's folder), never
pixels. Scoring turns a batch's references back into the model's vision inputs through the policy's processor
(`rollout_images`: each image loaded and processed once, and its image tokens checked against the ones the
rollout's prompt holds, so a different --max-pixels is an error, not a silent mismatch); batch.safetensors then
carries the grids and references (pixels with `store_pixels`), see `rlx.models.vision.inputs`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlx.engine.records import RolloutRecord
from rlx.errors import UserError
from rlx.models.vision.families import family_for_prompt
from rlx.models.vision.images import image_refs
from rlx.models.vision.inputs import VisionInputs
from rlx.models.vision.positions import image_token_count


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
    refs = [image_refs(r.prompt, r.id) for r in rollouts]
    for rollout, sample_refs in zip(rollouts, refs):
        if sample_refs:
            family_for_prompt(config, rollout.prompt, rollout.id)  # image parts on a text-only model
    if not any(refs):
        return None
    vision = processor.vision_inputs(refs, [r.id for r in rollouts])
    for i, rollout in enumerate(rollouts):
        check_image_tokens(rollout.id, rollout.prompt_ids, vision.grids_of(i), refs[i], processor)
    return BatchImages(vision, refs)


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
