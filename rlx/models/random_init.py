"""Random initialisation of a transformers model from its config: each module drawn from its own seeded generator.

transformers builds a model in two passes that both draw random numbers on the CPU: every `nn.Linear` and
`nn.Embedding` constructor runs PyTorch's own (kaiming) init, then `init_weights` overwrites all of it with the
model's `_init_weights`. For a 0.5B model that is ~13 s of single-threaded drawing, half of it thrown away.

Here the model is built with both passes off (`transformers.initialization.no_init_weights`), then each module
gets its model's `_init_weights` (the nearest enclosing `PreTrainedModel`'s, as transformers dispatches it) with
random draws from a generator seeded by (seed, the module's name). Modules are independent, so they run on a
thread pool (the draws release the interpreter lock), and the values depend only on the seed and the model:
not on the number of threads, nor on the order the pool runs them.

Guard: if some `_init_weights` draws from the global generator (code that bypasses the init functions), or two
modules write the same tensor, the parallel result is not well defined; the init then runs again module by
module in transformers' order, still with the per-module generators, which is deterministic.
"""

from __future__ import annotations

import hashlib
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from rlx.utils.device import host_cpus_per_process

_DRAWING = ("uniform_", "normal_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_",
            "trunc_normal_", "orthogonal_", "sparse_")  # fmt: skip
_WRITING = ("constant_", "ones_", "zeros_", "eye_", "dirac_")
_state = threading.local()
_patch_lock = threading.Lock()


def module_seed(seed: int, name: str) -> int:
    """The generator seed of the module called `name` ('' for the root) in a model initialised with `seed`."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def init_modules(model: torch.nn.Module, seed: int, threads: int | None = None) -> None:
    """Initialise every module of `model` (built under `no_init_weights`) with its model's `_init_weights` and
    per-module generators; `threads` defaults to this process's share of the host's CPUs (a 7B model took ~60 s a
    rank on one thread, torch's intra-op count under torchrun)."""
    tasks = _tasks(model)
    threads = max(1, threads if threads is not None else host_cpus_per_process())
    global_state = torch.random.get_rng_state()
    try:
        if threads > 1:
            written = _run(tasks, seed, threads)
            if torch.equal(torch.random.get_rng_state(), global_state) and not _overlap(written):
                return
            for _, module, _ in tasks:  # not well defined in parallel: again, in transformers' order
                module.__dict__.pop("_is_hf_initialized", None)
            torch.random.set_rng_state(global_state)
        _run(tasks, seed, 1)
    finally:
        torch.random.set_rng_state(global_state)


def _tasks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, object]]:
    """(name, module, owner PreTrainedModel) in transformers' order: children before their parent, each module
    under the `_init_weights` of the nearest enclosing PreTrainedModel (itself included)."""
    from transformers import PreTrainedModel

    out = []

    def visit(name: str, module: torch.nn.Module, owner) -> None:
        for child_name, child in module.named_children():
            child_owner = child if isinstance(child, PreTrainedModel) else owner
            visit(f"{name}.{child_name}" if name else child_name, child, child_owner)
        out.append((name, module, owner))

    visit("", model, model)
    return out


def _run(tasks, seed: int, threads: int) -> list[set[int]]:
    """Each task's `_init_weights` with its own generator; the storages each wrote, per task."""
    from transformers import initialization

    def one(task) -> set[int]:
        name, module, owner = task
        _state.generator = torch.Generator().manual_seed(module_seed(seed, name))
        _state.written = set()
        try:
            with torch.no_grad():
                owner._initialize_weights(module, owner.is_custom_code())
            return _state.written
        finally:
            _state.generator = _state.written = None

    with _patch_lock, _seeded_init_functions(initialization), initialization.guard_torch_init_functions():
        if threads == 1:
            return [one(t) for t in tasks]
        with ThreadPoolExecutor(threads, thread_name_prefix="rlx-init") as pool:
            return list(pool.map(one, tasks))


class _seeded_init_functions:
    """Within: the torch init functions transformers calls draw from the calling thread's generator (when the
    caller gave none) and note the storage they wrote."""

    def __init__(self, initialization):
        self.table = initialization.TORCH_INIT_FUNCTIONS
        self.saved = dict(self.table)

    def __enter__(self):
        for name in _DRAWING + _WRITING:
            if name in self.table:
                self.table[name] = _wrap(self.saved[name], name in _DRAWING)
        return self

    def __exit__(self, *exc):
        self.table.update(self.saved)


def _wrap(fn, draws: bool):
    def wrapped(tensor, *args, **kwargs):
        written = getattr(_state, "written", None)
        if written is not None:
            if tensor.numel():
                written.add(tensor.untyped_storage().data_ptr())
            if draws and kwargs.get("generator") is None:
                kwargs["generator"] = _state.generator
        return fn(tensor, *args, **kwargs)

    return wrapped


def _overlap(written: list[set[int]]) -> bool:
    """Whether two tasks wrote the same storage (a tensor shared between modules, or a module that initialises
    its children's tensors)."""
    seen: set[int] = set()
    for storages in written:
        if seen & storages:
            return True
        seen |= storages
    return False
