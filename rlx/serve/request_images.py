"""`rlx serve` parts: the image content parts of chat requests, read into rlx's form and compared by content.

A user, tool or system message's content may hold OpenAI image parts `{"type": "image_url", "image_url": {"url":
URL}}` and rlx's own `{"type": "image", "image": URL}`, next to text parts. Which URLs a client may send is the
server's `ImagePolicy` (a request comes from outside; a prompts file is the user's own):

- a `data:image/...;base64,` URI, always;
- a local path or `file://` URL only when the server has an image root (`rlx serve --image-root DIR`): a relative
  path is taken from DIR, the resolved path (symlinks followed) must stay under DIR, and only a regular file is
  read (never a device, FIFO or socket), opened without following a last symlink and read up to a size limit;
  a path outside DIR is refused with the same words whether or not it exists;
- the references the prompts file itself named (`rlx rollout --agent` hands them to its agents);
- nothing else: no fsspec protocol (`zip://...::http://...`, `s3://`, `memory://`) and no network, ever.
Both part forms become rlx's part with the reference as given (a relative path joined to the root): what the
chat template renders, what the episode's images load (images.py, as for environment replies) and what the record
keeps. A message of text parts alone becomes a string, as before.

Whether a request extends its sample's segment is decided on its messages with every image reference replaced by
the SHA-256 digest of the image's decoded RGB pixels and size (`RequestImages.keys`): the same picture sent first as
a path and then as a data: URI, or re-encoded without loss (another PNG compression, BMP), continues the segment;
another picture under the same path rewrites the history. The digests are taken as the images are loaded and
processed (`ContentImageCache`, keyed by digest and bounded in size; bytes seen before are not decoded again),
outside the server's tokenizer lock, so rendering finds them processed.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from rlx.chat.images import EpisodeImages, ImageCache, process_image, why_no_images
from rlx.errors import UserError
from rlx.models.vision.images import IMAGE_PART, decode_data_uri, decode_image, read_image_bytes

IMAGE_URL_PART = "image_url"
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_FILE_URL = "file://"
CACHE_BYTES = 256 * 2**20
"""How many bytes of processed pixels a server keeps for images that recur (the n samples' opening picture)."""


def _short(ref: str) -> str:
    return ref if len(ref) <= 60 or not ref.startswith("data:") else ref[:57] + "..."


@dataclass(frozen=True)
class ImagePolicy:
    """Which image references a client may send, and how much of an image file is read."""

    root: Path | None = None
    """The resolved folder clients' paths are taken from and must stay under; None: no paths (data: URIs only)."""
    max_bytes: int = 32 * 2**20
    known: frozenset[str] = frozenset()
    """References allowed as they are (the prompts file's own, read by its rules: images.py)."""

    @classmethod
    def of(cls, root: str, max_bytes: int, known=()) -> ImagePolicy:
        folder = None
        if root:
            folder = Path(os.path.realpath(root))
            if not folder.is_dir():
                raise UserError(f"--image-root {root!r} is not a folder")
        return cls(folder, max_bytes, frozenset(known))

    def ref(self, ref: str, where: str) -> str:
        """`ref` as the server will read and record it (a relative path joined to the root), or a UserError."""
        if ref.startswith("data:") or ref in self.known:
            return ref
        path = ref[len(_FILE_URL) :] if ref.lower().startswith(_FILE_URL) else ref
        if _SCHEME.match(path) or "::" in path:
            raise UserError(
                f"{where}: image URL {_short(ref)!r} is refused: a request may name images only as data: URIs or, "
                f"with --image-root, files under it (rlx serve fetches nothing from the network or other file systems)"
            )
        if self.root is None:
            raise UserError(
                f"{where}: image path {_short(ref)!r} is refused: this server takes images as data: URIs (start it "
                f"with --image-root DIR to allow files under DIR)"
            )
        return str(self.root / path) if not os.path.isabs(path) else path

    def read(self, ref: str, sample_id: str) -> bytes:
        """The bytes behind a reference `ref()` gave."""
        if ref.startswith("data:"):
            data = decode_data_uri(ref, sample_id)
        elif ref in self.known:
            return read_image_bytes(ref, sample_id)
        else:
            data = read_under(ref, self.root, self.max_bytes, f"sample {sample_id!r}")
        if len(data) > self.max_bytes:
            raise UserError(f"sample {sample_id!r}: image {_short(ref)!r} is over {self.max_bytes} bytes")
        return data


def read_under(path: str, root: Path | None, max_bytes: int, where: str) -> bytes:
    """A regular file's bytes, if `path` resolves (symlinks followed) to a file under `root` of at most `max_bytes`;
    a path outside `root` is refused with the same words whether or not it exists."""
    outside = UserError(f"{where}: image {path!r} is outside --image-root")
    if root is None:
        raise outside
    real = os.path.realpath(path)
    if os.path.commonpath([real, str(root)]) != str(root):
        raise outside
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise UserError(f"{where}: image {path!r} does not exist under --image-root") from None
    except OSError:
        raise UserError(f"{where}: image {path!r} cannot be opened") from None
    try:
        opened = f"/proc/self/fd/{fd}"  # the file opened, whatever changed on the path since realpath
        if os.path.exists(opened) and os.path.commonpath([os.readlink(opened), str(root)]) != str(root):
            raise outside
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UserError(f"{where}: image {path!r} is not a regular file")
        if info.st_size > max_bytes:
            raise UserError(f"{where}: image {path!r} is over {max_bytes} bytes")
        return _read_fd(fd, max_bytes, f"{where}: image {path!r}")
    finally:
        os.close(fd)


def _read_fd(fd: int, max_bytes: int, what: str) -> bytes:
    chunks, size = [], 0
    while True:
        chunk = os.read(fd, min(2**20, max_bytes + 1 - size))
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
        if size > max_bytes:
            raise UserError(f"{what} is over {max_bytes} bytes")


def _image_ref(part: dict, where: str, policy: ImagePolicy | None) -> str:
    """The reference of an `image_url` or `image` part (as `policy` takes it; as given without one)."""
    if part["type"] == IMAGE_URL_PART:
        value = part.get(IMAGE_URL_PART)
        ref = value.get("url") if isinstance(value, dict) else value
        shape = '{"type": "image_url", "image_url": {"url": URL}}'
    else:
        ref, shape = part.get(IMAGE_PART), '{"type": "image", "image": URL}'
    if not isinstance(ref, str) or not ref:
        raise UserError(f"{where}: an image part must be {shape} with a non-empty URL string, got {part!r:.120}")
    return ref if policy is None else policy.ref(ref, where)


def read_content(content, where: str, policy: ImagePolicy | None = None) -> str | list[dict]:
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
            parts.append({"type": IMAGE_PART, IMAGE_PART: _image_ref(part, f"{where} part {i}", policy)})
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

    def __init__(self, processor, policy: ImagePolicy, max_bytes: int = CACHE_BYTES):
        super().__init__(processor)
        self.policy = policy
        self.max_bytes = max_bytes
        self._by_digest: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._pixels_of: OrderedDict[str, str] = OrderedDict()  # encoded bytes' digest -> pixels' digest
        self._num_bytes = 0

    def load(self, ref: str, sample_id: str) -> tuple[str, torch.Tensor, torch.Tensor]:
        """(digest, pixels, grid) of the image behind `ref` (read now: a file that changed is another image)."""
        data = self.policy.read(ref, sample_id)
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

    def __init__(
        self, cache: ContentImageCache | None, engine_name: str, takes_images: bool, why_not: str,
        policy: ImagePolicy | None = None,
    ):  # fmt: skip
        """`cache`: None when the model takes no images (`why_not` says why); `engine_name`, `takes_images`: the
        rollout engine's; `policy`: which references clients may send (data: URIs only without one)."""
        self.cache, self.engine_name, self.takes_images, self.why_not = cache, engine_name, takes_images, why_not
        self.policy = policy or ImagePolicy()

    @classmethod
    def of_engine(cls, engine, policy: ImagePolicy | None = None) -> RequestImages:
        processor, policy = engine.encoder.processor, policy or ImagePolicy()
        cache = ContentImageCache(processor, policy) if processor is not None else None
        return cls(cache, engine.name, engine.takes_images, why_no_images(engine), policy)

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
