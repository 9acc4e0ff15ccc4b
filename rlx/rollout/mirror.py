"""One token stream per tensor-parallel group: the group's first rank submits, the other ranks mirror it.

The ranks of a tensor-parallel rollout engine (vllm or native with rollout.tp_degree > 1) hold one engine between
them, so every rank must add the same requests at the same moments and step together. A single-turn batch does that
by itself (every rank of a group holds the group's requests from the start); a multi-turn episode's next turn comes
when its environment answers, which only one process may decide. So the group's first rank (the leader) runs the
episodes (environments, tool calls, agents) and submits their turns to a LeaderStream. Its `keep_going` and its
`step` each first send the requests submitted since the last message, in order (with keep_going's busy flag), to the
other ranks: one object broadcast over the group's gloo group, on any device. Callers submit both after a step (the
episode driver) and between keep_going and step (rlx serve's stream worker, which agents use), so both carry them.
Each other rank runs the same loop with no episodes of its own on a FollowerStream: it adds the leader's requests to
its own copy of the engine in the same order, and answers and steps as the leader does. Closing sends what was
submitted last, so every copy aborts the same requests.

    stream = open_mirrored(group, engine.open_local_stream, sampling, max_context, num_seqs)
    leader:   stream.submit(tag, request) ... while stream.keep_going(busy): finished = stream.step()
    follower: while stream.keep_going(False): stream.step()    (the leader's turns; no results of its own)
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from rlx.parallel.dist import TensorParallelGroup, broadcast_object
from rlx.rollout.base import TokenStream
from rlx.rollout.config import SamplingParams
from rlx.rollout.requests import Generated, TokenRequest


@dataclass
class _Turns:
    """What the leader sends in keep_going, step and close: the requests it submitted since, in order."""

    requests: list[TokenRequest] = field(default_factory=list)
    is_busy: bool = False
    """The busy flag the leader passed to keep_going."""
    is_closing: bool = False
    """The leader closed its stream: no step follows."""


def open_mirrored(
    group: TensorParallelGroup | None,
    open_local: Callable[[SamplingParams, int, int], TokenStream],
    sampling: SamplingParams,
    max_context: int,
    num_seqs: int,
) -> TokenStream:
    """`open_local(sampling, max_context, num_seqs)` as is without a group; else opened on every rank of `group`
    together with the leader's arguments (a follower's caller has no episodes to size it for), as the leader's or a
    follower's side."""
    if group is None or group.degree == 1:
        return open_local(sampling, max_context, num_seqs)
    sampling, max_context, num_seqs = broadcast_object(
        (sampling, max_context, num_seqs), src=group.leader, group=group.objects
    )
    stream = open_local(sampling, max_context, num_seqs)
    return LeaderStream(stream, group) if group.rank == 0 else FollowerStream(stream, group)


class LeaderStream(TokenStream):
    """The group's first rank: its requests go into its own engine at once and to the followers before the next
    step."""

    lockstep = True  # the followers wait on every keep_going: a caller with nothing to generate comes back soon

    def __init__(self, stream: TokenStream, group: TensorParallelGroup):
        super().__init__(stream.sampling, stream.device)
        self.stream, self.group = stream, group
        self.pending: list[TokenRequest] = []

    def submit(self, tag: Any, request: TokenRequest) -> None:
        self.stream.submit(tag, request)
        self.pending.append(request)

    def _send(self, is_busy: bool, is_closing: bool) -> None:
        broadcast_object(_Turns(self.pending, is_busy, is_closing), src=self.group.leader, group=self.group.objects)
        self.pending = []

    def keep_going(self, busy: bool) -> bool:
        self._send(busy, False)
        return self.stream.keep_going(busy)

    def step(self) -> list[tuple[Any, Generated]]:
        self._send(True, False)
        return self.stream.step()

    @property
    def has_work(self) -> bool:
        return self.stream.has_work

    def stats(self) -> dict[str, int]:
        return self.stream.stats()

    def progress(self) -> dict[Any, int]:
        return self.stream.progress()

    def partial(self, tags: Collection[Any]) -> dict[Any, Generated]:
        return self.stream.partial(tags)

    def weights_changed(self) -> None:
        self.stream.weights_changed()

    def close(self) -> None:
        self._send(False, True)
        self.stream.close()


class FollowerStream(TokenStream):
    """Another rank of the group: adds the leader's requests to its copy of the engine and steps with it; its caller
    submits nothing, and gets no results (the leader's records are the group's)."""

    lockstep = True

    def __init__(self, stream: TokenStream, group: TensorParallelGroup):
        super().__init__(stream.sampling, stream.device)
        self.stream, self.group = stream, group
        self.num_mirrored = 0
        self.is_closed = False

    def submit(self, tag: Any, request: TokenRequest) -> None:
        raise RuntimeError(
            f"rank {self.group.rank} of a tensor-parallel group mirrors its first rank's stream: it submits nothing"
        )

    def _receive(self) -> _Turns:
        turns = broadcast_object(None, src=self.group.leader, group=self.group.objects)
        for request in turns.requests:
            self.stream.submit(self.num_mirrored, request)
            self.num_mirrored += 1
        self.is_closed = turns.is_closing
        return turns

    def keep_going(self, busy: bool) -> bool:
        """The leader's answer (`busy` is ignored): False once it closed (an error on its side), else the engine's
        own over the leader's busy flag (a collective where the engine steps in lockstep)."""
        if self.is_closed:
            return False
        turns = self._receive()
        return not turns.is_closing and self.stream.keep_going(turns.is_busy)

    def step(self) -> list[tuple[Any, Generated]]:
        if not self.is_closed and not self._receive().is_closing:
            self.stream.step()
        return []

    @property
    def has_work(self) -> bool:
        return self.stream.has_work

    def close(self) -> None:
        """Take the leader's last requests (those it submitted after its last step), then close as it does."""
        if not self.is_closed:
            self._receive()
        self.stream.close()
