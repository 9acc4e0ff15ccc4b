"""Local file plumbing below everything else: URL/path helpers and atomic local writes.

Outputs are written under a temporary name in the destination folder and renamed into place, so a
failure (or a kill) never leaves a partial file that looks whole; the temporaries get the permissions the
umask gives new files and folders (mkstemp/mkdtemp alone would make every output owner-only). Their names,
`.NAME.rlx-HOST-PID-XXXXXXXX.tmp` (and `.old` for a replaced folder on its way out), say which process made
them: the next write into the same folder removes those of processes on this host that are no longer alive
(a killed command's leftovers), and nothing else. fsspec URLs
are handled one floor up (rlx.utils.storage, rlx.utils.io); keep URLs as strings: pathlib.Path would fold their '//'.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
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


TEMP_TAG = ".rlx-"
TEMP_SUFFIXES = (".tmp", ".old")


def _temp_prefix(name: str) -> str:
    """The start of a temporary's name: `.NAME.rlx-HOST-PID-` (the rest is mkstemp's random part and suffix)."""
    host = socket.gethostname().replace("-", "_") or "localhost"
    return f".{name}{TEMP_TAG}{host}-{os.getpid()}-"


def _temp_owner(name: str) -> tuple[str, int] | None:
    """(host, pid) of an rlx temporary's name, or None for any other name."""
    if not name.startswith(".") or not name.endswith(TEMP_SUFFIXES) or TEMP_TAG not in name:
        return None
    owner = name[: -len(".tmp")].rsplit(TEMP_TAG, 1)[1].rsplit("-", 2)
    if len(owner) != 3 or not owner[1].isdigit():
        return None
    return owner[0], int(owner[1])


def is_alive(pid: int) -> bool:
    """Whether a process with this id runs on this host (one of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(folder: str | Path) -> list[Path]:
    """Remove the temporaries rlx processes of this host left in `folder` when they were killed (their pid is
    gone); returns what was removed. Other files, and temporaries of live or other hosts' processes, stay."""
    host = socket.gethostname().replace("-", "_") or "localhost"
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        owner = _temp_owner(entry.name)
        if owner is None or owner[0] != host or is_alive(owner[1]):
            continue
        path = Path(entry.path)
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                path.unlink()
        removed.append(path)
    return removed


def check_writable(path: str | Path, what: str = "output") -> None:
    """Raise a UserError when local `path` cannot be created: its nearest existing folder is not writable (or is
    a file). Checked before expensive work; the write itself still reports whatever else goes wrong."""
    if is_remote(path):
        return
    parent = existing_ancestor(local(path).absolute().parent)
    if not parent.is_dir():
        raise UserError(f"{path}: cannot create the {what}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        reason = "read-only file system" if _read_only_fs(parent) else "permission denied"
        raise UserError(f"{path}: cannot write the {what} in {parent} ({reason})")
    try:  # os.access passes for root everywhere, and says nothing of /proc, /sys or a full quota: try it
        fd, probe = tempfile.mkstemp(prefix=".rlx-probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UserError(f"{path}: cannot write the {what} in {parent} ({e.strerror or e})") from None


def existing_ancestor(path: Path) -> Path:
    """`path` itself if it exists, else its nearest existing ancestor (what a new file or folder there lands in)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _read_only_fs(folder: Path) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return False


IO_ERRNOS = {
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only file system",
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large",
    errno.EISDIR: "is a folder",
    errno.ENOTDIR: "not a folder",
    errno.EIO: "input/output error",
    errno.ENOENT: "no such file or folder",
}


def describe_io_error(e: BaseException) -> str | None:
    """One line for an I/O failure a user can act on (full disk, read-only or forbidden folder...), else None.
    safetensors and torch report a full disk as their own errors carrying the OS message: those count too."""
    if isinstance(e, OSError) and e.errno in IO_ERRNOS:
        where = f": {e.filename}" if e.filename else ""
        return f"{IO_ERRNOS[e.errno]}{where}"
    text = str(e)
    for code, reason in IO_ERRNOS.items():
        if os.strerror(code) in text or f"os error {code})" in text:
            return f"{reason} ({text.splitlines()[0][:200] if text else type(e).__name__})"
    return None


@contextlib.contextmanager
def atomic_local_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to local `path`; rename it onto `path` only if the block succeeds."""
    path = local(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(path.name), suffix=".tmp", dir=path.parent)
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
    remove_stale_temporaries(path.parent)
    tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(path.name), suffix=".tmp", dir=path.parent))
    tmp.chmod(0o777 & ~current_umask())  # mkdtemp makes 0700: give it what mkdir() would
    try:
        yield tmp
        if path.exists():
            trash = Path(tempfile.mkdtemp(prefix=_temp_prefix(path.name), suffix=".old", dir=path.parent))
            os.replace(path, trash / "old")
            os.replace(tmp, path)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
