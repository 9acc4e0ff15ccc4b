"""Runs a Hugging Face causal LM over a paged KV cache: the attention function "rlx_paged" and the model runner.

Every step feeds the model one flat row of tokens (`[1, T]`: the uncomputed tokens of each prefilling
sequence, or the last token of each decoding one) with their positions. The attention function,
registered with transformers' attention interface, writes the step's keys and values into the cache
slots of their sequences and attends over each sequence's blocks: a padded batch with a causal mask
for prefill (the new tokens after any cached prefix), the paged decode kernel for decode (with the cache
write, as the custom op `rlx::paged_decode`). The model's own modules and weights do everything else, so
the trainer's module can generate directly; on CUDA its decoder layers run under torch.compile inside the
decode CUDA graphs (rollout.native.compile = false: eager), and each step's inputs go in one pinned-buffer copy.
An MoE model's layers run their routed experts as grouped GEMMs and return the experts chosen (moe.py), so each
step also yields the routing of its kept positions.
A decode step can run one token ahead of the host (`prev`): each sequence's input token is then gathered on
the device from the previous step's sampled tokens, which the host has not read yet.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlx.kernels.exact import KEY_BLOCK, blocked_attention, key_slots
from rlx.kernels.exact_triton import HAS_TRITON, exact_attention, use_triton
from rlx.kernels.paged_attention import paged_decode_attention, triton_available, write_kv
from rlx.models.attention import attention_implementation, packed_attention_mask, register_attention
from rlx.models.exact import StackedLinear, exact_forward, projection_sets
from rlx.models.family import family_of
from rlx.rollout.native.blocks import BlockManager, Sequence
from rlx.rollout.native.cohort import Cohort
from rlx.rollout.native.fused import fused_head_step, fused_layer_step, merged_layers, merged_rows
from rlx.rollout.native.inputs import (
    DecodeStaging,
    PrefillRows,
    block_tables,
    bucketed,
    last_token,
    prefill_rows,
)
from rlx.rollout.native.moe import moe_layer_step, native_moe_layers
from rlx.rollout.native.sampler import SamplingGraphs
from rlx.rollout.native.vision import NativeImages
from rlx.utils.device import autocast
from rlx.utils.vmm import VirtualBuffer, carve

PAGED_ATTENTION = "rlx_paged"
_log = logging.getLogger(__name__)


@dataclass
class PagedContext:
    """What the attention function needs for one step (the same for every layer)."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    """Per layer: key and value caches [num_blocks, block_size, kv_heads, head_dim]."""
    slot_mapping: torch.Tensor
    """[T] int64: the cache slot of each token of the row."""
    block_tables: torch.Tensor
    """[B, max_blocks] int32."""
    context_lens: torch.Tensor
    """[B] int32: cached tokens of each sequence after this step's tokens are written."""
    decode: bool
    q_rows: torch.Tensor | None = None
    """Prefill: [T] the sequence of each token of the row."""
    q_cols: torch.Tensor | None = None
    """Prefill: [T] each token's index among its sequence's new tokens."""
    max_query_len: int = 1
    mask: torch.Tensor | None = None
    """Prefill: [B, 1, max_query_len, max_blocks * block_size] bool, True where a query may attend."""
    k_cache: torch.Tensor | None = None
    """This layer's key cache (set by `for_layer`: a compiled layer then sees tensors, not a layer index)."""
    v_cache: torch.Tensor | None = None
    impl: str = "auto"
    """The paged decode kernel: 'auto' (Triton on CUDA), 'torch' or 'triton'."""
    exact: bool = False
    """Exact mode: decode and prefill both attend through `blocked_attention` (rlx/kernels/exact.py)."""
    positions: torch.Tensor | None = None
    """Exact prefill: [T] each token's position in its sequence."""
    exact_keys: tuple[torch.Tensor, torch.Tensor] | None = None
    """Exact mode: (rows [T], lengths [T] int32) of `exact_attention`, made once a forward (`with_exact_keys`)."""

    def with_exact_keys(self) -> PagedContext:
        """This context with `exact_keys` set: each token's row of the block tables and the keys it sees (a decode
        step's context lengths, at least 1 for a graph's padded rows; a prefill token's position + 1), computed
        once for all the layers instead of in each one."""
        if self.decode:
            rows = torch.arange(self.context_lens.shape[0], device=self.context_lens.device)
            return dataclasses.replace(self, exact_keys=(rows, self.context_lens.to(torch.int32).clamp(min=1)))
        return dataclasses.replace(self, exact_keys=(self.q_rows, (self.positions + 1).to(torch.int32)))

    def for_layer(self, index: int) -> PagedContext:
        return dataclasses.replace(self, k_cache=self.kv[index][0], v_cache=self.kv[index][1])


@torch.library.custom_op(
    "rlx::paged_decode",
    mutates_args=("k_cache", "v_cache"),
    schema="(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
    "Tensor block_tables, Tensor context_lens, float scale, str impl, Tensor? cos=None, Tensor? sin=None) -> Tensor",
)
def paged_decode(q, k, v, k_cache, v_cache, slot_mapping, block_tables, context_lens, scale, impl, cos=None, sin=None):
    """Write the step's keys/values, then decode attention: one opaque op, so torch.compile fuses around it. With
    cos and sin [T, D], q and k are rotated first (inside the kernel: fused.py's decode layer)."""
    rope = None if cos is None else (cos, sin)
    return paged_decode_attention(
        q, k_cache, v_cache, block_tables, context_lens, scale, (k, v, slot_mapping), impl=impl, rope=rope
    )


@paged_decode.register_fake
def _(q, k, v, k_cache, v_cache, slot_mapping, block_tables, context_lens, scale, impl, cos=None, sin=None):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    paged: PagedContext | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The "rlx_paged" attention function.  query [1, H, T, D], key/value [1, Hkv, T, D] -> ([1, T, H, D], None)."""
    if paged is None:
        raise ValueError(f"{PAGED_ATTENTION} attention runs inside the native rollout engine only")
    k_cache, v_cache = paged.kv[module.layer_idx] if paged.k_cache is None else (paged.k_cache, paged.v_cache)
    q = query[0].transpose(0, 1).to(k_cache.dtype)
    k, v = (t[0].transpose(0, 1).to(k_cache.dtype) for t in (key, value))
    if paged.exact:
        return _exact_attention(q, k, v, k_cache, v_cache, paged, scaling).unsqueeze(0), None
    if paged.decode:
        out = paged_decode(
            q,
            k,
            v,
            k_cache,
            v_cache,
            paged.slot_mapping,
            paged.block_tables,
            paged.context_lens,
            float(scaling if scaling is not None else q.shape[-1] ** -0.5),
            paged.impl,
        )
    else:
        write_kv(k_cache, v_cache, paged.slot_mapping, k, v)
        out = _prefill_attention(q, k_cache, v_cache, paged, scaling)
    return out.unsqueeze(0), None


def _prefill_attention(q, k_cache, v_cache, ctx: PagedContext, scale: float | None) -> torch.Tensor:
    """q [T, H, D] -> [T, H, D]: each sequence's new tokens over its cached prefix and themselves (causal)."""
    batch, width = ctx.block_tables.shape
    heads, dim = q.shape[1], q.shape[2]
    padded = q.new_zeros(batch, ctx.max_query_len, heads, dim)
    padded[ctx.q_rows, ctx.q_cols] = q
    keys = k_cache[ctx.block_tables.long()].flatten(1, 2)  # [B, width * block_size, Hkv, D]
    values = v_cache[ctx.block_tables.long()].flatten(1, 2)
    out = F.scaled_dot_product_attention(
        padded.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=ctx.mask, scale=scale,
        enable_gqa=True,
    )  # fmt: skip
    return out.transpose(1, 2)[ctx.q_rows, ctx.q_cols]


def _exact_attention(q, k, v, k_cache, v_cache, ctx: PagedContext, scale: float | None) -> torch.Tensor:
    """q [T, H, D], the step's k and v [T, Hkv, D] -> [T, H, D]: exact mode's attention over the cache (the step's
    keys written first), the same arithmetic as the trainer's "rlx_exact" forward (rlx/models/exact.py) for a token
    at the same position (on CUDA the Triton kernel both use, reading the cache through the block tables; a decode
    step's kernel writes its keys itself)."""
    rows, lengths = (ctx if ctx.exact_keys is not None else ctx.with_exact_keys()).exact_keys
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    kernel_writes = use_triton(q) and ctx.decode  # one query a sequence: the kernel writes its keys itself
    if not kernel_writes:
        write_kv(k_cache, v_cache, ctx.slot_mapping, k, v)
    if use_triton(q):
        new_kv = (k, v, ctx.slot_mapping) if kernel_writes else None
        return exact_attention(q, k_cache, v_cache, lengths, scale, rows=rows, block_tables=ctx.block_tables,
                               new_kv=new_kv)  # fmt: skip
    block_size = k_cache.shape[1]
    width = ctx.block_tables.shape[1] * block_size
    slots = key_slots(rows, ctx.block_tables, block_size, -(-width // KEY_BLOCK) * KEY_BLOCK)
    return blocked_attention(q, k_cache.flatten(0, 1), v_cache.flatten(0, 1), slots, lengths, scale)


def prefill_mask(context_lens: torch.Tensor, starts: torch.Tensor, num_keys: int, max_query_len: int) -> torch.Tensor:
    """[B, 1, Qmax, K] bool: query j of sequence b (at position starts[b] + j) sees the keys at positions up to its own
    and below the sequence's length; built where the lengths are (on the device: the host built 12.6 M elements for
    256 x 128 prompt tokens and copied them)."""
    device = context_lens.device
    key_pos = torch.arange(num_keys, device=device)
    query_pos = starts.unsqueeze(1) + torch.arange(max_query_len, device=device)  # [B, Qmax]
    mask = (key_pos[None, None, :] <= query_pos[:, :, None]) & (key_pos[None, None, :] < context_lens[:, None, None])
    return mask.unsqueeze(1)


def _decoder_parts(model):
    """(embed_tokens, rotary_emb, layers, norm, lm_head) of a Llama-family causal LM (a vision-language model's
    language model), or None for others."""
    backbone = family_of(model.config).decoder(model)
    parts = [getattr(backbone, n, None) for n in ("embed_tokens", "rotary_emb", "layers", "norm")]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return None if backbone is None or head is None or any(p is None for p in parts) else (*parts, head)


def _layer_step(layer, hidden: torch.Tensor, position_ids: torch.Tensor, rope, paged: PagedContext) -> torch.Tensor:
    """One decoder layer: hidden [1, T, hidden] -> [1, T, hidden]."""
    out = layer(hidden, attention_mask=None, position_ids=position_ids, position_embeddings=rope, paged=paged)
    return out[0] if isinstance(out, tuple) else out


def _head_step(norm, head, hidden: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Final norm and LM head of the kept positions: hidden [1, T, hidden] -> logits [len(keep), V]."""
    return head(norm(hidden[:, keep]))[0]


@functools.lru_cache(maxsize=1)
def _compiled():
    """`_layer_step` and `_head_step` under torch.compile (dynamic batch), made once per process: the decoder
    layers share one compiled graph (weights and caches are inputs), which fuses the norms, rotary and MLP
    elementwise work around the opaque paged_decode op; the decode CUDA graphs then capture it."""
    from torch._dynamo import config as dynamo_config

    dynamo_config.recompile_limit = max(getattr(dynamo_config, "recompile_limit", 8), 64)
    return tuple(_without_duck_sizing(torch.compile(f, dynamic=True)) for f in (_layer_step, _head_step))


@functools.lru_cache(maxsize=1)
def _compiled_fused():
    """fused.py's decode layer and head steps under torch.compile (dynamic batch), made once per process."""
    return tuple(_without_duck_sizing(torch.compile(f, dynamic=True)) for f in (fused_layer_step, fused_head_step))


@functools.lru_cache(maxsize=1)
def _compiled_moe():
    """moe.py's decoder layer step under torch.compile (dynamic batch), made once per process."""
    return _without_duck_sizing(torch.compile(moe_layer_step, dynamic=True))


def _without_duck_sizing(compiled):
    """`compiled`, traced without duck sizing. With it, dimensions of equal size at the first trace are assumed
    equal for good: the largest captured batch is the size of the buffers the decode inputs are views of, so the
    graph compiled for it held only for that size and the next size of the ladder compiled the layer and the head
    again (measured: 4 graphs for the ladder, 2 without)."""
    from torch.fx.experimental import _config as fx_config

    @functools.wraps(compiled)
    def run(*args, **kwargs):
        with fx_config.patch(use_duck_shape=False):
            return compiled(*args, **kwargs)

    return run


class ModelRunner:
    """The KV cache of one model and the forward of one scheduled step.

    For Llama-family models (embed_tokens, rotary_emb, layers, norm, lm_head) the runner calls the decoder
    layers itself, skipping the mask set-up of the model's forward (which synchronises with the device);
    on CUDA, decode steps replay CUDA graphs captured for a ladder of batch sizes (compiled layers inside)."""

    def __init__(
        self, model, device: torch.device, dtype: torch.dtype, blocks: BlockManager, max_blocks_per_seq: int,
        max_batch: int = 0, compile: bool = True, attention: str = "auto", releasable: bool = False,
        tp_group=None, merged: bool = True, exact: bool = False,
    ):  # fmt: skip
        """`max_batch`: capture decode CUDA graphs up to this batch size (0: none); `compile`: torch.compile the
        layers inside them; `attention`: the paged decode kernel ('auto', 'torch', 'triton'); `releasable` (CUDA):
        the KV cache in a VirtualBuffer (rlx.utils.vmm), so `release` can hand its memory back and `restore` take it
        again at the same addresses, the captured graphs still valid. `tp_group`: `model` is a tensor-parallel
        rank's slice (tensor_parallel.py; its own layers all-reduce through hooks): the merged decode step sums its
        attention and MLP outputs over this group too. `merged`: decode through merged projections where the model's
        parameters are laid out for them (fused.py); off: the model's own layers. `exact`: every step batch-invariant
        (rlx/models/exact.py): the model's own layers, not compiled; decode graphs only with triton (the Triton
        kernels need no host sync; the PyTorch scheme's attention reads the longest length on the host)."""
        config = model.config.get_text_config()
        self.model, self.device, self.dtype, self.blocks = model, device, dtype, blocks
        self.is_mrope = family_of(model.config).takes_images  # 3-D rotary positions: [1, T] expanded to [3, 1, T]
        self.images: NativeImages | None = None
        """The current generate call's images (a vision-language model; set by the engine per call)."""
        self.exact = exact
        self.attention, self.use_compile = attention, compile and not exact
        self.max_blocks, self.max_batch = max_blocks_per_seq, max_batch
        self.tp_args = () if tp_group is None else (tp_group,)  # the merged decode step's extra argument
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (blocks.num_blocks, blocks.block_size, kv_heads, head_dim)
        # zeros, not empty: masked-out slots still meet a 0 weight in attention, and 0 * NaN garbage is NaN
        self.kv_memory: VirtualBuffer | None = None
        if releasable:
            self.kv_memory, caches = carve([(shape, dtype)] * (2 * config.num_hidden_layers), device)
            self.kv_memory.zero_()
            self.kv = list(zip(caches[0::2], caches[1::2]))
        else:
            self.kv = [
                (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                for _ in range(config.num_hidden_layers)
            ]
        register_attention(PAGED_ATTENTION, paged_attention_forward, packed_attention_mask)
        self.parts = _decoder_parts(model)
        # decode through merged projections where the model's parameters are laid out for them (fused.py)
        use_merged = self.parts is not None and not self.is_mrope and merged and not exact
        self.fused = merged_layers(model) if use_merged else None
        # an MoE model: its routed layers through grouped expert GEMMs, recording the experts (moe.py)
        self.routed_layers = native_moe_layers(model, self._layers()) if self.parts is not None else None
        if self.fused is not None:
            attn = self._layers()[0].self_attn
            self.fused_dims = (config.num_attention_heads, kv_heads, head_dim)
            self.fused_eps = float(self._layers()[0].input_layernorm.variance_epsilon)
            self.fused_scale = float(attn.scaling)
        self.casts = ExactCasts(model, dtype, releasable) if exact and use_triton(next(model.parameters())) else None
        """Exact mode on CUDA: the linear weights in the compute dtype, cast once per call rather than every step."""
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor | None]]] = {}
        self.sampling: SamplingGraphs | None = None
        """The plain decode step's draw captured for each graph's batch size (sampler.py), where triton runs it."""
        self.sizes: list[int] = []
        self.compiled = False
        if max_batch and device.type == "cuda" and self.parts is not None and (HAS_TRITON or not exact):
            self._capture(max_batch)

    def release(self) -> int:
        """Hand a releasable KV cache's memory back (its addresses and the decode graphs are kept); the bytes freed
        (0 when the cache is not releasable or already released)."""
        freed = self.kv_memory.release() if self.kv_memory is not None else 0
        return freed + (self.casts.release() if self.casts is not None else 0)

    def restore(self) -> None:
        """Take a released KV cache's memory back, zeroed, at the same addresses."""
        if self.kv_memory is not None and not self.kv_memory.mapped:
            self.kv_memory.restore()
            self.kv_memory.zero_()

    def weights_changed(self) -> None:
        """The model's weights are new: recast exact mode's copies (in place: the captured graphs read them)."""
        if self.casts is not None:
            self.casts.refresh()

    @staticmethod
    def bytes_per_block(config, block_size: int, dtype: torch.dtype) -> int:
        config = config.get_text_config()
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_hidden_layers * block_size * kv_heads * head_dim * itemsize

    def _layers(self):
        return self.parts[2][: self.model.config.get_text_config().num_hidden_layers]

    def _run(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, ctx: PagedContext, keep: torch.Tensor,
        route_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """Logits [len(keep), V] (model dtype) of the kept positions of the row, and for an MoE model the experts
        each routed layer chose at the `route_rows` positions (default: `keep`; [len(route_rows), L, k] int16; else
        None)."""
        casts, stacks = (None, None) if self.casts is None else (self.casts.by_id, self.casts.stacks)
        exact = contextlib.nullcontext()
        if self.exact:
            exact = exact_forward(self.model, attention=False, casts=casts, stacks=stacks)
            ctx = ctx.with_exact_keys()
        with attention_implementation(self.model, PAGED_ATTENTION), autocast(self.device, self.dtype), exact:
            if self.parts is None:
                out = self.model(
                    input_ids=input_ids, position_ids=position_ids, use_cache=False, paged=ctx, logits_to_keep=keep
                )
                return out.logits[0], None
            embed, rotary, _, norm, head = self.parts
            if ctx.decode and self.fused is not None:
                hidden = embed(input_ids[0])  # [T, C], not a view: every layer's input alike (one compiled graph)
                return self._run_fused(hidden, rotary(hidden, position_ids=position_ids), ctx, keep), None
            hidden = embed(input_ids)
            rope = rotary(hidden, position_ids=position_ids.expand(3, -1, -1) if self.is_mrope else position_ids)
            steps = _compiled() if ctx.decode and self.compiled else (_layer_step, _head_step)
            if self.routed_layers is not None:
                return self._run_moe(hidden, position_ids, rope, ctx, keep, steps[1], route_rows)
            for i, layer in enumerate(self._layers()):
                hidden = steps[0](layer, hidden, position_ids, rope, ctx.for_layer(i))
            return steps[1](norm, head, hidden, keep), None

    def _run_moe(self, hidden, position_ids, rope, ctx: PagedContext, keep: torch.Tensor, head_step, route_rows=None):
        """An MoE model's layers (moe.py): hidden [1, T, C] -> (logits [len(keep), V], experts [len(route_rows), L,
        k] int16 of its L routed layers; route_rows: default `keep`)."""
        step = _compiled_moe() if ctx.decode and self.compiled else moe_layer_step
        routes = []
        for i, (layer, routed) in enumerate(zip(self._layers(), self.routed_layers)):
            hidden, experts = step(layer, hidden, position_ids, rope, ctx.for_layer(i), routed, "auto", *self.tp_args)
            if experts is not None:
                routes.append(experts)
        _, _, _, norm, head = self.parts
        rows = keep if route_rows is None else route_rows
        return head_step(norm, head, hidden, keep), torch.stack(routes, 1)[rows].to(torch.int16)

    def _run_fused(self, hidden: torch.Tensor, rope, ctx: PagedContext, keep: torch.Tensor) -> torch.Tensor:
        """A decode step through the merged projections (fused.py): hidden [T, C] -> logits [len(keep), V]."""
        _, _, _, norm, head = self.parts
        layer_step, head_step = _compiled_fused() if self.compiled else (fused_layer_step, fused_head_step)
        cos, sin = (t[0] for t in rope)  # [T, D]
        residual = torch.zeros_like(hidden)  # a tensor for every layer: one compiled graph serves them all
        for i, weights in enumerate(self.fused):
            hidden, residual = layer_step(
                hidden, residual, cos, sin, weights.tensors(), ctx.for_layer(i), self.fused_dims, self.fused_eps,
                self.fused_scale, *self.tp_args,
            )  # fmt: skip
        return head_step(norm, head, hidden, residual, keep)

    def _graph_args(self, b: int):
        """The decode inputs of batch size b as views of the graph's buffers (the int32 copy is captured)."""
        meta = self.g_meta
        ctx = PagedContext(
            self.kv, meta[2, :b], self.g_tables[:b], meta[3, :b].to(torch.int32), decode=True, impl=self.attention,
            exact=self.exact,
        )  # fmt: skip
        return meta[0:1, :b], meta[1:2, :b], ctx, self.g_keep[:b]

    @torch.no_grad()
    def _capture(self, max_batch: int) -> None:
        # no graph of batch size 1: torch.compile specialises a dimension of size 1, so it would compile the layer a
        # second time; a lone sequence replays the graph of 2 with one padded entry
        ladder = (2, 4, 8, 16, *range(32, max_batch + 32, 32))
        self.sizes = sorted({min(b, max_batch) for b in ladder})
        top, dev = self.sizes[-1], self.device
        # pinned host buffers (two, used in turn) and their device copy: token ids, positions, slots, context
        # lengths, source rows (inputs.py)
        self.staging = [DecodeStaging(top, self.max_blocks) for _ in range(2)]
        self.g_meta = torch.zeros(5, top, dtype=torch.long, device=dev)
        self.g_meta[3].fill_(1)  # padded entries: token 0 at position 0, written to slot 0 (scratch)
        self.g_tables = torch.zeros(top, self.max_blocks, dtype=torch.int32, device=dev)
        self.g_keep = torch.arange(top, device=dev)
        self.compiled = self.use_compile
        pool = None
        self.sampling = SamplingGraphs(self.sizes, dev) if triton_available() else None
        for b in reversed(self.sizes):
            self._warm_up(b)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs = self._run(*self._graph_args(b))
            pool = graph.pool()
            self.graphs[b] = (graph, outputs)
            if self.sampling is not None:
                self.sampling.capture(b, outputs[0], pool)

    def graph_size(self, b: int) -> int | None:
        """The batch size of the decode graph that runs a decode step of b sequences (None: it runs eagerly)."""
        return next((g for g in self.sizes if g >= b), None) if self.graphs else None

    def _warm_up(self, b: int) -> None:
        """Run batch size b once outside the graph (compilation, kernel selection, lazy inits); where
        torch.compile fails, go on with the eager layers."""
        dev = self.device
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            try:
                self._run(*self._graph_args(b))
            except Exception as e:  # noqa: BLE001 (any compiler failure: the eager layers still work)
                if not self.compiled:
                    raise
                _log.warning("native rollout: torch.compile failed (%s: %s); decoding eagerly", type(e).__name__, e)
                self.compiled = False
                self._run(*self._graph_args(b))
        torch.cuda.current_stream(dev).wait_stream(stream)

    @torch.no_grad()
    def forward(
        self, seqs: list[Sequence], decode: bool, prev: tuple[torch.Tensor, list[int]] | None = None,
        cohort: Cohort | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """Logits [B, V] (model dtype) of each sequence's last token after running its uncomputed tokens, and for an
        MoE model the experts its routed layers chose at that token ([B, L, k] int16, else None). A prefill's
        experts go on with those of each sequence's positions predicting its last `pending_prompt_routes` prompt
        tokens, sequence after sequence ([B + sum of them, L, k]).

        prev (decode only): (tokens [B'] on the device, row of each sequence in them): the step runs one token
        ahead, each sequence's input being its token sampled by the previous step, not yet on the host. `cohort`
        (with prev): `seqs` as arrays (cohort.py), the graph's inputs written from them."""
        if decode:
            return self._decode(seqs, prev, cohort)
        # the attention's padded shapes in buckets (not in exact mode: its kernel reads each sequence's own length)
        pad = (lambda n: n) if self.exact else bucketed
        width = pad(max(len(s.block_table) for s in seqs))
        tables = block_tables(seqs, width)
        context = torch.tensor([len(s) for s in seqs], dtype=torch.int32)
        rows = prefill_rows(seqs, tables, self.blocks.block_size)
        ctx = PagedContext(
            kv=self.kv,
            slot_mapping=rows.slots.to(self.device),
            block_tables=tables.to(self.device),
            context_lens=context.to(self.device),
            decode=False,
            q_rows=rows.q_rows.to(self.device),
            q_cols=rows.q_cols.to(self.device),
            max_query_len=pad(int(rows.query_lens.max())),
            impl=self.attention,
            exact=self.exact,
            positions=rows.positions.to(self.device) if self.exact else None,
        )
        ctx.mask = prefill_mask(ctx.context_lens, rows.starts.to(self.device), width * self.blocks.block_size,
                                ctx.max_query_len)  # fmt: skip
        input_ids = rows.tokens.unsqueeze(0).to(self.device)
        position_ids = rows.positions.unsqueeze(0).to(self.device)
        keep_rows = rows.keep.to(self.device)
        if self.images is not None:
            return self._prefill_with_images(seqs, input_ids, ctx, keep_rows)
        route_rows = self._prompt_route_rows(seqs, rows)
        return self._run(input_ids, position_ids, ctx, keep_rows, route_rows)

    def _prompt_route_rows(self, seqs: list[Sequence], rows: PrefillRows) -> torch.Tensor | None:
        """The rows whose experts a prefill returns (None: `rows.keep`'s): each sequence's last token's, then the
        positions predicting its last `pending_prompt_routes` prompt tokens, sequence after sequence."""
        prompt_rows = []
        for row, seq in enumerate(seqs):
            pending = seq.pending_prompt_routes
            if pending:  # the cache never holds these positions (BlockManager.allocate): this step computes them
                start = len(seq.prompt_ids) - 1 - pending
                assert start >= seq.num_computed, "prompt positions to route were taken from the cache"
                at = int(rows.keep[row]) + 1 - int(rows.query_lens[row]) + start - seq.num_computed  # in the row
                prompt_rows += range(at, at + pending)
        return torch.cat([rows.keep, torch.tensor(prompt_rows)]).to(self.device) if prompt_rows else None

    def _prefill_with_images(self, seqs: list[Sequence], input_ids, ctx: PagedContext, keep):
        """A vision-language model's prefill: its decoder's own forward on the row's embeddings with the image rows
        placed and 3-D positions (vision.py), then the head at `keep`.  -> (logits [len(keep), V], None)."""
        embed, _, _, _, head = self.parts
        decoder = family_of(self.model.config).decoder(self.model)
        with attention_implementation(self.model, PAGED_ATTENTION), autocast(self.device, self.dtype):
            inputs = self.images.prefill_inputs(seqs, input_ids, embed)
            hidden = decoder(**inputs, paged=ctx, use_cache=False).last_hidden_state
            return head(hidden[:, keep])[0], None

    def _decode(self, seqs: list[Sequence], prev: tuple[torch.Tensor, list[int]] | None, cohort: Cohort | None):
        b = len(seqs)
        graph_size = self.graph_size(b)
        if graph_size is None:
            return self._decode_eager(seqs, prev)
        self.staging.reverse()  # the other buffer: the device may still be copying from this one
        staged = self.staging[0]
        if cohort is not None and prev is not None:
            staged.fill_ahead(cohort, graph_size, prev[1])
        else:
            staged.fill(seqs, graph_size, self.blocks.block_size, None if prev is None else prev[1])
        self.g_meta.copy_(staged.meta, non_blocking=True)
        self.g_tables[:graph_size].copy_(staged.tables[:graph_size], non_blocking=True)
        if prev is not None:  # [b] input tokens gathered from the previous step's, on the device
            self.g_meta[0, :b] = prev[0][self.g_meta[4, :b]]
        graph, (logits, routes) = self.graphs[graph_size]
        graph.replay()
        return logits[:b], None if routes is None else routes[:b]

    def _decode_eager(self, seqs: list[Sequence], prev: tuple[torch.Tensor, list[int]] | None):
        size, lag = self.blocks.block_size, 0 if prev is None else 1
        positions = [len(s) - 1 + lag for s in seqs]
        width = max(len(s.block_table) for s in seqs)
        tables = block_tables(seqs, width)
        ctx = PagedContext(
            self.kv,
            torch.tensor([s.block_table[p // size] * size + p % size for s, p in zip(seqs, positions)]).to(self.device),
            tables.to(self.device),
            torch.tensor([p + 1 for p in positions], dtype=torch.int32).to(self.device),
            decode=True,
            impl=self.attention,
            exact=self.exact,
        )
        if prev is None:
            ids = torch.tensor([[last_token(s) for s in seqs]]).to(self.device)
        else:
            ids = prev[0][torch.tensor(prev[1]).to(self.device)].unsqueeze(0)
        pos = torch.tensor([[p + s.position_offset for s, p in zip(seqs, positions)]]).to(self.device)
        return self._run(ids, pos, ctx, torch.arange(len(seqs), device=self.device))


class ExactCasts:
    """Exact mode's linear weights and biases in the compute dtype (the engine generates with the trainer's float32
    parameters under autocast, and `exact_linear` would cast each weight at every decode step): copies made once
    per rollout call (`refresh`) at fixed addresses, the same bits as the per-call cast. `releasable`: in a
    VirtualBuffer whose memory goes with the KV cache's while the engine sleeps.

    The copies of a module's q/k/v (and gate/up) projections are views into one stacked weight (`stacks`: one matmul
    a set instead of one a projection in the decode step; its columns are the bits of each member's own matmul). A
    set already in the compute dtype (a bfloat16 model) is stacked where its parameters are rows of one tensor (as
    `merge_projections` lays out a model nothing trains): that tensor, no copy."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, releasable: bool):
        seen: dict[int, torch.Tensor] = {}
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                for param in (module.weight, module.bias):
                    if param is not None and param.dtype != dtype and param.is_floating_point():
                        seen.setdefault(id(param), param)
        self.params = list(seen.values())
        sets = _stackable(model, seen)
        stacked = {id(p) for members in sets for m in members for p in (m.weight, m.bias) if p is not None}
        # one buffer a stacked set's weights (and one its biases), one a parameter otherwise
        shapes = [(tuple(p.shape), dtype) for p in self.params if id(p) not in stacked]
        for members in sets:
            rows = sum(m.out_features for m in members)
            shapes.append(((rows, members[0].in_features), dtype))
            if members[0].bias is not None:
                shapes.append(((rows,), dtype))
        device = self.params[0].device if self.params else torch.device("cpu")
        self.memory: VirtualBuffer | None = None
        if releasable and self.params:
            self.memory, buffers = carve(shapes, device)
        else:
            buffers = [torch.empty(shape, dtype=dtype, device=device) for shape, _ in shapes]
        own = iter(buffers)
        self.by_id = {id(p): next(own) for p in self.params if id(p) not in stacked}
        self.stacks: dict[int, StackedLinear] = {}
        for members in sets:
            sizes = tuple(m.out_features for m in members)
            weight = next(own)
            bias = next(own) if members[0].bias is not None else None
            self.by_id.update({id(m.weight): view for m, view in zip(members, weight.split(sizes))})
            if bias is not None:
                self.by_id.update({id(m.bias): view for m, view in zip(members, bias.split(sizes))})
            stack = StackedLinear(weight, bias, tuple(id(m.weight) for m in members), sizes)
            self.stacks.update(dict.fromkeys(stack.ids, stack))
        for stack in _merged_stacks(model, dtype):
            self.stacks.update(dict.fromkeys(stack.ids, stack))
        self.copies = [self.by_id[id(p)] for p in self.params]
        self.refresh()

    def refresh(self) -> None:
        """Cast the parameters' current values into the copies (after a sleep: into new memory, same addresses)."""
        if self.memory is not None and not self.memory.mapped:
            self.memory.restore()
        with torch.no_grad():
            for param, copy in zip(self.params, self.copies):
                copy.copy_(param)

    def release(self) -> int:
        """Hand a releasable buffer's memory back; the bytes freed."""
        return self.memory.release() if self.memory is not None else 0


def _merged_stacks(model: torch.nn.Module, dtype: torch.dtype) -> list[StackedLinear]:
    """The `projection_sets` of `model` already in `dtype` whose weights (and biases) are consecutive rows of one
    tensor each, stacked as those tensors."""
    stacks = []
    for _, members in projection_sets(model):
        weights, biases = [m.weight for m in members], [m.bias for m in members]
        if any(w.dtype != dtype for w in weights):
            continue
        weight, bias = merged_rows(weights), None if biases[0] is None else merged_rows(biases)
        if weight is None or (biases[0] is not None and bias is None):
            continue
        sizes = tuple(m.out_features for m in members)
        stacks.append(StackedLinear(weight, bias, tuple(id(w) for w in weights), sizes))
    return stacks


def _stackable(model: torch.nn.Module, cast: dict[int, torch.Tensor]) -> list[list[torch.nn.Linear]]:
    """The sets of `projection_sets` in `model` that `ExactCasts` stacks: those whose parameters are all cast."""
    return [
        members for _, members in projection_sets(model)
        if all(id(p) in cast for m in members for p in (m.weight, m.bias) if p is not None)
    ]  # fmt: skip
