"""Packed ("remove padding") attention for Hugging Face causal LMs, plugged into transformers' registries.

Several samples are concatenated into one row `[1, T]` whose `position_ids` restart at 0 per sample.
transformers already reads that packing from the position ids, but with `sdpa` it then builds a dense
`[T, T]` block-diagonal mask. `enable_packed_attention(model)` instead switches the model to the
attention function "rlx_varlen" (registered with `transformers.AttentionInterface`, plus a mask
function in `AttentionMaskInterface` that never builds a mask), which attends within each sample
using cumulative sequence lengths (`cu_seqlens`), on the first available kernel:

1. flash-attn's `flash_attn_varlen_func` (CUDA, fp16/bf16, when the package is installed),
2. torch's `torch.nn.attention.varlen.varlen_attn` (CUDA, fp16/bf16, no dropout, when torch has it),
3. `scaled_dot_product_attention` per sample in a Python loop (exact; any device and dtype).

`RLX_PACKED_ATTENTION_BACKEND=flash_attn|torch_varlen|sdpa` forces one (for tests and benchmarks).

Sample boundaries come from, in order: a 2D padding mask (each row's unmasked tokens are one
sample: the padded-batch path), `cu_seq_lens_q` / `max_length_q` passed as model kwargs (flat over
all B*T tokens, as transformers' flash path reads them), or restarts of `position_ids`. Keep
`use_cache=False` for packed rows: a KV cache is not supported by this function.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from rlx.errors import UserError
from rlx.models.vision.packing import set_decoder_attention

PACKED_ATTENTION = "rlx_varlen"
KERNEL_ENV = "RLX_PACKED_ATTENTION_BACKEND"  # the variable keeps its published name
KERNELS = ("flash_attn", "torch_varlen", "sdpa")

try:  # optional CUDA kernel package
    from flash_attn import flash_attn_varlen_func
except ImportError:  # pragma: no cover - depends on the environment
    flash_attn_varlen_func = None

try:  # torch >= 2.9 (the signature changed between releases: see _torch_varlen)
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - depends on the torch version
    varlen_attn = None
_VARLEN_PARAMS = frozenset(inspect.signature(varlen_attn).parameters) if varlen_attn is not None else frozenset()


@dataclass(frozen=True)
class PackedBatch:
    """Sequences concatenated into one row without padding."""

    input_ids: torch.Tensor
    """[1, T] int64: the sequences one after another."""
    position_ids: torch.Tensor
    """[1, T] int64: 0 .. len-1 within each sequence."""
    cu_seqlens: torch.Tensor
    """[n+1] int32: start offset of each sequence, then T."""
    max_len: int
    """Length of the longest sequence."""
    lengths: list[int]
    """Length of each sequence, in order."""

    @property
    def total_len(self) -> int:
        """T, the number of tokens in the row."""
        return self.input_ids.shape[1]

    def to(self, device: torch.device | str) -> PackedBatch:
        """The same batch with its tensors on `device`."""
        return replace(
            self, input_ids=self.input_ids.to(device), position_ids=self.position_ids.to(device),
            cu_seqlens=self.cu_seqlens.to(device),
        )  # fmt: skip

    def model_inputs(self) -> dict:
        """Keyword arguments for `model(**...)`: ids, positions, the cache off and the sequence lengths
        (so the attention function reads them instead of deriving them from the positions per layer)."""
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "use_cache": False,
            "cu_seq_lens_q": self.cu_seqlens,
            "cu_seq_lens_k": self.cu_seqlens,
            "max_length_q": self.max_len,
            "max_length_k": self.max_len,
        }


def pack(sequences: list[list[int]]) -> PackedBatch:
    """Token-id sequences (each non-empty) -> one packed row: input_ids/position_ids [1, T], cu_seqlens [n+1]."""
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("pack needs at least one sequence and no empty sequence")
    lengths = [len(s) for s in sequences]
    input_ids = torch.tensor([t for s in sequences for t in s], dtype=torch.int64).unsqueeze(0)
    position_ids = torch.cat([torch.arange(n, dtype=torch.int64) for n in lengths]).unsqueeze(0)
    cu_seqlens = F.pad(torch.tensor(lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))
    return PackedBatch(input_ids, position_ids, cu_seqlens, max(lengths), lengths)


def unpack(values: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    """Per-token values of a packed row, [1, T, ...] or [T, ...] -> one [len_i, ...] tensor per sequence."""
    total = sum(lengths)
    if values.dim() >= 2 and values.shape[0] == 1 and (total != 1 or values.shape[1] == 1):
        values = values[0]  # the [1, T, ...] row form
    if values.shape[0] != total:
        raise ValueError(f"unpack: {values.shape[0]} tokens but the lengths add up to {total}")
    return list(values.split(lengths, dim=0))


def next_token_targets(packed: PackedBatch, fill_value: int = -100) -> torch.Tensor:
    """[1, T] int64: the token each position predicts (the next one in the same sequence), `fill_value`
    at each sequence's last position, so logits/hidden states of the packed row line up with targets."""
    ids = packed.input_ids[0]
    targets = torch.full_like(ids, fill_value)
    targets[:-1] = ids[1:]
    last = packed.cu_seqlens[1:].long() - 1  # each sequence's last token predicts nothing in it
    targets[last] = fill_value
    return targets.unsqueeze(0)


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """position_ids [B, T] -> (cu_seqlens [n+1] int32 over the B*T flattened tokens, max length).

    A sequence starts at each row start and wherever a position is not its predecessor + 1.
    """
    batch, length = position_ids.shape
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    offsets = starts.reshape(-1).nonzero().squeeze(1).to(torch.int32)
    cu_seqlens = torch.cat([offsets, offsets.new_tensor([batch * length])])
    return cu_seqlens, int(cu_seqlens.diff().max())


def select_kernel(query: torch.Tensor, dropout: float) -> str:
    """The kernel `varlen_attention` uses for this query: the environment's choice, else the first that fits."""
    forced = os.environ.get(KERNEL_ENV, "auto")
    if forced != "auto":
        if forced not in KERNELS:
            raise ValueError(f"{KERNEL_ENV}={forced!r}: expected auto or one of {', '.join(KERNELS)}")
        return forced
    is_half = query.dtype in (torch.float16, torch.bfloat16)
    if flash_attn_varlen_func is not None and query.is_cuda and is_half:
        return "flash_attn"
    if varlen_attn is not None and query.is_cuda and is_half and dropout == 0.0:
        return "torch_varlen"
    return "sdpa"


def repeat_kv_heads(x: torch.Tensor, num_heads: int, dim: int) -> torch.Tensor:
    """Repeat each key/value head (along `dim`) so there are `num_heads` of them (GQA -> MHA)."""
    repeats = num_heads // x.shape[dim]
    return x if repeats == 1 else x.repeat_interleave(repeats, dim=dim)


def _window(sliding_window: int | None, is_causal: bool) -> tuple[int, int]:
    """(left, right) window in flash-attn's convention: a token sees `sliding_window` tokens including itself."""
    left = sliding_window - 1 if sliding_window else -1
    return (left, 0 if is_causal else -1)


def _sample_mask(length: int, device, is_causal: bool, sliding_window: int | None) -> torch.Tensor | None:
    """[L, L] bool, True where a query may see a key, for a sliding window; None without one."""
    if not sliding_window:
        return None
    pos = torch.arange(length, device=device)
    distance = pos[:, None] - pos[None, :]
    mask = distance < sliding_window
    return mask & (distance >= 0) if is_causal else mask


def _sdpa_loop(query, key, value, cu_seqlens, scale, dropout, is_causal, sliding_window) -> torch.Tensor:
    """The exact fallback: one scaled_dot_product_attention call per sequence. [N, H, D] -> [N, H, Dv]."""
    key = repeat_kv_heads(key, query.shape[1], dim=1)
    value = repeat_kv_heads(value, query.shape[1], dim=1)
    out = query.new_empty(*query.shape[:-1], value.shape[-1])
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))  # [H, L, D]
        mask = _sample_mask(end - start, query.device, is_causal, sliding_window)
        causal = is_causal and mask is None
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=scale)
        out[start:end] = o.transpose(0, 1)
    return out


def _sdpa_loop_backward(grad, query, key, value, cu_seqlens, scale, is_causal, sliding_window):
    """The gradients of `_sdpa_loop` (no dropout) for query, key and value, per sequence from the softmax's
    closed form, computed in float32 (GQA: a key/value head's gradient sums over the query heads it serves)."""
    heads, kv_heads = query.shape[1], key.shape[1]
    dtypes = (query.dtype, key.dtype, value.dtype)
    scale = scale if scale is not None else query.shape[-1] ** -0.5
    key, value = (repeat_kv_heads(t, heads, dim=1).float() for t in (key, value))
    query, grad = query.float(), grad.float()
    dq, dk, dv = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        q, k, v, g = (t[start:end].transpose(0, 1) for t in (query, key, value, grad))  # [H, L, D]
        mask = _sample_mask(end - start, query.device, is_causal, sliding_window)
        if mask is None and is_causal:
            mask = torch.ones(end - start, end - start, dtype=torch.bool, device=query.device).tril()
        scores = q @ k.transpose(1, 2) * scale
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = scores.softmax(-1)
        dprobs = g @ v.transpose(1, 2)
        dscores = probs * (dprobs - (dprobs * probs).sum(-1, keepdim=True))
        dq[start:end] = (dscores @ k * scale).transpose(0, 1)
        dk[start:end] = (dscores.transpose(1, 2) @ q * scale).transpose(0, 1)
        dv[start:end] = (probs.transpose(1, 2) @ g).transpose(0, 1)
    n, groups = dk.shape[0], heads // kv_heads
    dk, dv = (t.view(n, kv_heads, groups, t.shape[-1]).sum(2) for t in (dk, dv))
    return tuple(d.to(dtype) for d, dtype in zip((dq, dk, dv), dtypes))


@torch.library.custom_op("rlx::sdpa_varlen", mutates_args=())
def _sdpa_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None,
    is_causal: bool,
    sliding_window: int | None,
) -> torch.Tensor:
    """`_sdpa_loop` without dropout as one opaque operator: torch.compile traces a decoder layer through it (one
    graph instead of a graph break at the Python loop over the sample boundaries), with its backward
    (`_sdpa_loop_backward`) an operator too. Used under torch.compile only: eager code runs the loop itself."""
    return _sdpa_loop(query, key, value, cu_seqlens, scale, 0.0, is_causal, sliding_window)


@_sdpa_varlen.register_fake
def _(query, key, value, cu_seqlens, scale, is_causal, sliding_window):
    return query.new_empty(*query.shape[:-1], value.shape[-1])


@torch.library.custom_op("rlx::sdpa_varlen_backward", mutates_args=())
def _sdpa_varlen_backward_op(
    grad: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None,
    is_causal: bool,
    sliding_window: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_sdpa_loop_backward` as an operator (so that the compiled backward of a decoder layer stays one graph)."""
    return _sdpa_loop_backward(grad, query, key, value, cu_seqlens, scale, is_causal, sliding_window)


@_sdpa_varlen_backward_op.register_fake
def _(grad, query, key, value, cu_seqlens, scale, is_causal, sliding_window):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _sdpa_varlen_setup(ctx, inputs, output) -> None:
    query, key, value, cu_seqlens, scale, is_causal, sliding_window = inputs
    ctx.save_for_backward(query, key, value, cu_seqlens)
    ctx.options = (scale, is_causal, sliding_window)


def _sdpa_varlen_backward(ctx, grad):
    grads = _sdpa_varlen_backward_op(grad, *ctx.saved_tensors, *ctx.options)
    return (*grads, None, None, None, None)


_sdpa_varlen.register_autograd(_sdpa_varlen_backward, setup_context=_sdpa_varlen_setup)


def _torch_varlen(query, key, value, cu_seqlens, max_len, scale, is_causal, sliding_window) -> torch.Tensor:
    """torch's varlen_attn; torch 2.9/2.10 take `is_causal`, later releases `window_size` and `enable_gqa`."""
    if "enable_gqa" in _VARLEN_PARAMS:
        extra = {"enable_gqa": key.shape[1] != query.shape[1]}
    else:
        key = repeat_kv_heads(key, query.shape[1], dim=1)
        value = repeat_kv_heads(value, query.shape[1], dim=1)
        extra = {}
    if "window_size" in _VARLEN_PARAMS:
        extra["window_size"] = _window(sliding_window, is_causal)
    elif sliding_window:
        raise ValueError("this torch's varlen_attn has no sliding window: set RLX_PACKED_ATTENTION_BACKEND=sdpa")
    else:
        extra["is_causal"] = is_causal
    return varlen_attn(query, key, value, cu_seqlens, cu_seqlens, max_len, max_len, scale=scale, **extra)


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_len: int,
    *,
    scale: float | None = None,
    dropout: float = 0.0,
    is_causal: bool = True,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention within each sequence of a packed token list.

    query/key [N, H, D] / [N, Hkv, D], value [N, Hkv, Dv] with H a multiple of Hkv (GQA), cu_seqlens [n+1]
    int32 (0, ..., N) -> [N, H, Dv]. No token attends across a boundary of `cu_seqlens`. Dv may be smaller
    than D (MLA); the varlen kernels then get values zero-padded to D and their output is cut back.
    """
    if torch.is_autocast_enabled(query.device.type):  # as autocast treats SDPA: rotary may have upcast q, k
        compute = torch.get_autocast_dtype(query.device.type)
        query, key, value = (t.to(compute) for t in (query, key, value))
    kernel = select_kernel(query, dropout)
    cu_seqlens = cu_seqlens.to(device=query.device, dtype=torch.int32)
    value_dim = value.shape[-1]
    if kernel != "sdpa" and value_dim < query.shape[-1]:  # the varlen kernels take one head size
        value = F.pad(value, (0, query.shape[-1] - value_dim))
        out = varlen_attention(
            query, key, value, cu_seqlens, max_len, scale=scale, dropout=dropout, is_causal=is_causal,
            sliding_window=sliding_window,
        )  # fmt: skip
        return out[..., :value_dim]
    if kernel == "flash_attn":
        return flash_attn_varlen_func(
            query, key, value, cu_seqlens, cu_seqlens, max_len, max_len, dropout_p=dropout, softmax_scale=scale,
            causal=is_causal, window_size=_window(sliding_window, is_causal),
        )  # fmt: skip
    if kernel == "torch_varlen":
        if dropout:
            raise ValueError("torch's varlen_attn has no dropout: use flash_attn or sdpa")
        return _torch_varlen(query, key, value, cu_seqlens, max_len, scale, is_causal, sliding_window)
    if torch.compiler.is_compiling() and not dropout:
        return _sdpa_varlen(query, key, value, cu_seqlens, scale, is_causal, sliding_window)
    return _sdpa_loop(query, key, value, cu_seqlens, scale, dropout, is_causal, sliding_window)


def _segments(attention_mask, position_ids, cu_seq_lens_q, max_length_q, batch, length, device):
    """(kept token indices [N] or None for all, cu_seqlens [n+1] over the kept tokens, max length)."""
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(f"{PACKED_ATTENTION} takes a 2D padding mask, got shape {tuple(attention_mask.shape)}")
        mask = attention_mask[:, -length:].bool()
        lengths = mask.sum(1, dtype=torch.int32)
        cu_seqlens = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
        return mask.reshape(-1).nonzero().squeeze(1), cu_seqlens, int(lengths.max())
    if cu_seq_lens_q is not None:
        if max_length_q is None:
            max_length_q = cu_seq_lens_q.diff().max()
        return None, cu_seq_lens_q, int(max_length_q)
    if position_ids is None:
        position_ids = torch.arange(length, device=device).unsqueeze(0)
    cu_seqlens, max_len = cu_seqlens_from_position_ids(position_ids.expand(batch, length))
    return None, cu_seqlens, max_len


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The "rlx_varlen" attention function (transformers' signature).

    query [B, H, T, D], key/value [B, Hkv, T, D], attention_mask None or [B, T] bool ->
    (attn_output [B, T, H, D], None); outputs at padded positions are 0.

    One packed row with its `cu_seq_lens_q` and `max_length_q` given (`PackedBatch.model_inputs()`, what score and
    train pass) needs no data-dependent step before the kernel: torch.compile traces through it, so a compiled
    decoder layer is one graph (torch's varlen kernel and the sdpa fallback are operators). Everything else (a
    padding mask, boundaries read from the positions, flash-attn's kernel, dropout) runs eagerly: a graph break.
    """
    kernel = select_kernel(query, dropout)
    direct = attention_mask is None and cu_seq_lens_q is not None and max_length_q is not None
    if not direct or query.shape[0] != 1 or kernel == "flash_attn" or dropout:
        return _packed_attention_eager(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
            sliding_window=sliding_window, position_ids=position_ids, cu_seq_lens_q=cu_seq_lens_q,
            max_length_q=max_length_q, **kwargs,
        )  # fmt: skip
    length = query.shape[2]
    _check_no_cache(key, length)
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
    out = varlen_attention(
        q, k, v, cu_seq_lens_q, max_length_q, scale=scaling, is_causal=is_causal, sliding_window=sliding_window
    )
    return out.unsqueeze(0), None


def _check_no_cache(key: torch.Tensor, length: int) -> None:
    if key.shape[2] != length:
        raise ValueError(
            f"{PACKED_ATTENTION} attention needs as many keys as queries: call the model with use_cache=False"
        )


@torch.compiler.disable  # data-dependent sample boundaries: a graph break, not a traced graph
def _packed_attention_eager(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """`packed_attention_forward` in every case, eagerly."""
    batch, num_heads, length, _ = query.shape
    head_dim = value.shape[-1]  # of the output: MLA (DeepSeek-V3, Kimi) has values narrower than queries/keys
    _check_no_cache(key, length)
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    kept, cu_seqlens, max_len = _segments(
        attention_mask, position_ids, cu_seq_lens_q, max_length_q, batch, length, query.device
    )
    q, k, v = (t.transpose(1, 2).reshape(batch * length, t.shape[1], t.shape[-1]) for t in (query, key, value))
    if kept is not None:
        q, k, v = q[kept], k[kept], v[kept]
    out = varlen_attention(
        q, k, v, cu_seqlens, max_len, scale=scaling, dropout=dropout, is_causal=is_causal,
        sliding_window=sliding_window,
    )  # fmt: skip
    if kept is not None:
        out = out.new_zeros(batch * length, num_heads, head_dim).index_copy(0, kept, out)
    return out.view(batch, length, num_heads, head_dim), None


def packed_attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """The mask function paired with "rlx_varlen": never a [T, T] mask; the 2D padding mask [B, T] when
    some token is padding, else None (packing is read from positions or cu_seq_lens in attention)."""
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:]
    return None if bool(attention_mask.all()) else attention_mask


def register_attention(name: str, attention_function, mask_function=packed_attention_mask) -> None:
    """Register an attention function and its mask function with transformers (idempotent)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(name, attention_function)
    AttentionMaskInterface.register(name, mask_function)


def set_attention(model, name: str) -> None:
    """Switch `model` (and its sub-models) to the registered attention function `name`."""
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:
        raise UserError(
            f"{type(model).__name__} does not use transformers' attention interface, so it cannot run {name} attention"
        )


@contextmanager
def attention_implementation(model, name: str) -> Iterator[None]:
    """Run `model`'s decoder with attention `name` inside the block, then switch back (a vision-language model's
    vision tower keeps its own: its images are neither packed nor paged). Only for work without a backward (e.g.
    generating with a KV cache): recomputed activations would see the old function."""
    config = model.config
    text = config.get_text_config()
    previous = text._attn_implementation
    if previous == name:
        yield
        return
    nested = text is not config  # a composite config (vision-language): switch its text model only
    model.set_attn_implementation({"text_config": name} if nested else name)
    try:
        yield
    finally:
        model.set_attn_implementation({"text_config": previous} if nested else previous)


def enable_packed_attention(model, decoder_only: bool = False) -> None:
    """Register "rlx_varlen" and switch `model` to it; then call it with packed rows (`PackedBatch.model_inputs()`),
    padded batches with an attention mask, or anything in between, always with use_cache=False. `decoder_only`: a
    vision-language model's decoder only (its vision tower keeps its own attention per image)."""
    register_attention(PACKED_ATTENTION, packed_attention_forward)
    if decoder_only:
        set_decoder_attention(model, PACKED_ATTENTION)
    else:
        set_attention(model, PACKED_ATTENTION)
