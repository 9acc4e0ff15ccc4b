"""Image parts of chat prompts: finding them, resolving their references and loading them with Pillow.

An image part is `{"type": "image", "image": REF}` inside a message's content list, where REF is

- a local path, absolute or relative to the prompts file's folder (`base` below),
- an fsspec URL (`memory://`, `file://`, `s3://` with s3fs, `http(s)://` with aiohttp, ...),
- a `data:image/...;base64,...` URI holding the encoded image itself.

Records keep the reference, never pixels. Every error is a UserError naming the prompt id and the
reference (data URIs shortened); one reading or decoding an image is an `ImageError` (a missing or broken file,
bad base64, not a regular file, over MAX_IMAGE_BYTES), which multi-turn rollouts count against the environment
that sent it.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
import stat
from contextlib import contextmanager
from pathlib import Path

from rlx.errors import UserError

IMAGE_PART = "image"
MAX_IMAGE_BYTES = 64 * 2**20
"""Largest image file read for a prompt (a regular file only: devices, FIFOs and sockets are refused)."""
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


class ImageError(UserError):
    """An image reference that cannot be read or decoded (the message names the prompt and the reference)."""


def _short(ref: str, limit: int = 60) -> str:
    """A reference as error messages show it (long data: URIs cut, paths and URLs whole)."""
    return ref if len(ref) <= limit or not ref.startswith("data:") else ref[: limit - 3] + "..."


def is_url(ref: str) -> bool:
    """Whether `ref` names a file system by protocol (`memory://x`, `s3://b/k`, `file:///p`)."""
    return _URL.match(ref) is not None


def image_refs(prompt, prompt_id=None) -> list[str]:
    """The image references of a prompt (text or chat messages), in the order the template renders them."""
    if isinstance(prompt, str):
        return []
    refs = []
    for message in prompt:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, dict) and part.get("type") == IMAGE_PART:
                ref = part.get(IMAGE_PART)
                if not isinstance(ref, str) or not ref:
                    raise UserError(
                        f"prompt {prompt_id!r}: an image part needs 'image': a path, URL or data: URI, got {ref!r}"
                    )
                refs.append(ref)
    return refs


def resolve_ref(ref: str, base: str | Path | None) -> str:
    """`ref` made independent of the current folder: relative local paths are joined to `base` (a folder
    or folder URL, normally the prompts file's); URLs, data: URIs and absolute paths are kept."""
    if ref.startswith("data:") or is_url(ref) or Path(ref).is_absolute() or base is None:
        return ref
    base = str(base)
    if is_url(base):
        return base.rstrip("/") + "/" + ref
    return str(Path(base) / ref)


def folder_of(path: str | Path) -> str | None:
    """The folder (or folder URL) a prompts file's relative image paths are relative to; None for stdin ('-')."""
    path = str(path)
    if path == "-":
        return None
    if is_url(path):
        return path.rsplit("/", 1)[0] if "/" in path.split("://", 1)[1] else path
    return str(Path(path).resolve().parent)


def resolve_prompt_images(prompt, base: str | Path | None):
    """`prompt` with each image reference resolved against `base` (see `resolve_ref`): a copy of the messages
    when a reference changes, the prompt itself otherwise."""
    if isinstance(prompt, str) or base is None:
        return prompt
    out, changed = [], False
    for message in prompt:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, dict) and part.get("type") == IMAGE_PART and isinstance(part.get(IMAGE_PART), str):
                    resolved = resolve_ref(part[IMAGE_PART], base)
                    changed |= resolved != part[IMAGE_PART]
                    part = {**part, IMAGE_PART: resolved}
                parts.append(part)
            message = {**message, "content": parts}
        out.append(message)
    return out if changed else prompt


def decode_data_uri(ref: str, prompt_id) -> bytes:
    header, comma, payload = ref.partition(",")
    if not comma or not header.endswith(";base64"):
        raise ImageError(f"prompt {prompt_id!r}: image {_short(ref)!r} is a data: URI without ';base64,' data")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"prompt {prompt_id!r}: image {_short(ref)!r} has bad base64 data ({e})") from None


def read_image_bytes(ref: str, prompt_id=None, max_bytes: int = MAX_IMAGE_BYTES) -> bytes:
    """The bytes behind a resolved reference (data: URI, fsspec URL or local path): a regular file (never a device,
    FIFO or socket) of at most `max_bytes`."""
    if ref.startswith("data:"):
        return decode_data_uri(ref, prompt_id)
    if not is_url(ref) or ref.startswith("file://"):
        return _read_local(ref.removeprefix("file://"), ref, prompt_id, max_bytes)
    import fsspec

    try:
        with fsspec.open(ref, "rb") as f:
            data = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise ImageError(f"prompt {prompt_id!r}: image {ref!r} does not exist") from None
    except ImportError as e:
        raise ImageError(f"prompt {prompt_id!r}: image {ref!r}: its protocol needs an extra package ({e})") from None
    except (OSError, ValueError) as e:
        raise ImageError(f"prompt {prompt_id!r}: image {ref!r} cannot be read ({e})") from None
    if len(data) > max_bytes:
        raise ImageError(f"prompt {prompt_id!r}: image {ref!r} is over {max_bytes} bytes")
    return data


def _read_local(path: str, ref: str, prompt_id, max_bytes: int) -> bytes:
    """A local file's bytes, refused unless it is a regular file of at most `max_bytes` (opened without blocking, so
    a FIFO is refused rather than waited on)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except FileNotFoundError:
        raise ImageError(f"prompt {prompt_id!r}: image {ref!r} does not exist") from None
    except OSError as e:
        raise ImageError(f"prompt {prompt_id!r}: image {ref!r} cannot be read ({e.strerror or e})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ImageError(f"prompt {prompt_id!r}: image {ref!r} is not a regular file")
        if info.st_size > max_bytes:
            raise ImageError(f"prompt {prompt_id!r}: image {ref!r} is over {max_bytes} bytes")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise ImageError(f"prompt {prompt_id!r}: image {ref!r} cannot be read ({e.strerror or e})") from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise ImageError(f"prompt {prompt_id!r}: image {ref!r} is over {max_bytes} bytes")
    return data


@contextmanager
def _opened(ref: str, prompt_id, data: bytes | None = None):
    """The image behind resolved `ref` (whose bytes are `data` when given), opened by Pillow (errors reading or
    decoding it name the prompt and image)."""
    from PIL import Image, UnidentifiedImageError

    data = read_image_bytes(ref, prompt_id) if data is None else data
    try:
        with Image.open(io.BytesIO(data)) as image:
            yield image
    except UnidentifiedImageError:
        raise ImageError(f"prompt {prompt_id!r}: image {_short(ref)!r} is not an image format Pillow reads") from None
    except (OSError, SyntaxError, ValueError) as e:
        raise ImageError(f"prompt {prompt_id!r}: image {_short(ref)!r} is not a readable image ({e})") from None


def load_image(ref: str, *, prompt_id=None, base: str | Path | None = None):
    """The image behind `ref` as an RGB `PIL.Image` (decoded now, so a broken file fails here)."""
    with _opened(resolve_ref(ref, base), prompt_id) as image:
        image.load()
        return image.convert("RGB")


def decode_image(data: bytes, ref: str, *, prompt_id=None):
    """The image whose encoded bytes `data` were read from `ref`, as an RGB `PIL.Image` (errors name `ref`)."""
    with _opened(ref, prompt_id, data) as image:
        image.load()
        return image.convert("RGB")


def image_size(ref: str, *, prompt_id=None, base: str | Path | None = None) -> tuple[int, int]:
    """(width, height) of the image behind `ref`, from its header (the pixels are not decoded)."""
    with _opened(resolve_ref(ref, base), prompt_id) as image:
        return image.size


def data_uri(image, fmt: str = "PNG") -> str:
    """A `PIL.Image` encoded as a `data:image/...;base64,` URI."""
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
