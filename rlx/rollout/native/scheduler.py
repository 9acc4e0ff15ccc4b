"""Continuous batching: which sequences run in the next model step (no torch).

A step is either a prefill (waiting sequences, as many as the token budget, the sequence limit and the
free blocks allow, oldest first) or a decode (one token for every running sequence). Prefills go
first, so finished sequences are replaced at once. When a decode needs a block and none is free, the
newest running sequence is preempted: its blocks are returned and it waits to be prefilled again with
the tokens it has (recomputation; its samples stay the same, as draws are indexed by token position).
`schedule_ahead` plans a decode step before the previous one's tokens are known (the engine's overlap
of host and device) where that step is sure to be a decode that needs no preemption: the definition, sequence by
sequence; the engine makes the same plan from arrays (cohort.py), tested against it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from rlx.rollout.native.blocks import BlockManager, Sequence, Status


@dataclass
class Step:
    kind: str
    """'prefill' or 'decode'."""
    seqs: list[Sequence]


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_prefill_tokens: int):
        self.blocks, self.max_num_seqs, self.max_prefill_tokens = blocks, max_num_seqs, max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.num_prefilled = 0
        """Tokens computed by prefill steps (cached prefixes excluded)."""

    def add(self, seq: Sequence) -> None:
        longest = len(seq.prompt_ids) + seq.max_tokens
        if -(-longest // self.blocks.block_size) > self.blocks.num_blocks - 1:
            raise ValueError(f"a sequence of up to {longest} tokens does not fit in the KV cache")
        self.waiting.append(seq)

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> Step:
        prefill, tokens = [], 0
        while self.waiting and len(self.running) + len(prefill) < self.max_num_seqs:
            seq = self.waiting[0]
            if prefill and tokens + len(seq) > self.max_prefill_tokens:
                break
            if self.blocks.blocks_needed(seq) > self.blocks.num_free:
                break
            self.waiting.popleft()
            self.blocks.allocate(seq)
            seq.status = Status.RUNNING
            prefill.append(seq)
            tokens += len(seq) - seq.num_computed
        if prefill:
            self.num_prefilled += tokens
            self.running += prefill
            return Step("prefill", prefill)
        decode = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:  # preempted below for an earlier sequence
                continue
            while not self.blocks.ensure_slot(seq):
                victim = self._newest_running(besides=seq)
                if victim is None:
                    raise RuntimeError("the KV cache cannot hold a single sequence: raise its size")
                self._preempt(victim)
                if victim in decode:
                    decode.remove(victim)
            decode.append(seq)
        return Step("decode", decode)

    def schedule_ahead(self, seqs: list[Sequence]) -> Step | None:
        """The decode step that follows a step over `seqs` whose tokens the host has not read yet, one token
        ahead: its sequences that are still running and not at their last token, with a cache slot for the
        token after the pending one. None where the synchronous path must decide: a prefill is due (one would
        be scheduled now), nothing is left, or a block is missing (preemption)."""
        if self.prefill_due():
            return None
        # a sequence at its last token finishes at the pending step ('length'): nothing to run ahead for it
        ahead = [s for s in seqs if s.status is Status.RUNNING and len(s.output_ids) + 1 < s.max_tokens]
        if not ahead or not all(self.blocks.ensure_slot(s, lookahead=1) for s in ahead):
            return None  # blocks taken for some sequences stay theirs: they need them one step later anyway
        return Step("decode", ahead)

    def prefill_due(self) -> bool:
        """Whether `schedule` would prefill now (a waiting sequence, room in the batch and blocks for it)."""
        waiting, blocks = self.waiting, self.blocks
        room = len(self.running) < self.max_num_seqs
        return bool(waiting) and room and blocks.blocks_needed(waiting[0]) <= blocks.num_free

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self.running.remove(seq)
        self.blocks.release(seq)

    def _newest_running(self, besides: Sequence) -> Sequence | None:
        for seq in reversed(self.running):
            if seq is not besides and seq.status is Status.RUNNING:
                return seq
        return None

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1
