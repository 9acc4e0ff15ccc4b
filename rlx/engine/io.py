"""File plumbing shared by every stage: atomic writes, JSONL with line-numbered errors, stdin/stdout.

Outputs are written under a temporary name in the destination folder and renamed into place, so a
failure (or a kill) never leaves a partial file that looks whole; the temporaries get the permissions
the umask gives new files and folders (mkstemp/mkdtemp alone would make every output owner-only).
Any path may also be an fsspec URL (s3://, hdfs://, memory://, ...): remote outputs are written
locally first and published by rlx.engine.storage (atomically where the store allows, else with the
marker file last); remote inputs are read through it. Keep URLs as strings: pathlib.Path would fold their '//'.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from rlx.errors import UserError

STDIO = "-"
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


def exists(path: str | Path) -> bool:
    if is_remote(path):
        from rlx.engine.storage import path_exists

        return path_exists(path)
    return local(path).exists()


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
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to `path`; rename it onto `path` only if the block succeeds.
    For a URL: a local temporary file, published with storage.write_bytes_atomic on success."""
    if is_remote(path):
        from rlx.engine.storage import write_bytes_atomic

        with tempfile.TemporaryDirectory() as folder:
            tmp = Path(folder) / "upload"
            yield tmp
            write_bytes_atomic(str(path), tmp.read_bytes())
        return
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
def atomic_dir(path: str | Path, overwrite: bool = False, marker: str | None = None) -> Iterator[Path]:
    """Yield a temporary folder next to `path`; rename it onto `path` only if the block succeeds.

    An existing `path` is an error unless `overwrite` is set, in which case it is replaced whole.
    For a URL: a local temporary folder, uploaded by storage.put_dir on success (`marker` is the
    file written last where the store cannot rename folders atomically).
    """
    if is_remote(path):
        from rlx.engine.storage import put_dir

        if exists(path) and not overwrite:
            raise UserError(f"{path}: already exists (choose another output or pass --overwrite)")
        with tempfile.TemporaryDirectory() as folder:
            yield Path(folder)
            put_dir(folder, str(path), marker=marker, overwrite=overwrite)
        return
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


def dumps_line(record: dict) -> str:
    """One JSONL line, compact, keys in insertion order, non-finite floats refused (naming the record and field)."""
    try:
        return json.dumps(record, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError as e:
        if "Out of range float" not in str(e):
            raise
        field = next((k for k, v in record.items() if not _is_finite(v)), "?")
        raise UserError(
            f"record {record.get('id', '?')!r}: '{field}' holds NaN or infinity, which JSON cannot store "
            f"(non-finite logits or rewards upstream)"
        ) from None


def _is_finite(value) -> bool:
    if isinstance(value, float):
        return value == value and abs(value) != float("inf")
    if isinstance(value, dict):
        return all(_is_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_is_finite(v) for v in value)
    return True


def write_jsonl(path: str | Path, records: Iterable[dict]) -> None:
    """Write records as JSONL to `path` atomically, or to stdout when `path` is '-'."""
    if str(path) == STDIO:
        for record in records:
            sys.stdout.write(dumps_line(record) + "\n")
        sys.stdout.flush()
        return
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for record in records:
            f.write(dumps_line(record) + "\n")


def append_jsonl(path: str | Path, record: dict) -> None:
    """Append one line and flush it to disk (metrics logs): a kill leaves whole lines only."""
    if is_remote(path):  # object stores cannot append: rewrite the whole (small) file atomically
        from rlx.engine.storage import path_exists, read_text, write_bytes_atomic

        text = read_text(str(path)) if path_exists(path) else ""
        write_bytes_atomic(str(path), (text + dumps_line(record) + "\n").encode())
        return
    path = local(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(dumps_line(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: str | Path) -> list[tuple[int, dict]]:
    """Read JSONL from `path` (or stdin for '-') as (line number, object) pairs; blank lines skipped.

    Raises UserError naming the file and line for unreadable files, bad JSON and non-object lines.
    """
    name = "<stdin>" if str(path) == STDIO else str(path)
    if str(path) == STDIO:
        lines = sys.stdin.read().splitlines()
    elif is_remote(path):
        from rlx.engine.storage import read_text

        lines = read_text(str(path)).splitlines()
    else:
        p = local(path)
        if not p.is_file():
            raise UserError(f"{name}: no such file")
        try:
            lines = p.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as e:
            raise UserError(f"{name}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    out = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{name}:{number}: malformed JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise UserError(f"{name}:{number}: expected a JSON object, got {type(obj).__name__}")
        out.append((number, obj))
    return out


def read_json(path: str | Path) -> dict:
    """Read one JSON object from a file, with a UserError naming the file on failure."""
    p = path if is_remote(path) else local(path)
    try:
        if is_remote(p):
            from rlx.engine.storage import read_text

            obj = json.loads(read_text(str(p)))
        else:
            obj = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{p}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise UserError(f"{p}: expected a JSON object")
    return obj


def write_json(path: str | Path, obj: dict) -> None:
    """Write one JSON object atomically, indented for people."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False, allow_nan=False) + "\n")
