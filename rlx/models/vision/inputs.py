"""The vision inputs of a list of samples, and their compact form inside batch.safetensors.

`VisionInputs` holds what the model's forward takes besides token ids: all images' patches
(`pixel_values` [P, C*T*p*p], in sample order), each image's patch grid (`image_grid_thw` [N, 3]) and
how many images each sample has. Micro-batches take subsets of samples with `select`.

A training batch stores them compactly (`to_tensors` / `from_tensors`): the grids and per-sample
counts as tensors, the image references as JSON in the safetensors header, and the pixels only when
asked (`store_pixels`). Without pixels, `from_tensors` reloads the images through the processor and
checks that each grid comes out as recorded, so a changed image file or processor setting is an
error rather than a silent mismatch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from rlx.errors import UserError

GRID_KEY = "vision/image_grid_thw"
COUNT_KEY = "vision/images_per_sample"
PIXELS_KEY = "vision/pixel_values"
REFS_KEY = "vision_image_refs"
FORMAT_KEY = "vision_format_version"
FORMAT_VERSION = "1"


@dataclass(frozen=True)
class VisionInputs:
    """Images of several samples, concatenated in sample order."""

    pixel_values: torch.Tensor | None
    """[P, D] float: every image's patches (None when no sample has an image)."""
    image_grid_thw: torch.Tensor
    """[N, 3] int64: each image's (t, h, w) patch grid."""
    images_per_sample: tuple[int, ...]
    """Images of each sample, in order (sums to N)."""

    def __post_init__(self):
        if sum(self.images_per_sample) != self.image_grid_thw.shape[0]:
            raise ValueError(f"{self.image_grid_thw.shape[0]} grids for {sum(self.images_per_sample)} images")
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
        """The samples of `parts` one after another."""
        pixels = [p.pixel_values for p in parts if p.pixel_values is not None]
        return cls(
            torch.cat(pixels) if pixels else None,
            torch.cat([p.image_grid_thw for p in parts]) if parts else torch.zeros(0, 3, dtype=torch.long),
            tuple(n for p in parts for n in p.images_per_sample),
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
        if not images:
            return VisionInputs.empty(len(samples))
        rows = [torch.arange(patch_start[i], patch_start[i + 1]) for i in images]
        return VisionInputs(
            self.pixel_values[torch.cat(rows)],
            self.image_grid_thw[images],
            tuple(self.images_per_sample[s] for s in samples),
        )

    def sample(self, index: int) -> VisionInputs:
        """The inputs of one sample."""
        return self.select([index])

    def grids_of(self, index: int) -> torch.Tensor:
        """[n, 3] grids of sample `index`'s images."""
        start = sum(self.images_per_sample[:index])
        return self.image_grid_thw[start : start + self.images_per_sample[index]]

    def to(self, device, dtype: torch.dtype | None = None) -> VisionInputs:
        """The same inputs with pixel_values (and grids) on `device`; pixels cast to `dtype` when given."""
        pixels = None if self.pixel_values is None else self.pixel_values.to(device, dtype)
        return VisionInputs(pixels, self.image_grid_thw.to(device), self.images_per_sample)

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
    metadata = {REFS_KEY: json.dumps(image_refs), FORMAT_KEY: FORMAT_VERSION}
    return tensors, metadata


def from_tensors(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str], processor=None, source: str = "batch", sample_ids=None
):
    """(VisionInputs, image refs per sample) back from `to_tensors`' output. Without stored pixels the images
    are reloaded through `processor` (a `VisionProcessor`) and their grids checked against the stored ones;
    errors name `source` (the batch file) and, when given, the sample's id."""
    if GRID_KEY not in tensors or COUNT_KEY not in tensors or REFS_KEY not in metadata:
        raise UserError(f"{source}: no vision inputs (expected {GRID_KEY}, {COUNT_KEY} and header {REFS_KEY})")
    if metadata.get(FORMAT_KEY) != FORMAT_VERSION:
        raise UserError(f"{source}: vision format version {metadata.get(FORMAT_KEY)!r}, expected {FORMAT_VERSION}")
    grids, counts = tensors[GRID_KEY].long(), tuple(int(n) for n in tensors[COUNT_KEY].tolist())
    refs = json.loads(metadata[REFS_KEY])
    if [len(r) for r in refs] != list(counts):
        raise UserError(f"{source}: header {REFS_KEY} does not match {COUNT_KEY}")
    if PIXELS_KEY in tensors:
        return VisionInputs(tensors[PIXELS_KEY], grids, counts), refs
    if not len(grids):
        return VisionInputs.empty(len(counts)), refs
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
    return VisionInputs(pixels, grids, counts), refs
