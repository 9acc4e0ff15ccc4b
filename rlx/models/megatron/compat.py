"""What megatron-core 0.16.1 needs to run without CUDA (CPU tests with gloo), in one place.

megatron-core assumes CUDA in a few spots that rlx reaches:
- `RotaryEmbedding.get_emb` moves its inverse frequencies to `torch.cuda.current_device()` whenever
  they sit on the CPU; rlx keeps them on the device of the module (the same thing on a GPU).
- `LanguageModule.setup_embeddings_and_output_layer` all-reduces the tied embedding's two copies
  (first and last pipeline stage) after moving them with `.cuda()`; rlx loads both copies from the
  checkpoint, so the initial all-reduce is skipped (the attributes marking them shared are kept).
- its pipeline schedules allocate on "cuda" and sync CUDA streams; rlx runs its own schedule
  (rlx/backends/megatron/schedule.py), so nothing is patched for them.
- its RNG tracker forks CUDA generators; rlx uses no dropout inside megatron modules (attention is
  rlx's own core-attention module), so the tracker is never entered.

`apply()` is idempotent; `tests/distributed/test_megatron.py` checks that the patched method still has the
upstream source this module was written against, so an upgrade that changes it fails loudly.
"""

from __future__ import annotations

import importlib.metadata
import warnings

from rlx.errors import UserError

TARGET_VERSION = "0.16.1"
"""The megatron-core release this compatibility layer was written and tested against."""
MIN_VERSION = (0, 16)
_APPLIED = False
ORIGINALS: dict = {}
"""The upstream methods replaced by `apply()` (tests check they still contain what is replaced)."""


def megatron_version() -> str | None:
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None


def require_megatron() -> None:
    """Raise a UserError with the install recipe when megatron-core is missing or too old; silence the
    import-time notices about optional CUDA packages (Apex, Transformer Engine) rlx does not use."""
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core(\..*)?$")
    version = megatron_version()
    if version is None:
        raise UserError(
            "the megatron layout needs megatron-core: pip install 'rlx[megatron]' "
            f"(or pip install megatron-core=={TARGET_VERSION})"
        )
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if parts < MIN_VERSION:
        raise UserError(f"megatron-core {version} is too old: rlx needs >= {'.'.join(map(str, MIN_VERSION))}")


def _get_emb(self, max_seq_len: int, offset: int = 0):
    """RotaryEmbedding.get_emb without the move to CUDA (the inverse frequencies follow `.to()`)."""
    import torch

    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    if not self.rotary_interleaved:
        emb = torch.cat((freqs, freqs), dim=-1)
    else:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    return emb[:, None, None, :]  # [S, 1, 1, D]


def _skip_initial_embedding_sync(original):
    def setup_embeddings_and_output_layer(self) -> None:
        self._is_in_embd_group = lambda: False  # instance attribute shadows the method for this call
        try:
            original(self)
        finally:
            del self._is_in_embd_group

    setup_embeddings_and_output_layer.rlx_compat = True
    return setup_embeddings_and_output_layer


def apply() -> None:
    """Install the CPU-safe replacements (once per process)."""
    global _APPLIED
    require_megatron()
    if _APPLIED:
        return
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.language_module.language_module import LanguageModule

    ORIGINALS["get_emb"] = RotaryEmbedding.get_emb
    ORIGINALS["setup_embeddings_and_output_layer"] = LanguageModule.setup_embeddings_and_output_layer
    RotaryEmbedding.get_emb = _get_emb
    LanguageModule.setup_embeddings_and_output_layer = _skip_initial_embedding_sync(
        ORIGINALS["setup_embeddings_and_output_layer"]
    )
    _APPLIED = True
