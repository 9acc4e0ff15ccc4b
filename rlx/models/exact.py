"""Exact (batch-invariant) mode for a Hugging Face Llama-family causal LM: `exact_forward(model)`.

Inside the block, the model's forward computes every token's outputs with rlx/kernels/exact.py's fixed-order
arithmetic, so a token's logits do not depend on the batch size, its position in the batch, packing, or (with the
native engine's paged attention in exact mode, rlx/rollout/native/runner.py) whether a KV cache held its context:

- every `F.linear` call (each projection, the MLP, the LM head) runs as `blocked_linear` (CUDA with triton:
  `exact_linear`, rlx/kernels/exact_triton.py), through a torch function mode (no Linear's forward is replaced); on
  CUDA a module's q/k/v and its gate/up run as one matmul a set (`projection_sets`: the engine's weights stacked
  once when cast, the trainer's concatenated as the module runs), each output column the bits of its own matmul;
  on CUDA each decoder layer runs `_exact_layer`, whose two residual adds happen inside the o and down projections'
  matmuls (the eager add's bits);
- every RMSNorm runs `rms_norm` instead of its own forward (CUDA with triton: `exact_rms_norm`, one kernel);
- CUDA with triton only (rlx/kernels/exact_fused.py; the CPU runs the model's own code): every SiLU MLP's
  `act_fn(gate_proj(x)) * up_proj(x)` runs as `silu_mul` (its forward replaced, the projections still `F.linear`
  calls), and rotary as `rotary`: the modeling module of the attention layers (transformers' modeling_llama,
  modeling_qwen2, modeling_qwen3, modeling_mistral) gets an `_ExactRotary` as its `apply_rotary_pos_emb` global
  while any exact block is open (counted, so nested blocks restore it when the last one closes), which runs the
  kernel inside an exact block and the upstream function elsewhere. Both kernels compute each element from its own
  inputs, so a token's bits stay the same in the engine's steps and the trainer's forward;
- attention runs "rlx_exact" (registered with transformers' attention interface): padded batches (a 2D mask) and
  packed rows (cu_seqlens or restarting positions) alike, by `blocked_attention` over each sample's keys (CUDA with
  triton: `exact_packed_attention`, the same Triton kernel as the native engine's exact paged attention);
- on the CPU, one intra-op thread: PyTorch splits large elementwise loops between threads at boundaries that
  depend on the tensor's size, and a scalar tail at such a boundary may round a transcendental differently.

`is_exact()` tells code below the model (the logprob computation, rlx/logprobs.py) to use the exact log-softmax.
Supported: the text decoders of `EXACT_FAMILIES` without sliding-window attention; others raise a UserError.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import threading
import types
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from rlx.errors import UserError
from rlx.kernels.exact import KEY_BLOCK, blocked_attention, blocked_linear, rms_norm
from rlx.kernels.exact_fused import fits_rotary, rotary, silu_mul
from rlx.kernels.exact_triton import (
    exact_linear,
    exact_packed_attention,
    exact_rms_norm,
    exact_rms_norm_pair,
    use_triton,
)
from rlx.models.attention import (
    _segments,
    attention_implementation,
    packed_attention_mask,
    register_attention,
    varlen_attention,
)

EXACT_ATTENTION = "rlx_exact"
EXACT_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
"""model_type values exact mode supports (Llama-family decoders: plain linear layers, RMSNorm, rotary)."""
LINEAR_INPUT_NORMS = ("input_layernorm", "post_attention_layernorm")
"""A decoder layer's norms, whose outputs go to linear layers alone (q/k/v, gate/up) in `EXACT_FAMILIES`."""

_ACTIVE: ContextVar[tuple | None] = ContextVar("rlx_exact", default=None)
"""The open `exact_forward` block's arguments (model, attention, casts, stacks), or None."""


def is_exact() -> bool:
    """Whether an `exact_forward` block is open in this context."""
    return _ACTIVE.get() is not None


def check_exact_model(model, where: str = "exact mode") -> None:
    """A UserError unless `model` is one exact mode supports (see the module doc)."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in EXACT_FAMILIES:
        raise UserError(
            f"{where}: model type {model_type!r} is not supported (exact mode runs {', '.join(EXACT_FAMILIES)})"
        )
    if getattr(config, "use_sliding_window", False) or (model_type == "mistral" and config.sliding_window):
        raise UserError(f"{where}: sliding-window attention is not supported in exact mode")


@dataclasses.dataclass(frozen=True)
class StackedLinear:
    """Linear layers that read the same input (q/k/v, gate/up) stacked into one cast weight [sum N, K] (and bias):
    `ids` the members' weight parameter ids in stacking order, `sizes` their output widths. Each output has the bits
    of the member's own matmul (a row's bits depend on no tile size: `matmul_tiles`)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    ids: tuple[int, ...]
    sizes: tuple[int, ...]


class _BlockedLinear(TorchFunctionMode):
    """Every `F.linear` call inside as `blocked_linear` (fixed-shape GEMMs), on CUDA `exact_linear` (one Triton
    launch with fixed tiles). `casts`: weights and biases already cast to the compute dtype, by the id of the
    parameter (the native engine's, rlx/rollout/native/runner.py): the same bits as `exact_linear`'s own cast.
    `stacks`: on CUDA, the first member of a `StackedLinear` called computes the whole stack once for that input;
    the other members called with the same input tensor take their columns of it. `sets`: the same for projections
    stacked at call time (the trainer's `projection_sets`, found by `_stacked_projections`' hooks), their
    weights concatenated (differentiably) in every call. `residuals`: tensors to add to a linear layer's output, by
    the id of its weight (`_exact_layer`'s: a decoder layer's residual stream), taken by the first call of that
    weight: `exact_linear` adds them in its kernel."""

    def __init__(
        self, casts: dict[int, torch.Tensor] | None = None, stacks: dict[int, StackedLinear] | None = None,
        sets: dict[int, tuple[torch.nn.Linear, ...]] | None = None, residuals: dict[int, torch.Tensor] | None = None,
    ):  # fmt: skip
        super().__init__()
        self.casts = casts or {}
        self.stacks = stacks or {}
        self.sets = sets if sets is not None else {}
        self.residuals = residuals if residuals is not None else {}
        self.pending_input: torch.Tensor | None = None
        self.pending: dict[int, torch.Tensor] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            if use_triton(args[0]):
                x, weight, bias = (*args, kwargs.get("bias"))[:3]
                if id(weight) in self.stacks:
                    return self._stacked(x, self.stacks[id(weight)], id(weight))
                members = self.sets.get(id(weight))
                if members is not None and any(m.weight is weight for m in members):
                    return self._stacked(x, self._stack_now(members), id(weight))
                residual = self.residuals.pop(id(weight), None)
                weight, bias = self.casts.get(id(weight), weight), self.casts.get(id(bias), bias)
                if residual is not None:
                    return exact_linear(x, weight, bias, residual=residual)
                return exact_linear(x, weight, bias)
            return blocked_linear(*args, **kwargs)
        return func(*args, **kwargs)

    def _stacked(self, x: torch.Tensor, stack: StackedLinear | Callable[[], StackedLinear], weight_id: int):
        if x is self.pending_input and weight_id in self.pending:
            return self.pending.pop(weight_id)
        stack = stack() if callable(stack) else stack
        outputs = exact_linear(x, stack.weight, stack.bias).split(stack.sizes, dim=-1)
        self.pending_input, self.pending = x, dict(zip(stack.ids, outputs))
        return self.pending.pop(weight_id)

    @staticmethod
    def _stack_now(members: tuple[torch.nn.Linear, ...]) -> Callable[[], StackedLinear]:
        """The members' current weights (and biases) concatenated, built only where the stack is computed."""

        def build() -> StackedLinear:
            bias = torch.cat([m.bias for m in members]) if members[0].bias is not None else None
            ids, sizes = tuple(id(m.weight) for m in members), tuple(m.out_features for m in members)
            return StackedLinear(torch.cat([m.weight for m in members]), bias, ids, sizes)

        return build


STACKED_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Linear layers of one module that read the same input: exact mode runs each set as one matmul on CUDA."""


def projection_sets(model: torch.nn.Module) -> list[tuple[torch.nn.Module, list[torch.nn.Linear]]]:
    """(module, members) for each set of `STACKED_PROJECTIONS` in `model` that can run as one matmul: plain Linear
    layers (no adapter around them) over the same input width, with biases on all or none. A stack's matmul takes
    other tiles than its members' own may, which changes no bit (`matmul_tiles`)."""
    sets = []
    for module in model.modules():
        for names in STACKED_PROJECTIONS:
            members = [getattr(module, name, None) for name in names]
            if not all(type(m) is torch.nn.Linear for m in members):
                continue
            if len({m.in_features for m in members}) > 1 or len({m.bias is None for m in members}) > 1:
                continue
            sets.append((module, members))
    return sets


@contextlib.contextmanager
def _stacked_projections(model, sets: dict[int, tuple[torch.nn.Linear, ...]]) -> Iterator[None]:
    """Inside the block, each module holding a `projection_sets` set records, as its forward starts, its members by
    the ids of their weights then (a sharded model's unsharded parameters are in place by that time) into `sets`."""

    def record(members: tuple[torch.nn.Linear, ...], module, args) -> None:
        sets.update({id(m.weight): members for m in members})

    handles = [
        module.register_forward_pre_hook(functools.partial(record, tuple(members)))
        for module, members in projection_sets(model)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _exact_norm(
    module: torch.nn.Module, feeds_linears: bool, stacked: bool, hidden_states: torch.Tensor
) -> torch.Tensor:
    """An RMSNorm module's forward in exact mode. `feeds_linears`: its output goes to linear layers alone (a
    decoder layer's two norms). Under a 16-bit autocast on CUDA such a norm runs `exact_rms_norm_pair` in every
    forward (the engine's and the trainer's: one compiled kernel, so the same bits), and without gradients returns
    its 16-bit result: the bits each `F.linear` after it would have cast it to, so the matmuls read half the bytes and
    do not round inside. With gradients the same where `stacked`: one stacked matmul alone reads it (the trainer's
    projection set: its gradient the cast's, as before); else the float32 result (several consumers: autograd sums
    their gradients in float32, as on the default path)."""
    weight, eps = module.weight, module.variance_epsilon
    if not use_triton(hidden_states):
        return rms_norm(hidden_states, weight, eps)
    device = hidden_states.device.type
    if feeds_linears and torch.is_autocast_enabled(device):
        low = torch.get_autocast_dtype(device)
        if low != torch.promote_types(weight.dtype, hidden_states.dtype):
            out, low_out = exact_rms_norm_pair(hidden_states, weight, eps, low)
            return out if torch.is_grad_enabled() and not stacked else low_out
    return exact_rms_norm(hidden_states, weight, eps)


def _exact_layer(
    layer: torch.nn.Module, residuals: dict[int, torch.Tensor], hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None, past_key_values=None,
    use_cache: bool | None = False, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs,
) -> torch.Tensor:  # fmt: skip
    """A Llama-family decoder layer's forward (transformers 5.17's, the same in every `EXACT_FAMILIES` model) with its
    two residual adds folded into the o and down projections' matmuls (`residuals`, taken by `_BlockedLinear`): the
    same arithmetic, two elementwise kernels a layer fewer on the engine's and the trainer's side alike."""
    o_proj, down_proj = layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight
    residual = hidden_states
    hidden_states = layer.input_layernorm(hidden_states)
    residuals[id(o_proj)] = residual
    hidden_states, _ = layer.self_attn(
        hidden_states=hidden_states, attention_mask=attention_mask, position_ids=position_ids,
        past_key_values=past_key_values, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs,
    )  # fmt: skip
    hidden_states = _summed(residuals, o_proj, residual, hidden_states)
    residual = hidden_states
    hidden_states = layer.post_attention_layernorm(hidden_states)
    residuals[id(down_proj)] = residual
    return _summed(residuals, down_proj, residual, layer.mlp(hidden_states))


def _summed(residuals: dict[int, torch.Tensor], weight: torch.Tensor, residual: torch.Tensor, out: torch.Tensor):
    """`residual + out`, unless the projection of `weight` has added it already (its matmul took it from
    `residuals`); else the eager add (the projection ran some other way, e.g. behind an adapter)."""
    if residuals.pop(id(weight), None) is None:
        return out
    return residual + out


def decoder_layers(model) -> list[torch.nn.Module]:
    """The decoder layers of `model` whose forward `exact_forward` replaces with `_exact_layer` on CUDA: those with a
    plain Linear o projection and MLP down projection."""
    parts = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
    return [
        m for m in model.modules()
        if type(m).__name__.endswith("DecoderLayer") and all(hasattr(m, n) for n in parts)
        and type(getattr(m.self_attn, "o_proj", None)) is torch.nn.Linear
        and type(getattr(m.mlp, "down_proj", None)) is torch.nn.Linear
    ]  # fmt: skip


def _exact_mlp(module: torch.nn.Module, fallback: Callable, x: torch.Tensor) -> torch.Tensor:
    """A SiLU MLP's forward in exact mode where the Triton kernels run: `silu_mul` between its projections (still
    `F.linear` calls, so `_BlockedLinear` and its stacks apply); elsewhere its own forward."""
    if use_triton(x):
        return module.down_proj(silu_mul(module.gate_proj(x), module.up_proj(x)))
    return fallback(x)


@contextlib.contextmanager
def _replaced_forwards(replacements: Iterable[tuple[torch.nn.Module, Callable]]) -> Iterator[None]:
    """Each module runs its replacement instead of its own forward inside the block (an instance attribute over the
    class's forward; the module's earlier instance attribute, if any, restored on exit)."""
    replacements = list(replacements)
    own = [module.__dict__.get("forward") for module, _ in replacements]
    for module, forward in replacements:
        module.forward = forward
    try:
        yield
    finally:
        for (module, _), forward in zip(replacements, own):
            if forward is None:
                del module.forward
            else:
                module.forward = forward


def _exact_norms(model, stacked: frozenset[int] = frozenset()) -> contextlib.AbstractContextManager:
    """Every RMSNorm of `model` runs `_exact_norm` inside the block; those whose ids are in `stacked` feed one
    stacked matmul (`stacked_norms`)."""
    feeding = {id(getattr(m, name)) for m in model.modules() for name in LINEAR_INPUT_NORMS if hasattr(m, name)}
    return _replaced_forwards(
        (m, functools.partial(_exact_norm, m, id(m) in feeding, id(m) in stacked)) for m in _rms_norms(model)
    )


def stacked_norms(model) -> frozenset[int]:
    """The ids of the decoder layers' norms whose output one stacked matmul alone reads: the input norm of a layer
    whose attention's q/k/v are a `projection_sets` set, the post-attention norm of one whose MLP's gate/up are."""
    modules = {id(module) for module, _ in projection_sets(model)}
    return frozenset(
        id(getattr(layer, norm)) for layer in decoder_layers(model)
        for norm, reader in (("input_layernorm", layer.self_attn), ("post_attention_layernorm", layer.mlp))
        if id(reader) in modules
    )  # fmt: skip


def _rms_norms(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("RMSNorm") and hasattr(m, "variance_epsilon")]


def _exact_mlps(model) -> contextlib.AbstractContextManager:
    """Every SiLU MLP of `model` runs `_exact_mlp` inside the block."""
    return _replaced_forwards((m, functools.partial(_exact_mlp, m, m.forward)) for m in silu_mlps(model))


def silu_mlps(model) -> list[torch.nn.Module]:
    """The gated MLPs of `model` whose activation is SiLU (`down_proj(act_fn(gate_proj(x)) * up_proj(x))`, the
    config's hidden_act "silu" or "swish"): those `exact_forward` runs with `silu_mul` on CUDA."""
    return [
        m for m in model.modules()
        if type(m).__name__.endswith("MLP") and all(hasattr(m, n) for n in ("gate_proj", "up_proj", "down_proj"))
        and getattr(getattr(m, "config", model.config), "hidden_act", None) in ("silu", "swish")
        and type(getattr(m, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation")
    ]  # fmt: skip


class _ExactRotary:
    """A transformers modeling module's `apply_rotary_pos_emb` while exact blocks are open: `rotary` (one Triton
    kernel each way) inside an exact block where the Triton kernels run and the shapes fit; else the upstream
    function. `users`: the exact blocks open on the module (the upstream function comes back when the last closes,
    whatever the order in which nested or concurrent blocks close). Without gradients under a 16-bit autocast
    (generation, scoring), the kernel writes q and k in autocast's dtype: the attention after it (the engine's paged
    one, "rlx_exact") casts them to that dtype first, so the bits are the same and the copy is saved."""

    def __init__(self, upstream: Callable):
        self.upstream, self.users = upstream, 0

    def __call__(self, q, k, cos, sin, *args, **kwargs):
        plain = not args and set(kwargs) <= {"unsqueeze_dim"} and kwargs.get("unsqueeze_dim", 1) == 1
        if plain and is_exact() and use_triton(q) and fits_rotary(q, k, cos, sin):
            device = q.device.type
            if not torch.is_grad_enabled() and torch.is_autocast_enabled(device):
                return rotary(q, k, cos, sin, out_dtype=torch.get_autocast_dtype(device))
            return rotary(q, k, cos, sin)
        return self.upstream(q, k, cos, sin, *args, **kwargs)


_ROTARY_LOCK = threading.Lock()


def rotary_modules(model) -> list[types.ModuleType]:
    """The modeling modules whose `apply_rotary_pos_emb` global `model`'s attention layers call (the Llama
    family's: transformers' modeling_llama, modeling_qwen2, ...): those `exact_forward` patches on CUDA. Written
    against transformers 5.17, whose attention forwards call the module global; tests/unit/test_exact_fused.py
    fails when a family's module stops defining it, computes it otherwise, or its layers stop calling it."""
    names = {type(m).__module__ for m in model.modules() if type(m).__name__.endswith("Attention")}
    return [sys.modules[n] for n in sorted(names) if hasattr(sys.modules.get(n), "apply_rotary_pos_emb")]


@contextlib.contextmanager
def _exact_rotary(model) -> Iterator[None]:
    """`model`'s attention modules call an `_ExactRotary` as `apply_rotary_pos_emb` inside the block (the modeling
    module's global, the upstream function restored when the module's last exact block closes)."""
    modules = rotary_modules(model)
    with _ROTARY_LOCK:
        for module in modules:
            if not isinstance(module.apply_rotary_pos_emb, _ExactRotary):
                module.apply_rotary_pos_emb = _ExactRotary(module.apply_rotary_pos_emb)
            module.apply_rotary_pos_emb.users += 1
    try:
        yield
    finally:
        with _ROTARY_LOCK:
            for module in modules:
                patched = module.apply_rotary_pos_emb
                if isinstance(patched, _ExactRotary):  # else replaced since by someone else: theirs stays
                    patched.users -= 1
                    if patched.users == 0:
                        module.apply_rotary_pos_emb = patched.upstream


@contextlib.contextmanager
def exact_forward(
    model, attention: bool = True, casts: dict[int, torch.Tensor] | None = None,
    stacks: dict[int, StackedLinear] | None = None,
) -> Iterator[None]:  # fmt: skip
    """Run `model` batch-invariantly inside the block (see the module doc). `attention`: switch its attention to
    "rlx_exact" (off where the caller runs its own exact attention: the native engine's paged one). `casts`:
    linear weights already in the compute dtype, by parameter id; `stacks`: stacked projections by member weight id
    (see `_BlockedLinear`). Given neither (a trainer's forward), the projections are stacked as each module runs."""
    check_exact_model(model)
    threads = torch.get_num_threads()
    token = _ACTIVE.set((model, attention, casts, stacks))
    try:
        with contextlib.ExitStack() as stack:
            sets: dict[int, tuple[torch.nn.Linear, ...]] = {}
            triton = use_triton(next(model.parameters()))
            trainer = casts is None and stacks is None  # the engine's come cast and stacked
            stack.enter_context(_exact_norms(model, stacked_norms(model) if triton and trainer else frozenset()))
            residuals: dict[int, torch.Tensor] = {}
            if triton:  # the fused elementwise kernels (rlx/kernels/exact_fused.py)
                stack.enter_context(_exact_mlps(model))
                stack.enter_context(_exact_rotary(model))
                layers = [(m, functools.partial(_exact_layer, m, residuals)) for m in decoder_layers(model)]
                stack.enter_context(_replaced_forwards(layers))  # the residual adds in the o / down matmuls
                if trainer:  # stacked at call time
                    stack.enter_context(_stacked_projections(model, sets))
            if attention:
                register_attention(EXACT_ATTENTION, exact_attention_forward, packed_attention_mask)
                stack.enter_context(attention_implementation(model, EXACT_ATTENTION))
            if next(model.parameters()).device.type == "cpu":
                torch.set_num_threads(1)
            stack.enter_context(_BlockedLinear(casts, stacks, sets, residuals))
            yield
    finally:
        torch.set_num_threads(threads)
        _ACTIVE.reset(token)


def checkpoint_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """torch.utils.checkpoint's `context_fn` for activation checkpointing (rlx/parallel/apply.py): a layer
    checkpointed inside an `exact_forward` block is recomputed in the backward inside the same kind of block (the
    backward runs after the block has closed), so the recomputation runs the forward's kernels and saves the same
    tensors (else torch.utils.checkpoint stops: "a different number of tensors was saved"). Outside exact mode: no
    context either way."""
    active = _ACTIVE.get()
    if active is None:
        return contextlib.nullcontext(), contextlib.nullcontext()
    model, attention, casts, stacks = active
    return contextlib.nullcontext(), exact_forward(model, attention=attention, casts=casts, stacks=stacks)


def compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype attention runs in: autocast's where it is on (as for SDPA), else the tensor's."""
    if torch.is_autocast_enabled(tensor.device.type):
        return torch.get_autocast_dtype(tensor.device.type)
    return tensor.dtype


def sequence_slots(cu_seqlens: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots [N, L], lengths [N]) of `blocked_attention` for N packed tokens whose samples start at cu_seqlens:
    each token's keys are its sample's tokens from the sample's start (L: the longest sample, whole key blocks)."""
    device = cu_seqlens.device
    cu = cu_seqlens.long()
    sample = torch.bucketize(torch.arange(count, device=device), cu[1:], right=True)  # [N] each token's sample
    starts = cu[sample]
    position = torch.arange(count, device=device) - starts
    width = -(-int((cu[1:] - cu[:-1]).max()) // KEY_BLOCK) * KEY_BLOCK if count else KEY_BLOCK
    slots = (starts[:, None] + torch.arange(width, device=device)).clamp(max=max(count - 1, 0))
    return slots, position + 1


def exact_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The "rlx_exact" attention function (transformers' signature): query [B, H, T, D], key/value [B, Hkv, T, D],
    attention_mask None or [B, T] -> ([B, T, H, Dv], None), zeros at padded positions. Causal, no dropout. Under
    autograd the attention is recomputed in the backward (its key blocks' float32 work is not kept)."""
    if sliding_window:
        raise ValueError(f"{EXACT_ATTENTION} attention has no sliding window")
    batch, heads, length, _ = query.shape
    if key.shape[2] != length:
        raise ValueError(f"{EXACT_ATTENTION} attention needs as many keys as queries: call with use_cache=False")
    kept, cu_seqlens, max_len = _segments(
        attention_mask, position_ids, cu_seq_lens_q, max_length_q, batch, length, query.device
    )
    dtype = compute_dtype(query)
    flat = [t.transpose(1, 2).reshape(batch * length, t.shape[1], t.shape[-1]) for t in (query, key, value)]
    q, k, v = (t.to(dtype) for t in flat)  # [N, heads, D]
    if kept is not None:
        q, k, v = q[kept], k[kept], v[kept]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if use_triton(q):  # the backward recomputes it with the varlen kernel of the default path
        recompute = functools.partial(varlen_attention, cu_seqlens=cu_seqlens, max_len=max_len, scale=scale)
        out = exact_packed_attention(q, k, v, cu_seqlens.to(query.device), scale, recompute)
        if kept is not None:
            out = out.new_zeros(batch * length, heads, out.shape[-1]).index_copy(0, kept, out)
        return out.view(batch, length, heads, -1), None
    slots, lengths = sequence_slots(cu_seqlens.to(query.device), q.shape[0])
    if torch.is_grad_enabled() and q.requires_grad:  # keep q, k, v for the backward, not every key block's work
        out = checkpoint(blocked_attention, q, k, v, slots, lengths, scale, use_reentrant=False)
    else:
        out = blocked_attention(q, k, v, slots, lengths, scale)
    if kept is not None:
        out = out.new_zeros(batch * length, heads, out.shape[-1]).index_copy(0, kept, out)
    return out.view(batch, length, heads, -1), None
