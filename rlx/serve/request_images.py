"""`rlx serve` parts: the image content parts of chat requests, read into rlx's form and compared by content.

A user, tool or system message's content may hold OpenAI image parts `{"type": "image_url", "image_url": {"url":
URL}}` and rlx's own `{"type": "image", "image": URL}`, next to text parts. URL is a `data:image/...;base64,` URI, a
local path (a relative one is taken from the server's current folder) or a `file://` URL (any fsspec URL but
http(s): rlx fetches nothing from the network while it rolls out). Both forms become rlx's part with the reference
resolved: what the chat template renders, what the episode's images load (images.py, as for environment replies)
and what the record keeps. A message of text parts alone becomes a string, as before.

Whether a request extends its sample's segment is decided on its messages with every image reference replaced by
the SHA-256 digest of the image's decoded RGB pixels and size (`RequestImages.keys`): the same picture sent first as
a path and then as a data: URI, or re-encoded without loss (another PNG compression, BMP), continues the segment;
another picture under the same path rewrites the history. The digests are taken as the images are loaded and
processed (`ContentImageCache`, keyed by digest and bounded in size; bytes seen before are not decoded again),
outside the server's tokenizer lock, so rendering finds them processed.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from pathlib import Path

import torch

from rlx.chat.images import EpisodeImages, ImageCache, process_image, why_no_images
from rlx.errors import UserError
from rlx.models.vision.images import IMAGE_PART, decode_image, read_image_bytes, resolve_ref

IMAGE_URL_PART = "image_url"
_FETCHED = ("http://", "https://")
CACHE_BYTES = 256 * 2**20
"""How many bytes of processed pixels a server keeps for images that recur (the n samples' opening picture)."""


def _short(ref: str) -> str:
    return ref if len(ref) <= 60 or not ref.startswith("data:") else ref[:57] + "..."


def _image_ref(part: dict, where: str) -> str:
    """The reference of an `image_url` or `image` part, resolved against the current folder."""
    if part["type"] == IMAGE_URL_PART:
        value = part.get(IMAGE_URL_PART)
        ref = value.get("url") if isinstance(value, dict) else value
        shape = '{"type": "image_url", "image_url": {"url": URL}}'
    else:
        ref, shape = part.get(IMAGE_PART), '{"type": "image", "image": URL}'
    if not isinstance(ref, str) or not ref:
        raise UserError(f"{where}: an image part must be {shape} with a non-empty URL string, got {part!r:.120}")
    if ref.lower().startswith(_FETCHED):
        raise UserError(
            f"{where}: image URL {ref!r} cannot be fetched: rlx reads no images from the network; send it as a "
            f"data:image/...;base64, URI, a local path or a file:// URL"
        )
    return resolve_ref(ref, Path.cwd())


def read_content(content, where: str) -> str | list[dict]:
    """A message's content as the template takes it: a string (None, a string, or text parts alone), or a list of
    text parts and rlx image parts with resolved references. Other parts (audio, files) are a UserError naming
    `where` (e.g. 'message 2') and the part's type: dropping them would train on a conversation the model never saw."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise UserError(f"{where}: content must be a string or a list of content parts, got {type(content).__name__}")
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind in (IMAGE_URL_PART, IMAGE_PART):
            parts.append({"type": IMAGE_PART, IMAGE_PART: _image_ref(part, f"{where} part {i}")})
        else:
            raise UserError(
                f"{where}: content parts of type {kind!r} are not supported by this endpoint (text parts, and image "
                f"parts for a vision-language model: image_url or image)"
            )
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def has_images(message: dict) -> bool:
    """Whether a read message (see `read_content`) holds image parts."""
    return isinstance(message.get("content"), list)


class ContentImageCache(ImageCache):
    """(pixels [P, D], grid [1, 3]) per image content (the digest of its decoded pixels), the least recently used
    dropped past `max_bytes` of pixels (an episode keeps its own images' pixels); and the pixel digest of the encoded
    bytes seen last (up to `MAX_ENCODINGS` of them), so that bytes seen before are not decoded again."""

    MAX_ENCODINGS = 4096

    def __init__(self, processor, max_bytes: int = CACHE_BYTES):
        super().__init__(processor)
        self.max_bytes = max_bytes
        self._by_digest: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._pixels_of: OrderedDict[str, str] = OrderedDict()  # encoded bytes' digest -> pixels' digest
        self._num_bytes = 0

    def load(self, ref: str, sample_id: str) -> tuple[str, torch.Tensor, torch.Tensor]:
        """(digest, pixels, grid) of the image behind `ref` (read now: a file that changed is another image)."""
        data = read_image_bytes(ref, sample_id)
        encoded = hashlib.sha256(data).hexdigest()
        with self._lock:
            digest = self._pixels_of.get(encoded)
            found = self._by_digest.get(digest) if digest else None
            if found is not None:
                self._by_digest.move_to_end(digest)
        if found is None:
            image = decode_image(data, ref, prompt_id=sample_id)
            digest = pixel_digest(image)
            with self._lock:
                found = self._by_digest.get(digest)
            if found is None:
                found = process_image(self.processor, image, ref, sample_id)
                self._keep(digest, found)
            with self._lock:
                self._pixels_of[encoded] = digest
                while len(self._pixels_of) > self.MAX_ENCODINGS:
                    self._pixels_of.popitem(last=False)
        return digest, *found

    def get(self, ref: str, sample_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        _, pixels, grid = self.load(ref, sample_id)
        return pixels, grid

    def _keep(self, digest: str, item: tuple[torch.Tensor, torch.Tensor]) -> None:
        with self._lock:
            if digest in self._by_digest:
                return
            self._by_digest[digest] = item
            self._num_bytes += item[0].nbytes
            while self._num_bytes > self.max_bytes and len(self._by_digest) > 1:
                _, (pixels, _) = self._by_digest.popitem(last=False)
                self._num_bytes -= pixels.nbytes


def pixel_digest(image) -> str:
    """SHA-256 of a decoded RGB `PIL.Image`'s size and pixels: the same for any lossless encoding of it."""
    return hashlib.sha256(f"{image.width}x{image.height}:".encode() + image.tobytes()).hexdigest()


class RequestImages:
    """What a server's engine makes of image parts: the episodes' images of its segments, and request keys."""

    def __init__(self, cache: ContentImageCache | None, engine_name: str, takes_images: bool, why_not: str):
        """`cache`: None when the model takes no images (`why_not` says why); `engine_name`, `takes_images`: the
        rollout engine's."""
        self.cache, self.engine_name, self.takes_images, self.why_not = cache, engine_name, takes_images, why_not

    @classmethod
    def of_engine(cls, engine) -> RequestImages:
        processor = engine.encoder.processor
        cache = ContentImageCache(processor) if processor is not None else None
        return cls(cache, engine.name, engine.takes_images, why_no_images(engine))

    def episode(self, sample_id: str) -> EpisodeImages:
        """A new segment's images."""
        return EpisodeImages(sample_id, self.cache, self.engine_name, self.takes_images, self.why_not)

    def keys(self, messages: list[dict], sample_id: str) -> list[dict]:
        """Read `messages` with each image reference replaced by its content digest, to compare requests by (the
        images are loaded and processed now; UserErrors name the sample and the message, for a model or engine that
        takes no images, or an image that cannot be read)."""
        if not any(has_images(m) for m in messages):
            return messages
        self.episode(sample_id).image_refs_of(messages, "the request's")  # refuses images where none are taken
        out = []
        for message in messages:
            if has_images(message):
                parts = [
                    {"type": IMAGE_PART, "digest": self.cache.load(p[IMAGE_PART], sample_id)[0]}
                    if p["type"] == IMAGE_PART
                    else p
                    for p in message["content"]
                ]
                message = {**message, "content": parts}
            out.append(message)
        return out
