"""native engine: a vision-language model's images in the paged prefill, and its mRoPE positions in decode.

For each stream `NativeImages` holds what the runner needs about its sequences' prompts (added as they are
submitted): their 3-D positions (rlx.models.vision.positions; generated tokens continue from the largest
prompt position, so a sequence's text position p is rotated at p + `Sequence.position_offset` in all three
rows), which prompt tokens are image tokens (a single-turn prompt's placeholders; a multi-turn context's images
where its request's `VisionInputs.image_offsets` puts them, its earlier sampled placeholders being text), and the
images' features. Each image is identified by a digest of its pixels and grid: the vision tower runs once per
distinct image in a stream (the N samples of a prompt, and the later turns of an episode, reuse its rows). A
prefill step's row (any mix of sequences, each from its first uncomputed token: prefix-cached blocks and
recomputation after preemption included) gets its token embeddings with the image rows placed, its 3-D positions
and, for Qwen3-VL, the DeepStack inputs, and runs through the model's own decoder forward with "rlx_paged"
attention. A sequence's `image_spans` carry the digests into the prefix cache's block keys: equal tokens with
other images never share cache blocks.
"""

from __future__ import annotations

import hashlib

import torch

from rlx.models.family import family_of
from rlx.models.vision.features import ImageFeatures, image_features
from rlx.models.vision.inputs import VisionInputs
from rlx.models.vision.positions import find_image_offsets, image_token_count, mrope_positions
from rlx.rollout.native.blocks import Sequence


def image_digests(vision: VisionInputs) -> list[bytes]:
    """A digest of each image (its pixels and patch grid): equal digests, equal images."""
    pixels = vision.pixel_values.detach().float().cpu().contiguous()
    patches = vision.image_grid_thw.prod(-1).tolist()
    out, start = [], 0
    for grid, count in zip(vision.image_grid_thw.tolist(), patches):
        digest = hashlib.blake2b(repr(grid).encode(), digest_size=20)
        digest.update(pixels[start : start + count].numpy().tobytes())
        out.append(digest.digest())
        start += count
    return out


def select_images(vision: VisionInputs, images: list[int]) -> VisionInputs:
    """Images `images` of `vision` as the one sample of a VisionInputs (to run the tower on them alone)."""
    patches = vision.image_grid_thw.prod(-1)
    starts = torch.cat([patches.new_zeros(1), patches.cumsum(0)]).tolist()
    rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in images])
    return VisionInputs(vision.pixel_values[rows], vision.image_grid_thw[images], (len(images),))


class NativeImages:
    """The images of one stream's sequences (a vision-language model), added as the sequences are submitted."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.family = model, family_of(model.config)
        config = model.config
        self.token, self.merge = self.family.image_token_id(config), self.family.merge_size(config)
        self.positions: dict[int, torch.Tensor] = {}  # seq index -> [3, L] prompt positions
        self.image_rows: dict[int, torch.Tensor] = {}  # seq index -> [L] k for the k-th image token, -1 for text
        self.digests: dict[int, list[bytes]] = {}  # seq index -> its images' digests, in order
        self.vision: dict[int, VisionInputs] = {}  # seq index -> its images, held for the stream's life: their ids key
        # the sharing below
        self._features: dict[bytes, ImageFeatures] = {}  # per distinct image: its rows
        self._shared: dict[tuple[int, int], tuple] = {}  # (id(VisionInputs), prompt length) -> positions, rows, spans

    def add(self, seq: Sequence, prompt_ids: list[int], vision: VisionInputs | None) -> None:
        """Take a sequence: its prompt's positions and image rows; sets its `position_offset` and, with images, its
        `image_spans` (the N samples of a prompt share the work through their one images object)."""
        key = (id(vision), len(prompt_ids))
        shared = self._shared.get(key) if vision is not None else None
        if shared is None:
            shared = self._layout(prompt_ids, vision)
            if vision is not None:
                self._shared[key] = shared
        if vision is not None and vision.num_images:
            self.vision[seq.index] = vision
        self.positions[seq.index], self.image_rows[seq.index], spans, self.digests[seq.index] = shared
        seq.position_offset = int(shared[0].max()) + 1 - len(prompt_ids) if prompt_ids else 0
        seq.image_spans = spans

    def _layout(self, prompt_ids: list[int], vision: VisionInputs | None) -> tuple:
        """(positions [3, L], image rows [L], image spans, digests) of one prompt and its images."""
        ids = torch.tensor(prompt_ids, dtype=torch.long)
        if vision is None or not vision.num_images:
            grids, mask, digests = torch.zeros(0, 3, dtype=torch.long), torch.zeros(len(ids), dtype=torch.bool), []
        else:
            grids, mask = vision.image_grid_thw, vision.image_mask(0, ids, self.token, self.merge)
            digests = image_digests(vision)
        rows = torch.where(mask, mask.long().cumsum(0) - 1, torch.full_like(ids, -1))
        counts = [image_token_count(g, self.merge) for g in grids.tolist()]
        offsets = find_image_offsets(ids, self.token, counts, mask)
        spans = tuple((o, o + c, d) for o, c, d in zip(offsets, counts, digests))
        return mrope_positions(ids, self.token, grids, self.merge, mask), rows, spans, digests

    def _features_of(self, seq: Sequence) -> ImageFeatures:
        """The rows of the sequence's images, in order: the tower runs on those not seen in this stream yet."""
        vision, digests = self.vision[seq.index], self.digests[seq.index]
        missing = list({d: i for i, d in reversed(list(enumerate(digests))) if d not in self._features}.values())
        if missing:  # each new image once (the first of equal ones)
            missing.sort()
            features = image_features(self.model, select_images(vision, missing))
            counts = [image_token_count(vision.image_grid_thw[i].tolist(), self.merge) for i in missing]
            deep = [layer.split(counts) for layer in features.deepstack]  # per layer, per image
            for j, (i, embeds) in enumerate(zip(missing, features.embeds.split(counts))):
                self._features[digests[i]] = ImageFeatures(embeds, tuple(layer[j] for layer in deep))
        parts = [self._features[d] for d in digests]
        deepstack = tuple(torch.cat(layer) for layer in zip(*(p.deepstack for p in parts)))
        return ImageFeatures(torch.cat([p.embeds for p in parts]), deepstack)

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
