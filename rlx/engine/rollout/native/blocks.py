"""Sequences and the paged KV cache's block manager (no torch: plain bookkeeping, tested on its own).

The cache is `num_blocks` blocks of `block_size` token slots per layer. A sequence holds a list of
block ids (its block table); slot `i` of the sequence is `table[i // block_size] * block_size +
i % block_size`. Full blocks of prompt tokens are shared between sequences with the same prefix (the N
samples of one prompt): a cached block is found by its key (the block before it, its own token ids), which a
dict compares exactly on every hit (a hash collision can never share another prompt's keys and values), and
blocks are reference-counted. Block 0 is never handed out: padded entries of a batch write there.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request being generated."""

    index: int
    """Position in the caller's request list."""
    prompt_ids: list[int]
    max_tokens: int
    greedy: bool = False
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    """Tokens whose keys and values are in the cache."""
    status: Status = Status.WAITING
    finish_reason: str | None = None
    position_offset: int = 0
    """Added to the text position of generated tokens (mRoPE: generation continues after the prompt's largest
    position, which images push beyond its length)."""
    cache_salt: object = None
    """Part of the prefix-cache key of the first block (None: token ids alone): prompts with images use it so that
    equal tokens with other images never share blocks."""

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


class BlockManager:
    """Hands out cache blocks, shares full prompt blocks by content, and takes them back."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free: deque[int] = deque(range(1, num_blocks))  # block 0: scratch for padded batch entries
        self.refs = [0] * num_blocks
        self.cached: dict[tuple[object, tuple[int, ...]], int] = {}
        """(previous block id, or -1 / the sequence's cache salt, this block's token ids) -> block id, for full
        prompt blocks."""
        self.key_of: dict[int, tuple[int, tuple[int, ...]]] = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_needed(self, seq: Sequence) -> int:
        """New blocks `allocate(seq)` would take at most (shared blocks may make it fewer)."""
        return -(-len(seq) // self.block_size) - len(seq.block_table)

    def allocate(self, seq: Sequence) -> None:
        """Give a waiting sequence blocks for all its tokens; reuse cached full blocks of its prefix and mark
        their tokens computed.  The last token is always left to compute (its logits are needed)."""
        assert not seq.block_table, "sequence already holds blocks"
        tokens, size = seq.token_ids, self.block_size
        shareable = (len(tokens) - 1) // size  # full blocks before the last token
        previous, sharing = (-1 if seq.cache_salt is None else seq.cache_salt), True
        for b in range(-(-len(tokens) // size)):
            if b < shareable:
                key = (previous, tuple(tokens[b * size : (b + 1) * size]))  # a chain: equal keys, equal prefixes
                found = self.cached.get(key) if sharing else None
                if found is not None:
                    self.refs[found] += 1
                    seq.block_table.append(found)
                    seq.num_computed += size
                    previous = found
                    continue
                sharing = False
                block = self._take()
                self.cached[key], self.key_of[block] = block, key
                previous = block
            else:
                block = self._take()
            seq.block_table.append(block)

    def ensure_slot(self, seq: Sequence, lookahead: int = 0) -> bool:
        """Make room for the sequence's next token (with `lookahead` 1: for the one after it, whose input token
        is still on the device); False when no block is free."""
        if len(seq) + lookahead <= len(seq.block_table) * self.block_size:
            return True
        if not self.free:
            return False
        seq.block_table.append(self._take())
        return True

    def release(self, seq: Sequence) -> None:
        """Return the sequence's blocks (shared ones once nobody else holds them)."""
        for block in seq.block_table:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                key = self.key_of.pop(block, None)
                if key is not None and self.cached.get(key) == block:
                    del self.cached[key]
                self.free.append(block)
        seq.block_table = []
        seq.num_computed = 0

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def _take(self) -> int:
        block = self.free.popleft()
        self.refs[block] = 1
        return block
