"""What megatron-core 0.16.1 needs to run without CUDA (CPU tests with gloo), in one place.

megatron-core assumes CUDA in a few spots that rlx reaches:
- `RotaryEmbedding.get_emb` moves its inverse frequencies to `torch.cuda.current_device()` whenever
  they sit on the CPU; rlx keeps them on the device of the module (the same thing on a GPU).
- `LanguageModule.setup_embeddings_and_output_layer` all-reduces the tied embedding's two copies
  (first and last pipeline stage) after moving them with `.cuda()`; rlx loads both copies from the
  checkpoint, so the initial all-reduce is skipped (the attributes marking them shared are kept).
- its pipeline schedules allocate on "cuda" and sync CUDA streams; rlx runs its own schedule
  (rlx/backends/megatron/schedule.py), so nothing is patched for them.
- its RNG tracker forks CUDA generators (and refuses to fork a stream nobody seeded) around the embedding and the
  decoder under sequence parallelism; rlx uses no dropout inside megatron modules (attention is rlx's own
  core-attention module), so the tracker is megatron's inference one, whose fork does nothing.
- mixture-of-experts layers (`moe_apply()`, only when an MoE model is built): the router moves its weight to
  `torch.cuda.current_device()` when it sits on the CPU, the all-to-all token dispatcher creates a CUDA stream
  for its device-to-host copies and syncs on it, and the collectives of `tensor_parallel.mappings` (all-gather,
  all-to-all with uneven splits) allocate their outputs on the current CUDA device. Without CUDA those three
  modules see a `torch` whose `cuda` namespace names the CPU and has no-op streams, and the dispatcher's
  `maybe_move_tensor_to_cpu` (which turns the all-to-all splits into numpy arrays only for CUDA tensors) does so
  for CPU tensors too; with CUDA nothing changes.
  Under sequence parallelism (an MoE model under tensor parallelism) the linear layers' all-gather buffer
  (`utils.GlobalMemoryBuffer`) and reduce-scatter output (`tensor_parallel.layers`) are allocated the same way, so
  those two modules see that `torch` too.
  `moe_utils.router_gating_linear` reads `te_general_gemm`, which 0.16.1 leaves undefined without Transformer
  Engine; it is set to None (the plain matmul branch).

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


class _NoStream:
    """A CUDA stream / event stand-in on the CPU: nothing to wait for."""

    def wait_stream(self, _stream) -> None:
        pass

    def record_event(self) -> _NoStream:
        return self

    def synchronize(self) -> None:
        pass


class _CpuCuda:
    """`torch.cuda` as megatron's MoE code uses it, for a process without CUDA: the CPU is the current device."""

    _stream = _NoStream()

    @staticmethod
    def current_device():
        import torch

        return torch.device("cpu")

    def Stream(self) -> _NoStream:  # noqa: N802 (torch's name)
        return self._stream

    def current_stream(self) -> _NoStream:
        return self._stream

    @staticmethod
    def stream(_stream):
        import contextlib

        return contextlib.nullcontext()

    def __getattr__(self, name: str):
        import torch

        return getattr(torch.cuda, name)


class _TorchOnCpu:
    """The `torch` module with `cuda` replaced by `_CpuCuda` (everything else is torch's own)."""

    cuda = _CpuCuda()

    def __getattr__(self, name: str):
        import torch

        return getattr(torch, name)


def _splits_to_numpy(original):
    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        import torch

        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original(tensor, as_numpy, record_stream)

    return maybe_move_tensor_to_cpu


MOE_MODULES = (
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.utils",
)
"""The megatron-core modules whose `torch` is `_TorchOnCpu` in a process without CUDA."""
_MOE_APPLIED = False


def moe_apply() -> None:
    """Make megatron-core's MoE layer (router, all-to-all dispatcher, their collectives) run without CUDA (once
    per process; nothing changes where CUDA is available but the missing `te_general_gemm`)."""
    global _MOE_APPLIED
    apply()
    if _MOE_APPLIED:
        return
    import importlib

    import torch

    utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(utils, "te_general_gemm"):
        utils.te_general_gemm = None
    if not torch.cuda.is_available():
        for name in MOE_MODULES:
            importlib.import_module(name).torch = _TorchOnCpu()
        dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
        ORIGINALS["maybe_move_tensor_to_cpu"] = dispatcher.maybe_move_tensor_to_cpu
        dispatcher.maybe_move_tensor_to_cpu = _splits_to_numpy(ORIGINALS["maybe_move_tensor_to_cpu"])
    _MOE_APPLIED = True


def apply() -> None:
    """Install the CPU-safe replacements (once per process)."""
    global _APPLIED
    require_megatron()
    if _APPLIED:
        return
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    ORIGINALS["get_emb"] = RotaryEmbedding.get_emb
    ORIGINALS["setup_embeddings_and_output_layer"] = LanguageModule.setup_embeddings_and_output_layer
    RotaryEmbedding.get_emb = _get_emb
    LanguageModule.setup_embeddings_and_output_layer = _skip_initial_embedding_sync(
        ORIGINALS["setup_embeddings_and_output_layer"]
    )
    initialize_rng_tracker(inference_rng_tracker=True)  # no dropout: nothing to fork
    _APPLIED = True
