"""native engine: a vision-language model's images in the paged prefill, and its mRoPE positions in decode.

For each stream `NativeImages` holds what the runner needs about its sequences' prompts (added as they are
submitted): their 3-D positions (rlx.models.vision.positions; generated tokens continue from the largest
prompt position, so a sequence's text position p is rotated at p + `Sequence.position_offset` in all three
rows), which prompt tokens are image placeholders, and the images' features, computed by the vision tower once
per prompt (the N samples share them) on first use. A prefill step's row (any mix of sequences, each from its
first uncomputed token: prefix-cached blocks and recomputation after preemption included) gets its token
embeddings with the image rows placed, its 3-D positions and, for Qwen3-VL, the DeepStack inputs, and runs
through the model's own decoder forward with "rlx_paged" attention. Sequences with images carry a prefix-cache
salt (their images object, held for the stream's life): two prompts whose tokens are equal but whose images
differ never share cache blocks.
"""

from __future__ import annotations

import torch

from rlx.engine.rollout.native.blocks import Sequence
from rlx.models.vision.families import family_of
from rlx.models.vision.features import ImageFeatures, image_features
from rlx.models.vision.inputs import VisionInputs
from rlx.models.vision.positions import mrope_positions


class NativeImages:
    """The images of one stream's sequences (a vision-language model), added as the sequences are submitted."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.family = model, family_of(model.config)
        config = model.config
        self.token, self.merge = self.family.image_token_id(config), self.family.merge_size(config)
        self.positions: dict[int, torch.Tensor] = {}  # seq index -> [3, L] prompt positions
        self.image_rows: dict[int, torch.Tensor] = {}  # seq index -> [L] k for the k-th image token, -1 for text
        self.vision: dict[int, VisionInputs] = {}  # held for the stream's life: their ids key the sharing below
        self._features: dict[int, ImageFeatures] = {}  # id(VisionInputs): the N samples of a prompt share one
        self._shared: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(VisionInputs) -> positions, rows

    def add(self, seq: Sequence, prompt_ids: list[int], vision: VisionInputs | None) -> None:
        """Take a sequence: its prompt's positions and image rows; sets its `position_offset` and, with images, its
        prefix-cache salt (the images object, which the N samples of a prompt share)."""
        shared = self._shared.get(id(vision)) if vision is not None else None
        if shared is None:
            grids = vision.image_grid_thw if vision is not None else torch.zeros(0, 3, dtype=torch.long)
            ids = torch.tensor(prompt_ids, dtype=torch.long)
            is_image = ids == self.token
            rows = torch.where(is_image, is_image.long().cumsum(0) - 1, torch.full_like(ids, -1))
            shared = (mrope_positions(ids, self.token, grids, self.merge), rows)
            if vision is not None:
                self._shared[id(vision)] = shared
        self.positions[seq.index], self.image_rows[seq.index] = shared
        seq.position_offset = int(shared[0].max()) + 1 - len(prompt_ids) if prompt_ids else 0
        if vision is not None:
            self.vision[seq.index] = vision
            seq.cache_salt = ("images", id(vision))

    def _features_of(self, seq: Sequence) -> ImageFeatures:
        vision = self.vision[seq.index]
        if id(vision) not in self._features:
            self._features[id(vision)] = image_features(self.model, vision)
        return self._features[id(vision)]

    def prefill_inputs(self, seqs: list[Sequence], input_ids: torch.Tensor, embed) -> dict:
        """The decoder's inputs for a prefill row (`input_ids` [1, T]: each sequence's uncomputed tokens, in
        order): `inputs_embeds` [1, T, H] with the image rows placed, `position_ids` [3, 1, T], and for DeepStack
        families `visual_pos_masks` [1, T] and `deepstack_visual_embeds` (per layer [visual tokens, H])."""
        embeds = embed(input_ids)
        positions, places, rows, deep = [], [], [], []
        start = 0
        for seq in seqs:
            lo, hi, prompt = seq.num_computed, len(seq), len(seq.prompt_ids)
            prompt_hi = min(hi, prompt)
            generated = torch.arange(max(lo, prompt), hi) + seq.position_offset
            positions += [self.positions[seq.index][:, lo:prompt_hi], generated.expand(3, -1)]
            image_rows = self.image_rows[seq.index][lo:prompt_hi]
            picked = (image_rows >= 0).nonzero().squeeze(1)
            if len(picked):
                features = self._features_of(seq)
                places.append(picked + start)
                rows.append(features.embeds[image_rows[picked].to(features.embeds.device)])
                deep.append([d[image_rows[picked].to(d.device)] for d in features.deepstack])
            start += hi - lo
        device = input_ids.device
        out = {"position_ids": torch.cat(positions, dim=1).unsqueeze(1).to(device)}
        if places:
            index = torch.cat(places).to(device)
            embeds = embeds.index_put((torch.zeros_like(index), index), torch.cat(rows).to(embeds.dtype))
            if self.family.deepstack:
                mask = torch.zeros(input_ids.shape, dtype=torch.bool, device=device)
                mask[0, index] = True
                out["visual_pos_masks"] = mask
                out["deepstack_visual_embeds"] = [torch.cat(layer) for layer in zip(*deep)]
        out["inputs_embeds"] = embeds
        return out
