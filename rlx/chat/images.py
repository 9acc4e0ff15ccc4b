"""Multi-turn: the images of an episode, from the image parts of its opening messages and environment replies.

A message's content may be a list of parts, `{"type": "text", "text": ...}` and `{"type": "image", "image": REF}`
(a path, an fsspec URL or a data: URI, as in prompts.jsonl; a relative path is taken from the current folder). The
chat template renders each image part as the family's placeholder; `EpisodeImages.render` loads the images of the
new messages through the model's processor (the same loading and errors as single-turn prompts, naming the sample
and the reference), repeats each image's placeholder once per merged patch and notes where each image's tokens
start. Once the tokens join the trajectory (`add`), every later turn's request carries all of the episode's images
so far (`vision`, with their offsets: the engines place each image's rows there and compute the 3-D positions of
the whole context from them; every other placeholder token, one the model sampled, stays text). The record keeps
the references in token order (`RolloutRecord.image_refs`), never pixels.

The images of a reference are processed once per rollout (`ImageCache`): the N samples of a prompt show the same
opening images.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlx.errors import UserError
from rlx.models.family import family_of
from rlx.models.vision.images import ImageError, image_refs, resolve_ref
from rlx.models.vision.inputs import VisionInputs
from rlx.models.vision.positions import find_image_offsets, image_token_count


class ImageCache:
    """(pixels [P, D], grid [1, 3]) per resolved reference, shared by a rollout's episodes."""

    def __init__(self, processor):
        self.processor = processor
        self._items: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()  # agents' samples render from several threads

    def get(self, ref: str, sample_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        with self._lock:
            found = self._items.get(ref)
        if found is None:
            found = process_image(self.processor, self.processor.load(ref, prompt_id=sample_id), ref, sample_id)
            with self._lock:
                self._items[ref] = found
        return found


def process_image(processor, image, ref: str, sample_id: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One PIL image through the processor: (pixels [P, D], grid [1, 3]); an image it cannot take (an extreme
    aspect ratio) is an ImageError naming the sample and the reference."""
    try:
        return processor.process_images([image])
    except ValueError as e:
        shown = ref if len(ref) <= 60 or not ref.startswith("data:") else ref[:57] + "..."
        raise ImageError(f"prompt {sample_id!r}: image {shown!r} cannot be processed ({e})") from None


@dataclass
class RenderedImages:
    """New messages' tokens with their images' placeholders expanded, and those images."""

    ids: list[int]
    refs: list[str] = field(default_factory=list)
    pixels: list[torch.Tensor] = field(default_factory=list)
    grids: list[torch.Tensor] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    """Where each image's tokens start in `ids`."""


class EpisodeImages:
    """One episode's images so far: references, pixels, grids and where their tokens start in its context."""

    def __init__(self, sample_id: str, cache: ImageCache | None, engine_name: str, takes_images: bool, why_not=""):
        """`cache`: the rollout's images (None: the model takes none, `why_not` says why); `engine_name`,
        `takes_images`: the rollout engine's."""
        self.sample_id, self.cache, self.why_not = sample_id, cache, why_not
        self.engine_name, self.takes_images = engine_name, takes_images
        self.refs: list[str] = []
        self._pixels: list[torch.Tensor] = []
        self._grids: list[torch.Tensor] = []
        self._offsets: list[int] = []
        self._vision: VisionInputs | None = None

    def render(self, messages: list[dict], source: str, render_ids: Callable[[], list[int]]) -> RenderedImages:
        """The template tokens of `messages` (from `source`, e.g. "the environment's step()" or "the request's"),
        `render_ids()`, with each image's placeholder repeated once per merged patch of its image (checked before
        the template renders them)."""
        refs = self.image_refs_of(messages, source)
        ids = render_ids()
        if not refs:
            return RenderedImages(list(ids))
        processor = self.cache.processor
        loaded = [self.cache.get(ref, self.sample_id) for ref in refs]
        grids = torch.cat([grid for _, grid in loaded])
        expanded = processor.expand_placeholders(list(ids), grids, self.sample_id)
        counts = [image_token_count(g.tolist(), processor.merge_size) for g in grids]
        offsets = find_image_offsets(expanded, processor.image_token_id, counts)
        return RenderedImages(expanded, refs, [p for p, _ in loaded], [g for _, g in loaded], offsets)

    def image_refs_of(self, messages: list[dict], source: str) -> list[str]:
        """The resolved references of the messages' image parts, in order; a UserError naming the sample and the
        message (`source`'s message i) when the model or engine takes no images."""
        refs = []
        for i, message in enumerate(messages):
            found = image_refs([message], self.sample_id)
            if found and self.cache is None:
                raise UserError(
                    f"sample {self.sample_id!r}: {source} message {i} ({message.get('role')}) has image parts, "
                    f"but {self.why_not}"
                )
            if found and not self.takes_images:
                raise UserError(
                    f"sample {self.sample_id!r}: {source} message {i} ({message.get('role')}) has image parts, "
                    f"which engine {self.engine_name!r} does not take (use engine 'hf' or 'native')"
                )
            refs += [resolve_ref(ref, Path.cwd()) for ref in found]
        return refs

    def add(self, rendered: RenderedImages, start: int) -> None:
        """The rendered tokens joined the context at token `start`: their images are the episode's from now on."""
        if not rendered.refs:
            return
        self.refs += rendered.refs
        self._pixels += rendered.pixels
        self._grids += rendered.grids
        self._offsets += [start + o for o in rendered.offsets]
        self._vision = None

    def vision(self) -> VisionInputs | None:
        """Every image so far as one sample's VisionInputs with their offsets (None without images)."""
        if not self.refs:
            return None
        if self._vision is None:
            self._vision = VisionInputs(
                torch.cat(self._pixels), torch.cat(self._grids), (len(self.refs),), tuple(self._offsets)
            )
        return self._vision

    def vision_with(self, rendered: RenderedImages, start: int) -> VisionInputs | None:
        """`vision()` as it will be once `rendered` joins the context at token `start` (nothing is recorded: a
        request generates with its new images before they are the episode's)."""
        if not rendered.refs:
            return self.vision()
        offsets = tuple(self._offsets) + tuple(start + o for o in rendered.offsets)
        pixels, grids = torch.cat(self._pixels + rendered.pixels), torch.cat(self._grids + rendered.grids)
        return VisionInputs(pixels, grids, (len(self.refs) + len(rendered.refs),), offsets)


def why_no_images(engine) -> str:
    """Why a rollout engine without an image processor takes no images: a text-only model, or a vision-language
    model loaded without its processor."""
    config = getattr(engine.model, "config", None)
    if config is not None and family_of(config).takes_images:
        return "no image processor was loaded for the model"
    return f"model type {getattr(config, 'model_type', None)!r} is a text-only model"
