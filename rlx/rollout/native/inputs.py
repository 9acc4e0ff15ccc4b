"""Host staging of the native engine's per-step inputs: pinned buffers written by the host, copied without blocking.

A step's inputs are written into a pinned host buffer and sent with one non-blocking copy. The host writes
the next step's inputs while the device may still be copying the previous step's (the engine runs decode
steps one ahead of its bookkeeping), so each buffer comes in two, used in turn: the host only reuses a
buffer after it has read the results of the step that used it, which come after that step's copy.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from rlx.rollout.native.blocks import Sequence
from rlx.rollout.native.cohort import Cohort


def last_token(seq: Sequence) -> int:
    """The newest token the host holds of a sequence (the input of its next synchronous decode step)."""
    return seq.output_ids[-1] if seq.output_ids else seq.prompt_ids[-1]


@dataclass
class PrefillRows:
    """A prefill's packed row on the host: every sequence's uncomputed tokens one after another."""

    tokens: torch.Tensor
    """[T] int64 token ids."""
    positions: torch.Tensor
    """[T] int64 position of each token in its sequence."""
    slots: torch.Tensor
    """[T] int64 KV-cache slot of each token (its block's first slot + the position within the block)."""
    q_rows: torch.Tensor
    """[T] int64 sequence (row of the batch) of each token."""
    q_cols: torch.Tensor
    """[T] int64 index of each token among its sequence's uncomputed ones."""
    keep: torch.Tensor
    """[B] int64 index in the row of each sequence's last token (whose logits are sampled)."""
    starts: torch.Tensor
    """[B] int64 first uncomputed position of each sequence (its cached or computed prefix's length)."""
    query_lens: torch.Tensor
    """[B] int64 uncomputed tokens of each sequence."""


def block_tables(seqs: list[Sequence], width: int) -> torch.Tensor:
    """[B, width] int32: each sequence's block table, zero-padded."""
    return torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs], dtype=torch.int32)


def bucketed(n: int) -> int:
    """`n` rounded up to one of four sizes a doubling (4, 5, 6 or 7 times a power of two; at most 25% more): a
    prefill's padded attention shapes (its longest new-token run, its block-table width) then repeat from step to
    step, and cuDNN's attention reuses the plan it built for a shape (each new one cost 61 ms of host time in a
    4 x H200 profile, where a step's longest prompt changes with its prompts)."""
    step = 1 << max(0, n.bit_length() - 3)
    return -(-n // step) * step


def prefill_rows(seqs: list[Sequence], tables: torch.Tensor, block_size: int) -> PrefillRows:
    """The packed prefill row of `seqs` (block tables `tables` [B, W], zero-padded), built with tensor ops over all
    the tokens at once (a loop over 32,768 prompt tokens took about 20 ms of host time a prefill)."""
    starts = torch.tensor([seq.num_computed for seq in seqs])
    query_lens = torch.tensor([len(seq) for seq in seqs]) - starts
    q_rows = torch.repeat_interleave(torch.arange(len(seqs)), query_lens)
    ends = query_lens.cumsum(0)
    q_cols = torch.arange(int(ends[-1])) - (ends - query_lens)[q_rows]
    positions = starts[q_rows] + q_cols
    slots = tables[q_rows, positions // block_size].long() * block_size + positions % block_size
    tokens = torch.tensor(list(itertools.chain.from_iterable(seq.token_ids[seq.num_computed :] for seq in seqs)))
    return PrefillRows(tokens, positions, slots, q_rows, q_cols, ends - 1, starts, query_lens)


class PinnedPair:
    """Two host buffers of `numel` elements (pinned where the device is CUDA), handed out in turn."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device):
        pinned = device.type == "cuda"
        self.buffers = [torch.zeros(numel, dtype=dtype, pin_memory=pinned) for _ in range(2)]
        self.turn = 0

    def next(self, numel: int) -> torch.Tensor:
        """The other buffer's first `numel` elements (grown when too small)."""
        self.turn ^= 1
        buffer = self.buffers[self.turn]
        if buffer.numel() < numel:
            buffer = torch.zeros(numel, dtype=buffer.dtype, pin_memory=buffer.is_pinned())
            self.buffers[self.turn] = buffer
        return buffer[:numel]


class DecodeStaging:
    """The host side of the decode CUDA graphs' inputs, one of a pair.

    meta [5, top] int64: rows token ids, positions, cache slots, context lengths, and (for a step run ahead)
    the row of the previous step whose sampled token is each sequence's input; padded entries (up to the
    graph's batch size) are token 0 at position 0 written to slot 0 (scratch). tables [top, max_blocks]
    int32: block tables; a row is rewritten only when its sequence's table changed."""

    def __init__(self, top: int, max_blocks: int, pinned: bool = True):
        self.meta = torch.zeros(5, top, dtype=torch.long, pin_memory=pinned)
        self.tables = torch.zeros(top, max_blocks, dtype=torch.int32, pin_memory=pinned)
        self.meta_np, self.tables_np = self.meta.numpy(), self.tables.numpy()
        self.rows: list[tuple[list, int] | None] = [None] * top  # (block table, length) of each host row

    def fill(self, seqs: list[Sequence], graph_size: int, block_size: int, src_rows: list[int] | None) -> None:
        """Write the inputs of `seqs` padded to `graph_size`; with `src_rows` the step runs one token ahead
        (positions one further; the token ids come from the device)."""
        b, meta = len(seqs), self.meta_np
        lag = 0 if src_rows is None else 1
        positions = [len(s) - 1 + lag for s in seqs]
        meta[0, :b] = 0 if src_rows is not None else [last_token(s) for s in seqs]
        meta[1, :b] = [p + s.position_offset for s, p in zip(seqs, positions)]  # rotary positions (mRoPE offset)
        meta[2, :b] = [s.block_table[p // block_size] * block_size + p % block_size for s, p in zip(seqs, positions)]
        meta[3, :b] = positions
        meta[3, :b] += 1
        meta[4, :b] = 0 if src_rows is None else src_rows
        meta[:, b:graph_size] = 0
        meta[3, b:graph_size] = 1
        self._fill_tables(seqs, graph_size)

    def fill_ahead(self, cohort: Cohort, graph_size: int, src_rows) -> None:
        """`fill` for a step run ahead over `cohort`'s sequences (one token further than the host holds), from its
        arrays: no Python a sequence."""
        b, meta, size = len(cohort.seqs), self.meta_np, cohort.block_size
        positions = cohort.lengths  # the pending token's successor: position len(seq)
        meta[0, :b] = 0
        meta[1, :b] = positions + cohort.offsets
        meta[2, :b] = cohort.tables[np.arange(b), positions // size].astype(np.int64) * size + positions % size
        meta[3, :b] = positions + 1
        meta[4, :b] = src_rows
        meta[:, b:graph_size] = 0
        meta[3, b:graph_size] = 1
        width = cohort.tables.shape[1]
        self.tables_np[:b, :width] = cohort.tables
        self.tables_np[:b, width:] = 0
        self.tables_np[b:graph_size] = 0
        self.rows = [None] * len(self.rows)  # `fill`'s record of the rows no longer holds: it writes each again

    def _fill_tables(self, seqs: list[Sequence], graph_size: int) -> None:
        rows, tables = self.rows, self.tables_np
        for row, seq in enumerate(seqs):
            held = rows[row]
            # block tables only grow in place or are replaced (release); holding the list keeps its id unique
            if held is None or held[0] is not seq.block_table or held[1] != len(seq.block_table):
                tables[row, : len(seq.block_table)] = seq.block_table
                rows[row] = (seq.block_table, len(seq.block_table))
        for row in range(len(seqs), graph_size):
            if rows[row] is not None:
                tables[row] = 0
                rows[row] = None
