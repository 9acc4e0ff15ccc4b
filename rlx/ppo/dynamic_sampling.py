"""DAPO dynamic sampling of one step (score.filter_groups): batches of prompts_per_step prompts, taken one after
the other from the data position with the step's sampling seed, are drawn until prompts_per_step informative groups
(groups whose samples got different task scores) are collected or data.max_gen_batches batches were drawn (0 =
until filled); the first prompts_per_step informative groups, in the order they were drawn, are trained.

The synchronous loop (loop.py) draws the batches itself. In an asynchronous run every rollout rank draws its slice
of each batch and filters it by the rule rewards (async_rollout.py); after each batch the ranks exchange their counts
of informative groups, so all of them decide alike whether to draw another batch (the step's data position after
it is the same on every rank) and each keeps its part of the first prompts_per_step groups in (batch, rank,
position) order (`kept_groups`). The trainers merge the shares batch by batch (`merge_kept`): the synchronous
step's samples, in its order.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from rlx.errors import UserError
from rlx.formats.records import RolloutRecord
from rlx.rollout.base import RolloutStats
from rlx.scoring.score import Rewards, compute_rewards, informative_groups


class GroupFilter:
    """One step's (or one rollout rank's slice of one step's) drawn batches: their informative groups, in order."""

    def __init__(self, want: int, max_batches: int):
        self.want, self.max_batches = want, max_batches
        self.records: list[RolloutRecord] = []
        """The records of informative groups, batch after batch."""
        self.rewards: list[Rewards] = []
        """Their rewards, one entry per batch."""
        self.batch_of: list[int] = []
        """The batch each kept record came from."""
        self.groups: list[str] = []
        """The informative groups' ids, in the order they were drawn."""
        self.num_batches = 0

    def add(self, records: list[RolloutRecord], rewards: Rewards) -> int:
        """A drawn batch and its rewards; returns how many informative groups it adds."""
        trained = [i for i, r in enumerate(records) if not r.is_greedy_baseline]  # ReMax baselines follow their group
        group_ids = [records[i].prompt_id for i in trained]
        good = {records[trained[i]].prompt_id for i in informative_groups(group_ids, rewards.task_scores[trained])}
        rows = [i for i, r in enumerate(records) if r.prompt_id in good]
        self.records += [records[i] for i in rows]
        self.rewards.append(rewards.select(rows))
        self.batch_of += [self.num_batches] * len(rows)
        self.num_batches += 1
        before = len(self.groups)
        self.groups = list(dict.fromkeys([*self.groups, *(records[i].prompt_id for i in rows)]))
        return len(self.groups) - before

    def needs_more(self, total_groups: int) -> bool:
        """Whether to draw another batch, with `total_groups` informative groups collected (over every rank)."""
        return total_groups < self.want and not (self.max_batches and self.num_batches >= self.max_batches)

    def take(self, num_groups: int) -> tuple[list[RolloutRecord], Rewards, list[int]]:
        """The records of the first `num_groups` informative groups, their rewards, and how many of them came
        from each batch drawn."""
        keep = set(self.groups[:num_groups])
        rows = [i for i, r in enumerate(self.records) if r.prompt_id in keep]
        sizes = [0] * self.num_batches
        for i in rows:
            sizes[self.batch_of[i]] += 1
        return [self.records[i] for i in rows], concat_rewards(self.rewards).select(rows), sizes


def kept_groups(counts: list[list[int]], rank: int, want: int) -> int:
    """How many of rank `rank`'s informative groups are among the first `want` in (batch, rank) order;
    counts[j][r] = rank r's informative groups in batch j."""
    taken = mine = 0
    for batch in counts:
        for r, count in enumerate(batch):
            kept = min(count, want - taken)
            taken += kept
            mine += kept if r == rank else 0
    return mine


def merge_kept(parts: list[tuple[list[RolloutRecord], Rewards, list[int]]]) -> tuple[list[RolloutRecord], Rewards]:
    """Several ranks' kept (records, rewards, records per batch) in the synchronous loop's order: batch by batch,
    each batch rank by rank."""
    records, pieces, starts = [], [], [0] * len(parts)
    for j in range(len(parts[0][2])):
        for r, (ours, rewards, sizes) in enumerate(parts):
            rows = list(range(starts[r], starts[r] + sizes[j]))
            records += [ours[i] for i in rows]
            pieces.append(rewards.select(rows))
            starts[r] += sizes[j]
    return records, concat_rewards(pieces)


def concat_rewards(parts: list[Rewards]) -> Rewards:
    return Rewards(
        torch.cat([r.scores for r in parts]),
        [d for r in parts for d in r.details],
        [e for r in parts for e in r.errors],
        torch.cat([r.task_scores for r in parts]),
    )


def sampling_metrics(step: int, records: list[RolloutRecord], num_batches: int) -> dict[str, float]:
    """The step's dynamic_sampling/* metrics; a step that kept nothing is an error saying what to raise."""
    if not records:
        raise UserError(
            f"step {step}: dynamic sampling found no prompt whose samples got different rewards "
            f"in {num_batches} batch(es); raise data.max_gen_batches or rollout.sampling.n"
        )
    return {
        "dynamic_sampling/gen_batches": float(num_batches),
        "dynamic_sampling/kept_groups": float(len({r.prompt_id for r in records})),
    }


@dataclass
class Draws:
    """Dynamic sampling of the step being generated: the informative groups of its batches so far, every rank's
    count of them per batch, and the batches' statistics."""

    groups: GroupFilter
    counts: list[list[int]] = dataclasses.field(default_factory=list)
    stats: RolloutStats = dataclasses.field(default_factory=lambda: RolloutStats(0, 0.0))


class RankDrawing:
    """A rollout rank's dynamic sampling (a part of async_rollout.RolloutWorker, whose state it uses): the batches of
    a step after the first, and the exchange of informative-group counts that decides, alike on every rank, when
    the step is full."""

    def _add_batch(self, work, records: list[RolloutRecord], stats: RolloutStats) -> bool:
        """A finished batch of a dynamically sampled step: its informative groups kept; the step's share delivered
        (True), or False when the ranks draw another batch (every rank decides alike from everyone's counts)."""
        draws = work.draws
        draws.stats = draws.stats + stats
        count = draws.groups.add(records, compute_rewards(records, self.score_cfg))
        draws.counts.append(self._batch_counts(work.step, draws.groups.num_batches - 1, count))
        if draws.groups.needs_more(sum(map(sum, draws.counts))):
            return False
        mine = kept_groups(draws.counts, self.roles.rank_in_role, self.cfg.data.prompts_per_step)
        kept, rewards, sizes = draws.groups.take(mine)
        self._deliver(work, kept, draws.stats, rewards, sizes)
        return True

    def _next_batch(self, work, start: dict):
        """Dynamic sampling: the step's next batch, in the stream (nothing else is in flight: reopened if its
        prompts are longer than the stream was sized for); a version due for [eval] is evaluated first on the drain
        path, or goes on in the stream."""
        if not self.eval_in_stream:
            self._evaluate_pending()
        following = self._prepare(work.step, start)
        following.draws = work.draws
        if self.stream is not None and following.longest > self.stream_context:
            self._evaluate_pending()  # the stream is reopened: an eval in it finishes first
            self.stream.close()
            self.stream = None
        return self._submit(following)

    def _new_draws(self) -> Draws | None:
        if not self.cfg.score.filter_groups:
            return None
        return Draws(GroupFilter(self.cfg.data.prompts_per_step, self.cfg.data.max_gen_batches))

    def _batch_counts(self, step: int, batch: int, count: int) -> list[int]:
        """Every rollout rank's count of informative groups in batch `batch` of step `step` (this rank's is
        `count`). While waiting, with nothing in flight, it takes new weights and evaluates as between steps (a
        weight broadcast the others have joined waits for this rank)."""
        self.channel.put(f"g/{step}/{batch}/{self.roles.rank_in_role}", count)

        def between_batches() -> None:
            self._evaluate_pending()
            if self._update_waiting():
                self._new_weights({})

        counts = []
        for r in range(self.roles.num_rollout):
            key, what = f"g/{step}/{batch}/{r}", f"rollout rank {r}'s dynamic sampling of step {step}"
            self.channel.wait(key, what, stop_aware=True, idle=between_batches)
            counts.append(self.channel.take(key, what, keep=True))
        return counts
