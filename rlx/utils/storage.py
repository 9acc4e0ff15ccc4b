"""Paths that may be fsspec URLs (s3://, hdfs://, gs://, memory://, file://) for models, data and checkpoints.

Local paths (and file:// URLs) are used in place; remote ones are read through fsspec, downloaded to
a local cache for loading (`local_path`, `get_dir`), and written so that readers never see half an
object or half a folder:

- `write_bytes_atomic`: the bytes go to a temporary name in the same folder, then are moved onto the
  final name. On a local disk or HDFS the move is a rename (atomic). On object stores (S3, GCS,
  Azure) a move is a server-side copy + delete; since an object store publishes an object only once
  it is whole, readers see the old object or the new one, never a partial one; a crash can leave
  the temporary object behind (named `.NAME.tmp-<hex>`).
- `put_dir`: a finished local folder is uploaded to `<url>.tmp-<hex>` and renamed onto `<url>` where
  the file system renames folders atomically (local, HDFS). Elsewhere (object stores, and fsspec's
  memory file system, whose move is a copy) it uploads straight to `<url>` with the marker file
  (a checkpoint's rlx.json) written last: a folder without its marker is incomplete, and readers
  (`get_dir(..., marker=...)`, rlx's checkpoint checks) treat it as absent.

The s3://, gs://, hdfs:// protocols need their fsspec packages (s3fs, gcsfs, pyarrow); a missing one
is a UserError naming it.
"""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path

import fsspec

from rlx.errors import UserError
from rlx.utils.cache import cache_root
from rlx.utils.files import atomic_local_dir, atomic_local_path, is_remote, local

# file systems whose folder rename is one atomic operation
ATOMIC_RENAME_PROTOCOLS = ("file", "local", "hdfs", "arrow_hdfs", "webhdfs")


def _fs(url: str):
    """(filesystem, path inside it) for a URL or local path; a missing fsspec filesystem package is a UserError."""
    try:
        return fsspec.core.url_to_fs(str(url))
    except ImportError as e:
        protocol = str(url).split("://", 1)[0]
        raise UserError(f"{url}: reading {protocol}:// needs an extra package ({e})") from None
    except ValueError as e:
        raise UserError(f"{url}: {e}") from None


def _protocols(fs) -> tuple[str, ...]:
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)


def has_atomic_rename(url: str) -> bool:
    """Whether the file system of `url` renames a folder in one atomic step (local disk, HDFS)."""
    fs, _ = _fs(url)
    return any(p in ATOMIC_RENAME_PROTOCOLS for p in _protocols(fs))


def _parent(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[0] if "/" in path.rstrip("/") else ""


def _name(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def _join(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name


def read_bytes(url: str | Path) -> bytes:
    """The whole content of a file given as a local path or URL; a missing file is a UserError."""
    fs, path = _fs(url)
    try:
        return fs.cat_file(path)
    except (FileNotFoundError, IsADirectoryError):
        raise UserError(f"{url}: no such file") from None


def read_text(url: str | Path, encoding: str = "utf-8") -> str:
    """A text file given as a local path or URL (UTF-8 by default)."""
    data = read_bytes(url)
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as e:
        raise UserError(f"{url}: not {encoding} text ({e.reason} at byte {e.start})") from None


def write_bytes_atomic(url: str | Path, data: bytes) -> None:
    """Write `data` to `url` (local path or URL) so that readers see the old content or all of the new.

    Local paths use rlx.utils.files.atomic_local_path; URLs write `.NAME.tmp-<hex>` beside the target and
    move it onto the target (see the module docstring for what atomic means on object stores).
    """
    if not is_remote(url):
        with atomic_local_path(_local(url)) as tmp:
            tmp.write_bytes(data)
        return
    fs, path = _fs(url)
    parent = _parent(path)
    tmp = _join(parent, f".{_name(path)}.tmp-{uuid.uuid4().hex[:12]}")
    if parent:
        fs.makedirs(parent, exist_ok=True)
    try:
        fs.pipe_file(tmp, data)
        fs.mv(tmp, path)
    finally:
        if fs.exists(tmp):
            fs.rm(tmp)


_local = local


def _local_files(local_dir: Path) -> list[Path]:
    """Every file under `local_dir`, relative, sorted (subfolders included)."""
    return sorted(p.relative_to(local_dir) for p in local_dir.rglob("*") if not p.is_dir())


def put_dir(
    local_dir: str | Path,
    url: str | Path,
    *,
    marker: str | None = "rlx.json",
    overwrite: bool = False,
    atomic_rename: bool | None = None,
) -> None:
    """Upload a finished local folder to `url` (local path or URL) so that it appears whole or not at all.

    atomic_rename None picks by file system (see ATOMIC_RENAME_PROTOCOLS). With a rename: upload into
    `<url>.tmp-<hex>` and rename it to `<url>`; a failure removes the temporary folder and leaves
    `<url>` untouched. Without: upload the files to `<url>` with `marker` (a file name relative to the
    folder, which must exist in `local_dir`) last; on overwrite the old marker is removed first; a
    failure removes the marker-less upload as far as it can. An existing `<url>` is a UserError
    unless `overwrite`.
    """
    local_dir = Path(local_dir)
    if not local_dir.is_dir():
        raise UserError(f"{local_dir}: no such folder")
    files = _local_files(local_dir)
    if marker is not None and Path(marker) not in files:
        raise UserError(f"{local_dir}: has no {marker} (the marker written last)")
    fs, path = _fs(url)
    path = path.rstrip("/")
    if fs.exists(path) and not overwrite:
        raise UserError(f"{url}: already exists (pass overwrite to replace it)")
    if atomic_rename is None:
        atomic_rename = any(p in ATOMIC_RENAME_PROTOCOLS for p in _protocols(fs))
    if atomic_rename:
        _put_renamed(fs, local_dir, files, path)
    else:
        ordered = [f for f in files if f != Path(marker or "")] + ([Path(marker)] if marker else [])
        _put_marker_last(fs, local_dir, ordered, path, marker)


def _upload(fs, local_dir: Path, files: list[Path], path: str) -> None:
    fs.makedirs(path, exist_ok=True)
    for rel in files:
        target = _join(path, rel.as_posix())
        fs.makedirs(_parent(target), exist_ok=True)
        fs.put_file(str(local_dir / rel), target)


def _put_renamed(fs, local_dir: Path, files: list[Path], path: str) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
    old = f"{path}.old-{uuid.uuid4().hex[:12]}"
    try:
        _upload(fs, local_dir, files, tmp)
        if fs.exists(path):
            fs.mv(path, old, recursive=True)
        fs.mv(tmp, path, recursive=True)
    except BaseException:
        if fs.exists(old) and not fs.exists(path):
            fs.mv(old, path, recursive=True)  # put the previous folder back
        raise
    finally:
        for leftover in (tmp, old):
            if fs.exists(leftover):
                fs.rm(leftover, recursive=True)


def _put_marker_last(fs, local_dir: Path, files: list[Path], path: str, marker: str | None) -> None:
    existed = fs.exists(path)
    if existed and marker and fs.exists(_join(path, marker)):
        fs.rm(_join(path, marker))  # the old folder stops looking complete before it changes
    try:
        _upload(fs, local_dir, files, path)
    except BaseException:
        if not existed and fs.exists(path):
            fs.rm(path, recursive=True)
        raise


def cache_key(url: str) -> str:
    """The cache folder name of a URL: a 16-hex-digit hash of it plus its last path component."""
    digest = hashlib.sha256(str(url).rstrip("/").encode()).hexdigest()[:16]
    return f"{digest}-{_name(str(url)) or 'root'}"


def get_dir(url: str | Path, local_cache: str | Path, *, marker: str | None = None, refresh: bool = False) -> Path:
    """Download a remote folder (model, checkpoint) into `local_cache` and return the local copy.

    The copy lives at `local_cache/<cache_key(url)>`, written atomically (a killed download leaves
    nothing that looks whole); a second call finds it and downloads nothing, unless `refresh`. The
    cache is keyed by the URL only: pass refresh=True when the remote folder may have changed.
    With `marker` (e.g. "rlx.json"), a remote folder lacking it is a UserError (an unfinished upload).
    """
    dest = Path(local_cache) / cache_key(str(url))
    if dest.is_dir() and not refresh:
        return dest
    fs, path = _fs(url)
    path = path.rstrip("/")
    if not fs.isdir(path):
        raise UserError(f"{url}: no such folder")
    if marker is not None and not fs.exists(_join(path, marker)):
        raise UserError(f"{url}: has no {marker}: the upload is unfinished (or this is not an rlx folder)")
    remote_files = fs.find(path)  # files only, subfolders included
    with atomic_local_dir(dest, overwrite=True) as tmp:
        for remote in remote_files:
            rel = remote[len(path) :].lstrip("/")
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(remote, str(tmp / rel))
    return dest


def local_path(path: str | Path, cache: str | Path) -> Path:
    """A local path for reading `path`: local paths (and file:// URLs) unchanged, remote files and
    folders downloaded into `cache` (folders through get_dir; files to cache/<cache_key>/<name>,
    reused on the next call)."""
    if not is_remote(path):
        return _local(path)
    fs, remote = _fs(path)
    if fs.isdir(remote):
        return get_dir(str(path), cache)
    if not fs.exists(remote):
        raise UserError(f"{path}: no such file or folder")
    dest = Path(cache) / cache_key(str(path)) / _name(remote)
    if not dest.is_file():
        with atomic_local_path(dest) as tmp:
            fs.get_file(remote, str(tmp))
    return dest


def ensure_cache(cache: str | Path | None = None) -> Path:
    """The download cache folder: `cache`, else remote/ under rlx's cache root ($RLX_CACHE, else ~/.cache/rlx), beside
    the compile caches' compile/ (rlx.utils.cache) (created)."""
    folder = Path(cache) if cache else cache_root() / "remote"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def path_exists(url: str | Path) -> bool:
    """Whether a URL (or local path) names an existing file or folder."""
    fs, path = _fs(str(url))
    return fs.exists(path.rstrip("/"))


def fetch_model(url: str | Path, cache: str | Path | None = None) -> Path:
    """A local copy of a remote model or checkpoint (folder or single file such as .gguf).

    Folders are cached by URL and downloaded again when the remote rlx.json (a checkpoint's identity:
    step and provenance) differs from the cached one, so an overwritten checkpoint is never stale."""
    cache = ensure_cache(cache)
    fs, path = _fs(str(url))
    path = path.rstrip("/")
    if not fs.exists(path):
        raise UserError(f"{url}: not found")
    if not fs.isdir(path):
        return local_path(str(url), cache)
    dest = Path(cache) / cache_key(str(url))
    meta = _join(path, "rlx.json")
    stale = fs.exists(meta) and (
        not (dest / "rlx.json").is_file() or (dest / "rlx.json").read_bytes() != fs.cat_file(meta)
    )
    return get_dir(str(url), cache, refresh=stale)


def fetch_file(url: str | Path, folder: str | Path) -> Path:
    """Download one remote file into `folder` (always fresh) and return its local path."""
    dest = Path(folder) / _name(_fs(str(url))[1])
    dest.write_bytes(read_bytes(str(url)))
    return dest
