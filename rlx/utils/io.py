"""File plumbing shared by every stage: atomic writes, JSONL with line-numbered errors, stdin/stdout.

Outputs are written under a temporary name in the destination folder and renamed into place, so a
failure (or a kill) never leaves a partial file that looks whole. Any path may also be an fsspec
URL (s3://, hdfs://, memory://, ...): remote outputs are written locally first and published by
rlx.utils.storage (atomically where the store allows, else with the marker file last); remote
inputs are read through it. Keep URLs as strings: pathlib.Path would fold their '//'.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from rlx.errors import UserError
from rlx.utils import storage
from rlx.utils.files import atomic_local_dir, atomic_local_path, is_remote, join, local

__all__ = ["is_remote", "join", "local"]  # path helpers re-exported: callers need one import for file plumbing

STDIO = "-"


def exists(path: str | Path) -> bool:
    return storage.path_exists(path) if is_remote(path) else local(path).exists()


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to `path`; rename it onto `path` only if the block succeeds.
    For a URL: a local temporary file, published with storage.write_bytes_atomic on success."""
    if not is_remote(path):
        with atomic_local_path(path) as tmp:
            yield tmp
        return
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder) / "upload"
        yield tmp
        storage.write_bytes_atomic(str(path), tmp.read_bytes())


@contextlib.contextmanager
def atomic_dir(path: str | Path, overwrite: bool = False, marker: str | None = None) -> Iterator[Path]:
    """Yield a temporary folder next to `path`; rename it onto `path` only if the block succeeds.

    An existing `path` is an error unless `overwrite` is set, in which case it is replaced whole.
    For a URL: a local temporary folder, uploaded by storage.put_dir on success (`marker` is the
    file written last where the store cannot rename folders atomically).
    """
    if not is_remote(path):
        with atomic_local_dir(path, overwrite) as tmp:
            yield tmp
        return
    if exists(path) and not overwrite:
        raise UserError(f"{path}: already exists (choose another output or pass --overwrite)")
    with tempfile.TemporaryDirectory() as folder:
        yield Path(folder)
        storage.put_dir(folder, str(path), marker=marker, overwrite=overwrite)


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
        text = storage.read_text(str(path)) if storage.path_exists(path) else ""
        storage.write_bytes_atomic(str(path), (text + dumps_line(record) + "\n").encode())
        return
    path = local(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(dumps_line(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: str | Path, cut_end: bool = False) -> list[tuple[int, dict]]:
    """Read JSONL from `path` (or stdin for '-') as (line number, object) pairs; blank lines skipped.

    Raises UserError naming the file and line for unreadable files, bad JSON and non-object lines. `cut_end`: a last
    line that is not JSON is skipped (a file another process is still writing).
    """
    name = "<stdin>" if str(path) == STDIO else str(path)
    if str(path) == STDIO:
        lines = sys.stdin.read().splitlines()
    elif is_remote(path):
        lines = storage.read_text(str(path)).splitlines()
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
            if cut_end and number == len(lines):
                break
            raise UserError(f"{name}:{number}: malformed JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise UserError(f"{name}:{number}: expected a JSON object, got {type(obj).__name__}")
        out.append((number, obj))
    return out


def read_json(path: str | Path) -> dict:
    """Read one JSON object from a file, with a UserError naming the file on failure."""
    p = path if is_remote(path) else local(path)
    try:
        obj = json.loads(storage.read_text(str(p)) if is_remote(p) else p.read_text(encoding="utf-8"))
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
