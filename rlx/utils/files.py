"""Local file plumbing below everything else: URL/path helpers and atomic local writes.

Outputs are written under a temporary name in the destination folder and renamed into place, so a
failure (or a kill) never leaves a partial file that looks whole; the temporaries get the permissions the
umask gives new files and folders (mkstemp/mkdtemp alone would make every output owner-only). fsspec URLs
are handled one floor up (rlx.utils.storage, rlx.utils.io); keep URLs as strings: pathlib.Path would fold their '//'.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from rlx.errors import UserError

LOCAL_PROTOCOLS = ("file", "local")


def is_remote(path: str | Path) -> bool:
    """True for an fsspec URL other than file:// (s3://, hdfs://, memory://, ...); False for local paths."""
    text = str(path)
    return "://" in text and text.split("://", 1)[0].lower() not in LOCAL_PROTOCOLS


def local(path: str | Path) -> Path:
    """A local path from a plain path or a file:// URL."""
    text = str(path)
    for prefix in ("file://", "local://"):
        if text.startswith(prefix):
            return Path(text[len(prefix) :])
    return Path(text)


def join(base: str | Path, *names: str) -> str | Path:
    """`base / name...` for local paths, `base/name...` for URLs (which Path would corrupt)."""
    if is_remote(base):
        return "/".join([str(base).rstrip("/"), *names])
    return local(base).joinpath(*names)


def current_umask() -> int:
    """The process's umask (read from /proc where it can be, else by setting and restoring it)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(path: str | Path) -> None:
    """Give a file the permissions open() would under the umask (for writers that make it 0600 themselves,
    e.g. safetensors' save_file, which writes a temporary file and renames it)."""
    os.chmod(path, 0o666 & ~current_umask())


@contextlib.contextmanager
def atomic_local_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to local `path`; rename it onto `path` only if the block succeeds."""
    path = local(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.fchmod(fd, 0o666 & ~current_umask())  # mkstemp makes 0600: give it what open() would
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


@contextlib.contextmanager
def atomic_local_dir(path: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder next to local `path`; rename it onto `path` only if the block succeeds.
    An existing `path` is an error unless `overwrite` is set, in which case it is replaced whole."""
    path = local(path)
    if path.exists() and not overwrite:
        raise UserError(f"{path}: already exists (choose another output or pass --overwrite)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    tmp.chmod(0o777 & ~current_umask())  # mkdtemp makes 0700: give it what mkdir() would
    try:
        yield tmp
        if path.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
            os.replace(path, trash / "old")
            os.replace(tmp, path)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
