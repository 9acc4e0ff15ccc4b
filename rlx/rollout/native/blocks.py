"""Sequences and the paged KV cache's block manager (no torch: plain bookkeeping, tested on its own).

The cache is `num_blocks` blocks of `block_size` token slots per layer. A sequence holds a list of block ids
(its block table); slot `i` of the sequence is `table[i // block_size] * block_size + i % block_size`. Full
blocks are shared between sequences with the same prefix: the N samples of one prompt share its prompt blocks,
and a multi-turn sample's next turn (its whole context as the prompt) finds the blocks of its earlier turns. A
cached block is found by its key (the block before it, or -1 for a first block; its own token ids; and the
identities of the images whose tokens it holds, so equal tokens with other images never share blocks), which a
dict compares exactly on every hit (a hash collision can never share another prompt's keys and values), and
blocks are reference-counted. A finished sequence's full computed
blocks stay cached while nobody holds them (`evictable`, least recently released first) until a new block is
needed and none is free; evicting a block uncaches the blocks chained after it, so a key never names a block
whose predecessor changed. Block 0 is never handed out: padded entries of a batch write there.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
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
    routed_experts: list = field(default_factory=list)
    """An MoE model's: per output token, the experts [L, k] (int16) of the position that predicted it."""
    num_prompt_routes: int = 0
    """An MoE model's: the last prompt tokens whose predicting positions' routing to record
    (TokenRequest.num_prompt_routes)."""
    prompt_routes: object | None = None
    """Their experts [num_prompt_routes, L, k] (int16), recorded by the sequence's first prefill."""
    num_top_logprobs: int = 0
    """The most likely tokens to report at each position (TokenRequest.num_top_logprobs)."""
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    constraint: object | None = None
    """The request's grammar (rlx.rollout.constraints.GrammarConstraint), or None."""
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    """Tokens whose keys and values are in the cache."""
    status: Status = Status.WAITING
    finish_reason: str | None = None
    position_offset: int = 0
    """Added to the text position of generated tokens (mRoPE: generation continues after the prompt's largest
    position, which images push beyond its length)."""
    image_spans: tuple[tuple[int, int, object], ...] = ()
    """(start, end, identity) of each image's tokens (a vision-language model's): part of the prefix-cache key of
    every block they touch, so that equal tokens with other images never share blocks."""

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def pending_prompt_routes(self) -> int:
        """The prompt tokens whose predicting positions' routing the next prefill records: num_prompt_routes until a
        prefill recorded them, then 0 (a preempted sequence's recomputation keeps the first record)."""
        return self.num_prompt_routes if self.prompt_routes is None else 0

    @property
    def first_to_compute(self) -> int:
        """The first position a prefill computes whatever the cache holds: the last token's (its logits are needed),
        or the first whose routing is still to be recorded (`pending_prompt_routes`)."""
        pending = self.pending_prompt_routes
        return len(self.prompt_ids) - 1 - pending if pending else len(self) - 1


class BlockManager:
    """Hands out cache blocks, shares full prompt blocks by content, and takes them back."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free: deque[int] = deque(range(1, num_blocks))  # block 0: scratch for padded batch entries
        self.refs = [0] * num_blocks
        self.cached: dict[tuple, int] = {}
        """(previous block id or -1, this block's token ids[, identities of the images it holds]) -> block id, for
        full blocks."""
        self.key_of: dict[int, tuple] = {}
        self.children: dict[object, set[int]] = {}
        """Cached blocks keyed after each block (uncached with it)."""
        self.evictable: OrderedDict[int, None] = OrderedDict()
        """Cached blocks nobody holds, least recently released first: found again by a hit, or taken when no block
        is free."""
        self.num_hit_tokens = 0
        """Tokens whose keys and values a sequence found cached (not computed again)."""
        self.stale: set[int] = set()
        """Blocks held when the weights changed (`forget_cached`): never cached again, freed when released."""

    def forget_cached(self) -> None:
        """New weights: keys and values computed so far belong to the old ones. No later sequence finds them, and
        the blocks sequences still hold are freed, not cached, when released."""
        self.cached.clear()
        self.key_of.clear()
        self.children.clear()
        self.free.extend(self.evictable)
        self.evictable.clear()
        self.stale = {block for block in range(1, self.num_blocks) if self.refs[block] > 0}

    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.evictable)

    def blocks_needed(self, seq: Sequence) -> int:
        """New blocks `allocate(seq)` would take at most (shared blocks may make it fewer)."""
        return -(-len(seq) // self.block_size) - len(seq.block_table)

    def allocate(self, seq: Sequence) -> None:
        """Give a waiting sequence blocks for all its tokens; reuse cached full blocks of its prefix and mark
        their tokens computed.  The last token, and the positions whose routing is to be recorded, are always left to
        compute (`Sequence.first_to_compute`)."""
        assert not seq.block_table, "sequence already holds blocks"
        tokens, size = seq.token_ids, self.block_size
        shareable = seq.first_to_compute // size  # full blocks before it
        previous, sharing = -1, True
        for b in range(-(-len(tokens) // size)):
            if b < shareable:
                key = self._key(seq, tokens, b, previous)  # a chain: equal keys, equal prefixes
                found = self.cached.get(key) if sharing else None
                if found is not None:
                    self.evictable.pop(found, None)
                    self.refs[found] += 1
                    seq.block_table.append(found)
                    seq.num_computed += size
                    self.num_hit_tokens += size
                    previous = found
                    continue
                sharing = False
                block = self._take()
                self._cache(block, key)
                previous = block
            else:
                block = self._take()
            seq.block_table.append(block)

    def ensure_slot(self, seq: Sequence, lookahead: int = 0) -> bool:
        """Make room for the sequence's next token (with `lookahead` 1: for the one after it, whose input token
        is still on the device); False when no block is free."""
        if len(seq) + lookahead <= len(seq.block_table) * self.block_size:
            return True
        if not self.num_free:
            return False
        seq.block_table.append(self._take())
        return True

    def release(self, seq: Sequence) -> None:
        """Return the sequence's blocks (shared ones once nobody else holds them). Its full computed blocks are
        cached first; cached blocks nobody holds become evictable, the newest chain position last released."""
        self._cache_computed(seq)
        for block in reversed(seq.block_table):  # a chain's later blocks are evicted before its earlier ones
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.stale.discard(block)
                if block in self.key_of:
                    self.evictable[block] = None
                else:
                    self.free.append(block)
        seq.block_table = []
        seq.num_computed = 0

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def _cache_computed(self, seq: Sequence) -> None:
        """Key the sequence's full blocks whose keys and values are all computed, continuing its chain."""
        tokens, size = seq.token_ids, self.block_size
        previous = -1
        for b, block in enumerate(seq.block_table[: seq.num_computed // size]):
            if block in self.stale:  # computed with weights since replaced: the chain stops here
                return
            key = self._key(seq, tokens, b, previous)
            if self.key_of.get(block) != key:
                if block in self.key_of or key in self.cached:  # another block holds these tokens: stop here
                    return
                self._cache(block, key)
            previous = block

    def _key(self, seq: Sequence, tokens: list[int], b: int, previous: int) -> tuple:
        """The cache key of block `b` of `seq` after block `previous`: its tokens and the images among them."""
        lo, hi = b * self.block_size, (b + 1) * self.block_size
        images = tuple(identity for start, end, identity in seq.image_spans if start < hi and end > lo)
        ids = tuple(tokens[lo:hi])
        return (previous, ids, images) if images else (previous, ids)

    def _cache(self, block: int, key: tuple) -> None:
        self.cached[key], self.key_of[block] = block, key
        self.children.setdefault(key[0], set()).add(block)

    def _uncache(self, block: int) -> None:
        """Forget `block`'s key and those of the blocks chained after it (an evictable one becomes free)."""
        key = self.key_of.pop(block)
        if self.cached.get(key) == block:
            del self.cached[key]
        self.children.get(key[0], set()).discard(block)
        for child in self.children.pop(block, set()):
            self._uncache(child)
            if child in self.evictable:
                del self.evictable[child]
                self.free.append(child)

    def _take(self) -> int:
        if self.free:
            block = self.free.popleft()
        else:
            block, _ = self.evictable.popitem(last=False)
            self._uncache(block)
        self.refs[block] = 1
        return block
