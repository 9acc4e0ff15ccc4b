"""Runs a Hugging Face causal LM over a paged KV cache: the attention function "rlx_paged" and the model runner.

Every step feeds the model one flat row of tokens (`[1, T]`: the uncomputed tokens of each prefilling
sequence, or the last token of each decoding one) with their positions. The attention function,
registered with transformers' attention interface, writes the step's keys and values into the cache
slots of their sequences and attends over each sequence's blocks: a padded batch with a causal mask
for prefill (the new tokens after any cached prefix), the paged decode kernel for decode. The model's
own modules and weights do everything else, so the trainer's module can generate directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlx.engine.device import autocast
from rlx.engine.rollout.native.blocks import BlockManager, Sequence
from rlx.kernels.paged_attention import paged_decode_attention, write_kv
from rlx.models.attention import attention_implementation, packed_attention_mask, register_attention

PAGED_ATTENTION = "rlx_paged"


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
    k_cache, v_cache = paged.kv[module.layer_idx]
    q = query[0].transpose(0, 1).to(k_cache.dtype)
    k, v = (t[0].transpose(0, 1).to(k_cache.dtype) for t in (key, value))
    write_kv(k_cache, v_cache, paged.slot_mapping, k, v)
    if paged.decode:
        out = paged_decode_attention(q, k_cache, v_cache, paged.block_tables, paged.context_lens, scaling)
    else:
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


def _decoder_parts(model):
    """(embed_tokens, rotary_emb, layers, norm, lm_head) of a Llama-family causal LM, or None for others."""
    backbone = getattr(model, "model", None)
    parts = [getattr(backbone, n, None) for n in ("embed_tokens", "rotary_emb", "layers", "norm")]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return None if backbone is None or head is None or any(p is None for p in parts) else (*parts, head)


class ModelRunner:
    """The KV cache of one model and the forward of one scheduled step.

    For Llama-family models (embed_tokens, rotary_emb, layers, norm, lm_head) the runner calls the decoder
    layers itself, skipping the mask set-up of the model's forward (which synchronises with the device);
    on CUDA, decode steps replay CUDA graphs captured for a ladder of batch sizes."""

    def __init__(
        self, model, device: torch.device, dtype: torch.dtype, blocks: BlockManager, max_blocks_per_seq: int,
        max_batch: int = 0,
    ):  # fmt: skip
        config = model.config
        self.model, self.device, self.dtype, self.blocks = model, device, dtype, blocks
        self.max_blocks, self.max_batch = max_blocks_per_seq, max_batch
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (blocks.num_blocks, blocks.block_size, kv_heads, head_dim)
        # zeros, not empty: masked-out slots still meet a 0 weight in attention, and 0 * NaN garbage is NaN
        self.kv = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(config.num_hidden_layers)
        ]
        register_attention(PAGED_ATTENTION, paged_attention_forward, packed_attention_mask)
        self.parts = _decoder_parts(model)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if max_batch and device.type == "cuda" and self.parts is not None:
            self._capture(max_batch)

    @staticmethod
    def bytes_per_block(config, block_size: int, dtype: torch.dtype) -> int:
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_hidden_layers * block_size * kv_heads * head_dim * itemsize

    def _run(self, input_ids: torch.Tensor, position_ids: torch.Tensor, ctx: PagedContext, keep: torch.Tensor):
        """Logits [len(keep), V] (model dtype) of the kept positions of the row."""
        with attention_implementation(self.model, PAGED_ATTENTION), autocast(self.device, self.dtype):
            if self.parts is None:
                out = self.model(
                    input_ids=input_ids, position_ids=position_ids, use_cache=False, paged=ctx, logits_to_keep=keep
                )
                return out.logits[0]
            embed, rotary, layers, norm, head = self.parts
            hidden = embed(input_ids)
            rope = rotary(hidden, position_ids=position_ids)
            for layer in layers[: self.model.config.num_hidden_layers]:
                hidden = layer(
                    hidden, attention_mask=None, position_ids=position_ids, position_embeddings=rope, paged=ctx
                )
                hidden = hidden[0] if isinstance(hidden, tuple) else hidden
            return head(norm(hidden[:, keep]))[0]

    def _capture(self, max_batch: int) -> None:
        ladder = (1, 2, 4, 8, 16, *range(32, max_batch + 32, 32))
        sizes = sorted({min(b, max_batch) for b in ladder})
        top, dev = sizes[-1], self.device
        self.g_ids = torch.zeros(1, top, dtype=torch.long, device=dev)
        self.g_pos = torch.zeros(1, top, dtype=torch.long, device=dev)
        self.g_slots = torch.zeros(top, dtype=torch.long, device=dev)  # padded entries write slot 0 (scratch)
        self.g_tables = torch.zeros(top, self.max_blocks, dtype=torch.int32, device=dev)
        self.g_ctx = torch.ones(top, dtype=torch.int32, device=dev)
        self.g_keep = torch.arange(top, device=dev)
        pool = None
        for b in reversed(sizes):
            ctx = PagedContext(self.kv, self.g_slots[:b], self.g_tables[:b], self.g_ctx[:b], decode=True)
            args = (self.g_ids[:, :b], self.g_pos[:, :b], ctx, self.g_keep[:b])
            stream = torch.cuda.Stream(dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):
                self._run(*args)  # warm-up outside the graph (kernel selection, lazy inits)
            torch.cuda.current_stream(dev).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._run(*args)
            pool = graph.pool()
            self.graphs[b] = (graph, logits)

    @torch.no_grad()
    def forward(self, seqs: list[Sequence], decode: bool) -> torch.Tensor:
        """Logits [B, V] float32 of each sequence's last token after running its uncomputed tokens."""
        if decode:
            return self._decode(seqs)
        tokens, positions, slots, keep, q_rows, q_cols = [], [], [], [], [], []
        for row, seq in enumerate(seqs):
            ids = seq.token_ids
            for pos in range(seq.num_computed, len(ids)):
                tokens.append(ids[pos])
                positions.append(pos)
                slots.append(self.blocks.slot(seq, pos))
                q_rows.append(row)
                q_cols.append(pos - seq.num_computed)
            keep.append(len(tokens) - 1)
        width = max(len(s.block_table) for s in seqs)
        tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs], dtype=torch.int32)
        context = torch.tensor([len(s) for s in seqs], dtype=torch.int32)
        query_lens = torch.tensor([len(s) - s.num_computed for s in seqs])
        ctx = PagedContext(
            kv=self.kv,
            slot_mapping=torch.tensor(slots, dtype=torch.int64).to(self.device),
            block_tables=tables.to(self.device),
            context_lens=context.to(self.device),
            decode=False,
            q_rows=torch.tensor(q_rows).to(self.device),
            q_cols=torch.tensor(q_cols).to(self.device),
            max_query_len=int(query_lens.max()),
        )
        key_pos = torch.arange(width * self.blocks.block_size)
        query_pos = (context - query_lens).unsqueeze(1) + torch.arange(ctx.max_query_len)  # [B, Qmax]
        mask = (key_pos[None, None, :] <= query_pos[:, :, None]) & (key_pos[None, None, :] < context[:, None, None])
        ctx.mask = mask.unsqueeze(1).to(self.device)
        input_ids = torch.tensor([tokens], dtype=torch.long).to(self.device)
        position_ids = torch.tensor([positions], dtype=torch.long).to(self.device)
        return self._run(input_ids, position_ids, ctx, torch.tensor(keep, device=self.device)).float()

    def _decode(self, seqs: list[Sequence]) -> torch.Tensor:
        size = self.blocks.block_size
        tokens = [s.output_ids[-1] if s.output_ids else s.prompt_ids[-1] for s in seqs]
        positions = [len(s) - 1 for s in seqs]
        slots = [s.block_table[p // size] * size + p % size for s, p in zip(seqs, positions)]
        b = len(seqs)
        graph_size = next((g for g in sorted(self.graphs) if g >= b), None)
        width = self.max_blocks if graph_size is not None else max(len(s.block_table) for s in seqs)
        tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs], dtype=torch.int32)
        context = torch.tensor([p + 1 for p in positions], dtype=torch.int32)
        if graph_size is None:
            ctx = PagedContext(
                self.kv, torch.tensor(slots).to(self.device), tables.to(self.device), context.to(self.device), True
            )
            ids = torch.tensor([tokens]).to(self.device)
            pos = torch.tensor([positions]).to(self.device)
            return self._run(ids, pos, ctx, torch.arange(b, device=self.device)).float()
        self.g_ids[0, :b].copy_(torch.tensor(tokens), non_blocking=True)
        self.g_pos[0, :b].copy_(torch.tensor(positions), non_blocking=True)
        self.g_slots[:b].copy_(torch.tensor(slots), non_blocking=True)
        self.g_tables[:b].copy_(tables, non_blocking=True)
        self.g_ctx[:b].copy_(context, non_blocking=True)
        if graph_size > b:  # padded entries: token 0 at position 0, written to the scratch slot
            self.g_ids[0, b:graph_size].zero_()
            self.g_pos[0, b:graph_size].zero_()
            self.g_slots[b:graph_size].zero_()
            self.g_tables[b:graph_size].zero_()
            self.g_ctx[b:graph_size].fill_(1)
        graph, logits = self.graphs[graph_size]
        graph.replay()
        return logits[:b].float()
