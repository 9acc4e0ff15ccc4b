"""The host's bookkeeping of decode steps run ahead, as arrays over the step's sequences.

Every decode step run ahead (engine.py) reads the same things of each running sequence: its length, how many tokens
it has generated and may generate, its block table, its sampler row; and each step read back appends one token to
each. Done sequence by sequence in Python, that was ~4 us a sequence a step (~1 ms at 256 sequences: more than the
device's step for a 0.5B model, so the host set the decode loop's pace and any other load on it slowed every rank of
a multi-GPU run). A `Cohort` holds them as arrays built once from the sequences and then kept by numpy: the step's
graph inputs, block checks and sampler rows come from its arrays, and only the tokens' appends and the few
sequences needing a new block touch Python objects.

It is a cache beside the state, not the state: the sequences are still updated every step (tokens, logprobs,
computed length) and the synchronous path (prefills, preemption) reads only them. A step whose sequences are not
its predecessor's all (some finished, or are at their last token) gets a cohort of its rows (`take`), which takes
its predecessor's lengths once that step has been read back (`pull`).
"""

from __future__ import annotations

import numpy as np

from rlx.rollout.native.blocks import BlockManager, Sequence, Status

_ARRAYS = ("lengths", "outputs", "max_tokens", "live", "offsets", "indices", "greedy", "num_blocks", "tables")


class Cohort:
    """The sequences `seqs` of one decode step (the very list the step runs over, in its order) as arrays."""

    def __init__(self, seqs: list[Sequence], block_size: int, max_blocks: int):
        n = len(seqs)
        self.seqs, self.block_size = seqs, block_size
        self.lengths = np.fromiter((len(s) for s in seqs), np.int64, n)
        """Tokens each sequence holds on the host (its prompt and the outputs read back so far)."""
        self.outputs = np.fromiter((len(s.output_ids) for s in seqs), np.int64, n)
        self.max_tokens = np.fromiter((s.max_tokens for s in seqs), np.int64, n)
        self.live = np.fromiter((s.status is Status.RUNNING for s in seqs), bool, n)
        """Still generating: False once a read-back token finished it (a step already queued computes one more)."""
        self.offsets = np.fromiter((s.position_offset for s in seqs), np.int64, n)
        self.indices = np.fromiter((s.index for s in seqs), np.int64, n)
        self.greedy = np.fromiter((s.greedy for s in seqs), bool, n)
        self.num_blocks = np.fromiter((len(s.block_table) for s in seqs), np.int64, n)
        self.tables = np.zeros((n, max_blocks), np.int32)
        """Block tables, zero-padded (they only grow while the sequences run)."""
        for row, seq in enumerate(seqs):
            self.tables[row, : len(seq.block_table)] = seq.block_table
        self.parent: Cohort | None = None
        self.src: np.ndarray | None = None

    def take(self, src: np.ndarray) -> Cohort:
        """The cohort of rows `src` (in order), for a step run ahead of this one: its lengths come from this cohort
        once this step is read back (`pull`)."""
        child = object.__new__(Cohort)
        child.seqs, child.block_size = [self.seqs[i] for i in src.tolist()], self.block_size
        for name in _ARRAYS:
            setattr(child, name, getattr(self, name)[src])
        child.parent, child.src = self, src
        return child

    def pull(self) -> None:
        """Take the lengths of the parent step's rows now that it was read back."""
        parent, src = self.parent, self.src
        self.lengths, self.outputs, self.live = parent.lengths[src], parent.outputs[src], parent.live[src]
        self.parent = self.src = None

    def continuing(self) -> np.ndarray:
        """The rows a step ahead runs: still generating, and the pending token not their last."""
        return self.live & (self.outputs + 1 < self.max_tokens)

    def reserve_next(self, blocks: BlockManager) -> bool:
        """Make room for the token after the pending one in every sequence (scheduler.schedule_ahead's check, for
        the few sequences whose blocks are full, in row order); False when a block is missing (blocks taken stay
        taken: those sequences need them a step later anyway)."""
        full = np.flatnonzero(self.lengths + 1 > self.num_blocks * self.block_size)
        for row in full.tolist():
            seq, held = self.seqs[row], int(self.num_blocks[row])
            if not blocks.ensure_slot(seq, lookahead=1):
                return False
            self.tables[row, held : len(seq.block_table)] = seq.block_table[held:]
            self.num_blocks[row] = len(seq.block_table)
        return True

    def read_back(self, tokens: np.ndarray, logprobs: np.ndarray, stop_ids: np.ndarray) -> list[tuple[int, bool]]:
        """Append the step's tokens and logprobs to its live sequences; the rows that finished, in order, each with
        whether a stop token (in `stop_ids`) finished it (else it reached its last token)."""
        live = self.live
        stopped = live & np.isin(tokens, stop_ids)
        done = stopped | (live & (self.outputs + 1 >= self.max_tokens))
        rows = zip(self.seqs, tokens.tolist(), logprobs.tolist(), self.lengths.tolist(), live.tolist())
        for seq, token, logprob, length, _ in rows if live.all() else (row for row in rows if row[4]):
            seq.num_computed = length
            seq.output_ids.append(token)
            seq.logprobs.append(logprob)
        self.advance(live, done)
        finished = np.flatnonzero(done)
        return list(zip(finished.tolist(), stopped[finished].tolist()))

    def advance(self, read: np.ndarray, done: np.ndarray) -> None:
        """Rows `read` got a token; rows `done` finished."""
        self.lengths = self.lengths + read
        self.outputs = self.outputs + read
        self.live = self.live & ~done
