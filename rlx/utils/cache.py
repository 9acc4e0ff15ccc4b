"""Where compilation results persist between runs: torch.compile's (Inductor's FX graph and autotuning caches) and
Triton's kernel cache live under $RLX_CACHE (default ~/.cache/rlx), so a second run skips the compilation and
autotuning the first one did. Set before torch is imported; variables a user set themselves win."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$RLX_CACHE, else ~/.cache/rlx."""
    return Path(os.environ.get("RLX_CACHE") or Path.home() / ".cache" / "rlx")


def configure_compile_caches() -> None:
    """Point Inductor's and Triton's caches under cache_root()/compile (unless already set)."""
    root = cache_root() / "compile"
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))
