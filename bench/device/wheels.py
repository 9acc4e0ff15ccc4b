"""Gather the wheels that vLLM (and TRL) need on the GPU image, and pack them into carry-sized folders.

    python bench/device/wheels.py fetch /tmp/wheels vllm==0.26.0 trl==1.16.0    # download the closure (PyPI)
    python bench/device/wheels.py pack /tmp/wheels /work/main/.carry             # group, split, write the manifest

`fetch` follows each wheel's Requires-Dist (markers evaluated for CPython 3.12 on x86-64 Linux, extras as asked)
and downloads one version of everything that the GPU image does not already hold (the image's package list is
IMAGE below, read off /work/.library/device/KINDS.md); torch, torchvision, torchaudio and triton are never fetched.

`pack` puts vLLM's wheel into parts under CARRY/vllm/NN/ and the other wheels into folders CARRY/deps/NN/ of at
most 55 MB each (a wheel over that is split too). Wheels needed only by OPTIONAL (kernels for other GPUs or model
families, video decoding) go last, into folders named xNN, which a run can leave out. It writes
bench/device/vllm_wheels.txt (sha256, bytes, group, file name), which install_vllm.sh checks the joined wheels
against.
"""

from __future__ import annotations

import argparse
import email
import hashlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

HERE = Path(__file__).resolve().parent
MANIFEST = HERE / "vllm_wheels.txt"
PART_BYTES = 55 << 20
NEVER = {"torch", "torchvision", "torchaudio", "triton"}
OPTIONAL = {"tokenspeed-mla", "nvidia-cutlass-dsl", "quack-kernels", "humming-kernels", "tilelang",
            "pynvvideocodec", "torchcodec", "flashinfer-python"}  # fmt: skip
"""vLLM's requirements that a dense model on Hopper never imports (MLA / Blackwell / CuTe-DSL kernels, video).
FlashInfer is here too: it needs nvidia-cutlass-dsl, and vLLM checks for it (has_flashinfer) before using it, while
a FlashInfer without CuTe-DSL could fail where vLLM imports it."""
OVERRIDES = ["typing-extensions", "anyio", "idna", "pytz"]
"""Carried although the image has them (its versions may be older than pydantic / openai / httpx2 ask for), and
pytz, which the image's pandas wants and lacks."""
PINNED = {"nvidia-cudnn-frontend": "==1.28.0", "quack-kernels": "==0.6.3", "xgrammar": "==0.2.7"}
"""Older than the newest allowed, whose wheels ask for newer nvidia-cutlass-dsl / apache-tvm-ffi than vLLM pins."""
MARKER_ENV = dict(python_version="3.12", python_full_version="3.12.3", platform_machine="x86_64", sys_platform="linux",
                  platform_system="Linux", os_name="posix", implementation_name="cpython",
                  platform_python_implementation="CPython")  # fmt: skip
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (5, 12, 17, 24, 26, 27, 28, 31, 34, 35)]
PLATFORMS += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]


def image_packages() -> set[str]:
    """The GPU image's packages, from the device notes ('Python packages already there')."""
    text = Path("/work/.library/device/KINDS.md").read_text()
    listed = text.split("Packages: ")[-1].strip().rstrip(".")
    return {canonicalize_name(n.strip()) for n in listed.split(",")} | NEVER


def wheel_name(path: Path) -> str:
    return canonicalize_name(path.name.split("-")[0])


def requirements(wheel: Path, extras: set[str]) -> list[Requirement]:
    """The wheel's Requires-Dist that apply on the GPU image with `extras` asked for."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        message = email.message_from_bytes(z.read(meta))
    out = []
    for line in message.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate(dict(MARKER_ENV, extra=e)) for e in extras or {""}):
            out.append(req)
    return out


def download(spec: str, folder: Path) -> bool:
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", *platforms, "-d", str(folder), spec]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        print(f"FAILED {spec}: {done.stderr.strip().splitlines()[-1:]}", flush=True)
    return done.returncode == 0


def fetch(folder: Path, roots: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    skip, asked = image_packages(), {}
    queue = [Requirement(r) for r in roots]
    for name in OVERRIDES:
        if not any(wheel_name(w) == name for w in folder.glob("*.whl")):
            download(name, folder)
    while queue:
        req = queue.pop(0)
        name = canonicalize_name(req.name)
        if name in skip or (name in asked and set(req.extras) <= asked[name]):
            continue
        asked[name] = asked.get(name, set()) | set(req.extras)
        have = [w for w in folder.glob("*.whl") if wheel_name(w) == name]
        if not have and not download(f"{req.name}{PINNED.get(name, req.specifier)}", folder):
            continue
        wheel = have[0] if have else next(w for w in folder.glob("*.whl") if wheel_name(w) == name)
        queue += requirements(wheel, asked[name])
    print(f"{len(list(folder.glob('*.whl')))} wheels in {folder}")


def optional_only(wheels: dict[str, Path], roots: list[str]) -> set[str]:
    """Names reachable from the roots only through OPTIONAL requirements."""
    edges = {n: {canonicalize_name(r.name) for r in requirements(w, {"cu13", "standard", "image"})}
             for n, w in wheels.items()}  # fmt: skip
    core, stack = set(), [canonicalize_name(r) for r in roots]
    while stack:
        name = stack.pop()
        if name in core or name in OPTIONAL or name not in wheels:
            continue
        core.add(name)
        stack += edges[name]
    return set(wheels) - core


def bins(wheels: list[Path]) -> list[list[Path]]:
    """First-fit decreasing into folders of at most PART_BYTES (a wheel larger than that gets its own)."""
    out: list[list[Path]] = []
    for w in sorted(wheels, key=lambda w: -w.stat().st_size):
        size = w.stat().st_size
        room = next((b for b in out if sum(x.stat().st_size for x in b) + size <= PART_BYTES), None)
        if room is None:
            out.append([w])
        else:
            room.append(w)
    return out


def place(wheel: Path, folder: Path, counter: list[int], prefix: str) -> list[Path]:
    """Copy `wheel` into new folders under `folder`, split into parts if too big; returns the folders."""
    data, made = wheel.read_bytes(), []
    chunks = [data[i : i + PART_BYTES] for i in range(0, len(data), PART_BYTES)]
    for index, chunk in enumerate(chunks):
        target = folder / f"{prefix}{counter[0]:02d}"
        counter[0] += 1
        target.mkdir(parents=True)
        name = wheel.name if len(chunks) == 1 else f"{wheel.name}.part-{index:02d}"
        (target / name).write_bytes(chunk)
        made.append(target)
    return made


def pack(folder: Path, carry: Path, roots: list[str]) -> None:
    wheels = {wheel_name(w): w for w in folder.glob("*.whl")}
    optional = optional_only(wheels, roots)
    for sub in ("vllm", "deps"):
        shutil.rmtree(carry / sub, ignore_errors=True)
    rows, counter = [], [0]
    place(wheels["vllm"], carry / "vllm", [0], "")
    rows.append(("core", wheels["vllm"]))
    for group, prefix in (("core", ""), ("optional", "x")):
        names = sorted(n for n in wheels if n != "vllm" and (n in optional) == (group == "optional"))
        counter = [1]
        for members in bins([wheels[n] for n in names]):
            if len(members) == 1 and members[0].stat().st_size > PART_BYTES:
                place(members[0], carry / "deps", counter, prefix)
            else:
                target = carry / "deps" / f"{prefix}{counter[0]:02d}"
                counter[0] += 1
                target.mkdir(parents=True)
                for w in members:
                    shutil.copy2(w, target / w.name)
            rows += [(group, w) for w in members]
    lines = [f"{hashlib.sha256(w.read_bytes()).hexdigest()} {w.stat().st_size} {g} {w.name}" for g, w in rows]
    header = "# sha256 bytes group wheel (written by bench/device/wheels.py pack)\n"
    MANIFEST.write_text(header + "\n".join(lines) + "\n")
    for sub in sorted(p for p in carry.glob("*/*") if p.is_dir()):
        size = sum(f.stat().st_size for f in sub.iterdir())
        print(f"{sub.relative_to(carry.parent)}  {size / 1e6:6.1f} MB  {len(list(sub.iterdir()))} files")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("fetch", "pack"))
    parser.add_argument("wheels", type=Path, help="the folder of downloaded wheels")
    parser.add_argument("rest", nargs="*", help="fetch: requirements (NAME==VERSION); pack: the carry folder")
    args = parser.parse_args()
    if args.action == "fetch":
        fetch(args.wheels, args.rest)
    else:
        pack(args.wheels, Path(args.rest[0]), ["vllm", "trl", *OVERRIDES])


if __name__ == "__main__":
    main()
