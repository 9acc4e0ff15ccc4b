"""Carrying vLLM's wheels to the GPU machine (bench/device): requirements read from a wheel's METADATA, the
split into carry-sized parts and the manifest, and install_vllm.sh refusing a corrupt part or a missing wheel."""

from __future__ import annotations

import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from bench.device import wheels
from tests.conftest import REPO

INSTALL = REPO / "bench" / "device" / "install_vllm.sh"


def make_wheel(folder: Path, name: str, requires: list[str], payload: int = 0) -> Path:
    """A wheel with a dist-info METADATA listing `requires`, and `payload` incompressible bytes."""
    path = folder / f"{name}-1.0-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr(f"{name}-1.0.dist-info/METADATA", meta)
        z.writestr(f"{name}/data.bin", hashlib.sha256(name.encode()).digest() * (payload // 32 + 1))
    return path


def test_requirements_follow_markers_and_the_extras_asked_for(tmp_path):
    wheel = make_wheel(tmp_path, "pkg", ["alpha>=1", 'beta; extra == "cu13"', 'gamma; sys_platform == "win32"',
                                         'delta; python_version >= "3.12"'])  # fmt: skip
    assert [r.name for r in wheels.requirements(wheel, set())] == ["alpha", "delta"]
    assert [r.name for r in wheels.requirements(wheel, {"cu13"})] == ["alpha", "beta", "delta"]


@pytest.fixture
def packed(tmp_path, monkeypatch):
    """vllm (split into parts) needing alpha and tokenspeed-mla (optional), which alone needs beta."""
    monkeypatch.setattr(wheels, "PART_BYTES", 4000)
    monkeypatch.setattr(wheels, "MANIFEST", tmp_path / "manifest.txt")
    source = tmp_path / "wheels"
    source.mkdir()
    make_wheel(source, "vllm", ["alpha", "tokenspeed-mla==1.0", 'omega; extra == "never"'], payload=9000)
    make_wheel(source, "alpha", [], payload=1000)
    make_wheel(source, "tokenspeed_mla", ["beta", "alpha"], payload=1000)
    make_wheel(source, "beta", [], payload=3000)
    wheels.pack(source, tmp_path / "carry", ["vllm"])
    return source, tmp_path / "carry", tmp_path / "manifest.txt"


def test_pack_splits_big_wheels_and_puts_optional_ones_last(packed):
    source, carry, manifest = packed
    parts = sorted((carry / "vllm").glob("*/*"))
    assert len(parts) == 3 and all(p.stat().st_size <= 4000 for p in parts)
    assert b"".join(p.read_bytes() for p in parts) == next(source.glob("vllm-*")).read_bytes()
    rows = {line.split()[3].split("-")[0]: line.split() for line in manifest.read_text().splitlines()[1:]}
    assert {n: r[2] for n, r in rows.items()} == {"vllm": "core", "alpha": "core", "tokenspeed_mla": "optional",
                                                  "beta": "optional"}  # fmt: skip
    for sha, size, _, file in rows.values():
        data = (source / file).read_bytes()
        assert hashlib.sha256(data).hexdigest() == sha and int(size) == len(data)
    assert [p.name for p in sorted((carry / "deps").iterdir())][0] == "01"  # core first, then x01, x02 ...
    assert all(p.name.startswith("x") for p in sorted((carry / "deps").iterdir())[1:])


def install(keep: Path, manifest: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(INSTALL), str(keep), str(manifest)], capture_output=True, text=True, timeout=60)


def test_install_refuses_a_corrupt_part_and_a_missing_core_wheel(packed, tmp_path):
    _, carry, manifest = packed
    keep = tmp_path / "keep"
    (keep / "parts").mkdir(parents=True)
    for part in carry.glob("*/*/*"):
        (keep / "parts" / part.name).write_bytes(part.read_bytes())
    first = sorted((keep / "parts").glob("vllm-*.part-*"))[0]
    first.write_bytes(b"x" + first.read_bytes()[1:])
    done = install(keep, manifest)
    assert done.returncode == 1 and "BAD" in done.stdout and "vllm-1.0-py3-none-any.whl" in done.stdout
    assert not (keep / "wheels" / "vllm-1.0-py3-none-any.whl").exists()  # removed, so a new stash is joined again
    first.unlink()
    done = install(keep, manifest)
    assert done.returncode == 1 and "MISSING core wheels" in done.stdout and "vllm-1.0" in done.stdout
    assert not list((keep / "site").iterdir())  # nothing installed
