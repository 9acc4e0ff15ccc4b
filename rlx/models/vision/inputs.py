"""The vision inputs of a list of samples, and their compact form inside batch.safetensors.

`VisionInputs` holds what the model's forward takes besides token ids: all images' patches
(`pixel_values` [P, C*T*p*p], in sample order), each image's patch grid (`image_grid_thw` [N, 3]) and
how many images each sample has, and where (for multi-turn samples, whose images may sit in their responses:
`image_offsets`). Micro-batches take subsets of samples with `select`.

A training batch stores them compactly (`to_tensors` / `from_tensors`): the grids and per-sample
counts as tensors (and the offsets when the samples name them: format version 2), the image references as JSON
in the safetensors header, and the pixels only when asked (`store_pixels`). Without pixels, `from_tensors`
reloads the images through the processor and checks that each grid comes out as recorded, so a changed image
file or processor setting is an error rather than a silent mismatch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from rlx.errors import UserError
from rlx.models.vision.positions import image_token_mask

GRID_KEY = "vision/image_grid_thw"
COUNT_KEY = "vision/images_per_sample"
PIXELS_KEY = "vision/pixel_values"
OFFSETS_KEY = "vision/image_offsets"
REFS_KEY = "vision_image_refs"
FORMAT_KEY = "vision_format_version"
FORMAT_VERSION = "1"
OFFSETS_FORMAT_VERSION = "2"
"""Batches whose samples name where their images sit (`OFFSETS_KEY`); version 1 batches take each prompt's
placeholders."""


@dataclass(frozen=True)
class VisionInputs:
    """Images of several samples, concatenated in sample order."""

    pixel_values: torch.Tensor | None
    """[P, D] float: every image's patches (None when no sample has an image)."""
    image_grid_thw: torch.Tensor
    """[N, 3] int64: each image's (t, h, w) patch grid."""
    images_per_sample: tuple[int, ...]
    """Images of each sample, in order (sums to N)."""
    image_offsets: tuple[int, ...] | None = None
    """[N]: where each image's tokens start in its sample's tokens (prompt then response), increasing per sample;
    every other placeholder token is text. None: each sample's images are its prompt's placeholders, in order."""

    def __post_init__(self):
        if sum(self.images_per_sample) != self.image_grid_thw.shape[0]:
            raise ValueError(f"{self.image_grid_thw.shape[0]} grids for {sum(self.images_per_sample)} images")
        if self.image_offsets is not None and len(self.image_offsets) != len(self.image_grid_thw):
            raise ValueError(f"{len(self.image_offsets)} image offsets for {len(self.image_grid_thw)} images")
        patches = int(self.image_grid_thw.prod(-1).sum()) if len(self.image_grid_thw) else 0
        rows = 0 if self.pixel_values is None else self.pixel_values.shape[0]
        if patches != rows:
            raise ValueError(f"pixel_values has {rows} patches, the grids {patches}")

    @classmethod
    def empty(cls, num_samples: int) -> VisionInputs:
        """No images for `num_samples` samples."""
        return cls(None, torch.zeros(0, 3, dtype=torch.long), (0,) * num_samples)

    @classmethod
    def concat(cls, parts: list[VisionInputs]) -> VisionInputs:
        """The samples of `parts` one after another (parts that name their images' offsets and parts whose images are
        their prompts' placeholders do not mix: a ValueError)."""
        pixels = [p.pixel_values for p in parts if p.pixel_values is not None]
        named = [p for p in parts if p.image_offsets is not None]
        if named and any(p.image_offsets is None and p.num_images for p in parts):
            raise ValueError("vision inputs with and without image offsets cannot be concatenated")
        return cls(
            torch.cat(pixels) if pixels else None,
            torch.cat([p.image_grid_thw for p in parts]) if parts else torch.zeros(0, 3, dtype=torch.long),
            tuple(n for p in parts for n in p.images_per_sample),
            tuple(o for p in named for o in p.image_offsets) if named else None,
        )

    @property
    def num_samples(self) -> int:
        """B, the number of samples."""
        return len(self.images_per_sample)

    @property
    def num_images(self) -> int:
        """N, the number of images."""
        return int(self.image_grid_thw.shape[0])

    def select(self, samples: list[int] | range) -> VisionInputs:
        """The inputs of samples `samples` (in that order): a micro-batch's share."""
        image_start = [0]
        for n in self.images_per_sample:
            image_start.append(image_start[-1] + n)
        patches = self.image_grid_thw.prod(-1)
        patch_start = torch.cat([patches.new_zeros(1), patches.cumsum(0)]).tolist()
        images = [i for s in samples for i in range(image_start[s], image_start[s + 1])]
        offsets = None if self.image_offsets is None else tuple(self.image_offsets[i] for i in images)
        if not images:
            return VisionInputs(None, torch.zeros(0, 3, dtype=torch.long), (0,) * len(samples), offsets)
        rows = [torch.arange(patch_start[i], patch_start[i + 1]) for i in images]
        return VisionInputs(
            self.pixel_values[torch.cat(rows)],
            self.image_grid_thw[images],
            tuple(self.images_per_sample[s] for s in samples),
            offsets,
        )

    def sample(self, index: int) -> VisionInputs:
        """The inputs of one sample."""
        return self.select([index])

    def grids_of(self, index: int) -> torch.Tensor:
        """[n, 3] grids of sample `index`'s images."""
        start = sum(self.images_per_sample[:index])
        return self.image_grid_thw[start : start + self.images_per_sample[index]]

    def image_mask(self, index: int, input_ids, image_token_id: int, merge_size: int, prompt_len: int | None = None):
        """[L] bool: which of sample `index`'s tokens `input_ids` (prompt then response) are its images' tokens: the
        runs its offsets name, or without offsets the placeholders of its first `prompt_len` tokens (all by
        default). Other placeholder tokens are text (a ValueError when an offset's run is not placeholders)."""
        ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
        if self.image_offsets is None:
            end = len(ids) if prompt_len is None else prompt_len
            return (ids == image_token_id) & (torch.arange(len(ids)) < end)
        start = sum(self.images_per_sample[:index])
        offsets = self.image_offsets[start : start + self.images_per_sample[index]]
        return image_token_mask(ids, image_token_id, self.grids_of(index), merge_size, offsets)

    def to(self, device, dtype: torch.dtype | None = None) -> VisionInputs:
        """The same inputs with pixel_values (and grids) on `device`; pixels cast to `dtype` when given."""
        pixels = None if self.pixel_values is None else self.pixel_values.to(device, dtype)
        return VisionInputs(pixels, self.image_grid_thw.to(device), self.images_per_sample, self.image_offsets)

    def model_kwargs(self) -> dict:
        """`pixel_values` and `image_grid_thw` for the model's forward (empty without images)."""
        if self.pixel_values is None:
            return {}
        return {"pixel_values": self.pixel_values, "image_grid_thw": self.image_grid_thw}


def to_tensors(
    inputs: VisionInputs, image_refs: list[list[str]], store_pixels: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, header metadata) of a batch's vision inputs for batch.safetensors.

    `image_refs`: per sample, its resolved image references (as the rollout records keep them)."""
    if [len(r) for r in image_refs] != list(inputs.images_per_sample):
        raise ValueError("image_refs must list each sample's images, as many as images_per_sample says")
    tensors = {
        GRID_KEY: inputs.image_grid_thw.to(torch.int64).contiguous(),
        COUNT_KEY: torch.tensor(inputs.images_per_sample, dtype=torch.int64),
    }
    if store_pixels and inputs.pixel_values is not None:
        tensors[PIXELS_KEY] = inputs.pixel_values.float().contiguous()
    version = FORMAT_VERSION
    if inputs.image_offsets is not None:
        tensors[OFFSETS_KEY] = torch.tensor(inputs.image_offsets, dtype=torch.int64).reshape(-1)
        version = OFFSETS_FORMAT_VERSION
    metadata = {REFS_KEY: json.dumps(image_refs), FORMAT_KEY: version}
    return tensors, metadata


def from_tensors(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str], processor=None, source: str = "batch", sample_ids=None
):
    """(VisionInputs, image refs per sample) back from `to_tensors`' output. Without stored pixels the images
    are reloaded through `processor` (a `VisionProcessor`) and their grids checked against the stored ones;
    errors name `source` (the batch file) and, when given, the sample's id."""
    if GRID_KEY not in tensors or COUNT_KEY not in tensors or REFS_KEY not in metadata:
        raise UserError(f"{source}: no vision inputs (expected {GRID_KEY}, {COUNT_KEY} and header {REFS_KEY})")
    version = metadata.get(FORMAT_KEY)
    if version not in (FORMAT_VERSION, OFFSETS_FORMAT_VERSION):
        raise UserError(
            f"{source}: vision format version {version!r}, expected {FORMAT_VERSION} or {OFFSETS_FORMAT_VERSION}"
        )
    grids, counts = tensors[GRID_KEY].long(), tuple(int(n) for n in tensors[COUNT_KEY].tolist())
    refs = json.loads(metadata[REFS_KEY])
    if [len(r) for r in refs] != list(counts):
        raise UserError(f"{source}: header {REFS_KEY} does not match {COUNT_KEY}")
    offsets = None
    if version == OFFSETS_FORMAT_VERSION:
        if OFFSETS_KEY not in tensors or tensors[OFFSETS_KEY].shape != (len(grids),):
            raise UserError(f"{source}: vision format version {version} needs {OFFSETS_KEY}, one per image")
        offsets = tuple(int(o) for o in tensors[OFFSETS_KEY].tolist())
    if PIXELS_KEY in tensors:
        return VisionInputs(tensors[PIXELS_KEY], grids, counts, offsets), refs
    if not len(grids):
        return VisionInputs(None, grids.reshape(0, 3), counts, offsets), refs
    if processor is None:
        raise ValueError("the batch stores image references only: pass the model's processor to reload them")
    ids = list(sample_ids) if sample_ids is not None else [f"{source} row {i}" for i in range(len(refs))]
    flat = [(ref, sample_id) for sample, sample_id in zip(refs, ids) for ref in sample]
    reloaded = processor.vision_inputs(refs, ids)
    pixels, new_grids = reloaded.pixel_values, reloaded.image_grid_thw
    if not torch.equal(new_grids, grids):
        bad = next(i for i in range(len(flat)) if not torch.equal(new_grids[i], grids[i]))
        raise UserError(
            f"{source}: sample {flat[bad][1]!r}: image {flat[bad][0]!r} now gives patch grid "
            f"{new_grids[bad].tolist()}, the batch recorded {grids[bad].tolist()} (the image or the processor changed)"
        )
    return VisionInputs(pixels, grids, counts, offsets), refs
