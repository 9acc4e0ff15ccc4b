"""A rollout rank of an asynchronous run: it generates every step's share of samples ahead of the trainers, as far
as the staleness bound lets it, and takes new weights whenever the trainers publish them.

For step s (prompts and seed exactly those of the synchronous loop's step s) rank r of R takes its slice of the
step's prompts; they enter the rank's one open stream once it holds policy version s - 1 - max_staleness or newer
(the bound: a batch trained at step s comes from the weights after step s - 1 - k at the oldest), so with k >= 1
the next step's samples fill the engine while the longest ones of this step finish. Between engine steps it polls
for a new version: when one has arrived it is received, and the samples still being generated either go on under
it (async.partial_rollouts = 'continue': the record's policy_versions says where each policy's tokens begin) or
are dropped and start again under it with the same random streams ('drop': rollout_restarts counts it). A step's
records go to the store as soon as its last sample finishes, with policy_version = the policy of its first token.
Rollout ranks hold no collective among themselves: each goes at its own pace.

Dynamic sampling (score.filter_groups, rlx/ppo/dynamic_sampling.py): a rank draws its slice of the step's batches
one after the other, as the synchronous loop draws them (batch j of a step takes the prompts_per_step prompts after
batch j - 1's, with the step's seed), and scores each finished batch with the rule rewards (no reward model here: the
recipe check refuses one; score.max_reward_error_fraction applies to the rank's slice). The ranks put each batch's count
of informative groups in the store (g/STEP/BATCH/RANK) and read everyone's, so all of them draw the same number of
batches and each keeps its part of the step's first prompts_per_step informative groups; the share carries their rewards
and the step's data position after the last batch. A step's first batch starts where the previous step's last one ended,
so steps enter the stream one at a time (the bound still lets a step be generated while the trainers train earlier
ones). While a rank waits for the others' counts (nothing in flight) it takes new weights and evaluates as between
steps.

[eval]: the weights after a step due for evaluation are evaluated here, exactly those. On receiving them a rank
takes them as any version and puts its share of the held-out prompts into the open stream next to the training
samples (rlx/ppo/async_eval.py), so training samples keep being admitted under the bound; it takes no newer
weights until every eval sample has finished, then puts the graded share in the store (e/STEP/RANK). An eval whose
sampling cannot share the training's stream (a different temperature or stop strings), and multi-turn runs, take the
drain path instead: no new prompts until the samples in flight have finished, then the eval alone. The trainers wait
for the shares at that step, as the synchronous loop waits for its evaluation.
"""

from __future__ import annotations

import dataclasses
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rlx.agent.generate import build_rollout
from rlx.checkpoints.loading import load_initial_policy, load_processor
from rlx.evaluation.evaluate import eval_due
from rlx.formats.data import take_prompts
from rlx.formats.records import RolloutRecord
from rlx.parallel.dist import DistContext, shard_range
from rlx.parallel.roles import Roles
from rlx.ppo.async_eval import RankEval, StreamEval, is_eval_tag, shares_stream, stream_sampling
from rlx.ppo.async_transport import BroadcastWeights, Channel, StopSignal
from rlx.ppo.config import PPOConfig
from rlx.ppo.dynamic_sampling import Draws, RankDrawing
from rlx.ppo.start import check_run_inputs
from rlx.rollout.base import RolloutStats, build_engine
from rlx.rollout.config import SamplingParams
from rlx.rollout.requests import Generated, build_requests, to_record, token_requests
from rlx.rollout.stops import StopStrings
from rlx.scoring.score import Rewards


@dataclass
class BatchShare:
    """What a rollout rank puts in the store for one step (key b/STEP/RANK)."""

    records: list[RolloutRecord]
    stats: RolloutStats
    weight_wait_s: float
    """Seconds this rank waited for weights the staleness bound required, while producing this batch."""
    data_position: int
    """The prompt position after the step (what the step's checkpoint records)."""
    rewards: Rewards | None = None
    """Dynamic sampling: the rule rewards of the records (those of the informative groups this rank keeps)."""
    batch_sizes: list[int] | None = None
    """Dynamic sampling: how many of the records came from each batch drawn (one entry per batch)."""


class _StepWork:
    """One step's share while it is generated: its requests, what has come back, and by which weights."""

    def __init__(self, step, data_position, sampling, requests, tokens, start, version=-1):
        self.step, self.data_position, self.sampling = step, data_position, sampling
        self.requests, self.tokens = requests, tokens
        self.longest = max((len(t.prompt_ids) + t.max_new_tokens for t in tokens), default=0)
        """The longest context a request may reach (prompt + max_new_tokens)."""
        self.results: list[Generated | None] = [None] * len(tokens)
        self.pending = set(range(len(tokens)))
        self.spans = [[[0, version]] for _ in tokens]
        """Per sample: [response token index, policy version] where each run of tokens under one policy begins
        (set when the step's requests are submitted)."""
        self.restarts = [0] * len(tokens)
        self.began = time.perf_counter()
        self.start = start
        """Where the trainers started (a resume's checkpoint step)."""
        self.draws: Draws | None = None
        """Dynamic sampling: the step's batches so far (shared by the works of one step's batches)."""


class RolloutWorker(RankEval, RankDrawing):
    """The loop of one rollout rank."""

    def __init__(self, cfg: PPOConfig, run_dir: Path, roles: Roles):
        self.cfg, self.roles = cfg, roles
        self.channel = Channel(roles.store, roles.timeout_s)
        inputs = check_run_inputs(cfg, run_dir)
        self.prompts, self.eval_prompts = inputs.prompts, inputs.eval_prompts
        model, self.tokenizer, _ = load_initial_policy(inputs.source, cfg.model.init, cfg.seed, inputs.config)
        processor = load_processor(inputs.source, cfg.vision, inputs.config)
        ctx = DistContext(device=roles.device)  # no process group: this rank generates on its own
        self.engine = build_engine(cfg.rollout, model.requires_grad_(False), self.tokenizer, ctx, processor)
        self.rollout = build_rollout(cfg.rollout, self.engine)
        """The engine, or episodes on it (multi-turn): the latter generate a step at a time, not in the stream."""
        self.version = -1
        self.weight_wait_s = 0.0
        self.start_step = 0
        self.eval_pending: int | None = None
        """A policy version due for [eval], received and not yet evaluated."""
        self.eval_received = 0.0
        """When eval_pending was received."""
        self.eval_work: StreamEval | None = None
        """eval_pending's requests while they are in the stream."""
        self.eval_in_stream = cfg.eval is not None and shares_stream(cfg.eval, cfg.rollout)
        self.eval_context = self._eval_share_work(0).longest if self.eval_in_stream else 0
        """The longest context of this rank's eval requests: every stream is opened with room for them."""
        self.stream = None
        self.active: dict[int, _StepWork] = {}
        """The steps (or dynamic-sampling batches) in the stream, by step."""
        self.next_position = 0
        """The data position the next batch of prompts starts at."""
        self.score_cfg = dataclasses.replace(
            cfg.score, max_response_length=cfg.score.max_response_length or cfg.rollout.sampling.max_new_tokens
        )

    def run(self) -> None:
        cfg, channel = self.cfg, self.channel
        with _ignore_sigterm():  # the trainers decide when to stop (after a step's checkpoint); we serve until then
            try:
                start = channel.take("start", "the trainers' start", keep=True, stop_aware=True)
                self.start_step, self.next_position = start["start_step"], start["data_position"]
                steps = range(start["start_step"] + 1, cfg.steps + 1)
                if steps:
                    self._receive(start["start_step"])
                    self._produce(steps, start)
                    self._evaluate_last_versions()
                channel.wait("stop", "the trainers to finish", timeout_s=float("inf"))
            except StopSignal:
                pass
            finally:
                self.engine.close()

    def _produce(self, steps: range, start: dict) -> None:
        """Generate `steps`' shares through one stream: a step's requests go in as soon as the staleness bound
        allows them with the weights held (so the next step's samples fill the engine while this one's longest
        finish), new weights are taken as they are published (in-flight samples continue under them, or are
        dropped and started again: async.partial_rollouts), and each step's share is put in the store as soon as
        its last sample finishes."""
        if self.rollout is not self.engine:  # episodes take new weights between steps only: one step at a time
            for step in steps:
                self._produce_episodes(step, start)
            return
        queue, active = list(steps), {}
        self.active = active
        self.stream, self.stream_context, self.ready = None, 0, None
        try:
            while queue or active or self.eval_pending is not None:
                if self._eval_drained(active):
                    continue
                if self.eval_pending is None or self.eval_work is not None:  # the drain path admits nothing meanwhile
                    self._admit(queue, active, start)
                self._submit_eval()  # after the training samples: a stream it opens is sized for those too
                if not active and self.eval_work is None:  # the bound needs newer weights than these: wait for them
                    what = f"policy version {self.version + 1} from the trainers"
                    self.weight_wait_s += self.channel.wait(f"w/{self.version + 1}/0", what, stop_aware=True)
                    self._new_weights(active)
                    continue
                if self.eval_pending is None and self._update_waiting():  # never past a version under evaluation
                    self._new_weights(active)
                self._step_stream()
                for step in [s for s, work in active.items() if not work.pending]:
                    work = active.pop(step)
                    if not self._put(work):  # dynamic sampling: the ranks draw another batch of the step
                        active[step] = self._next_batch(work, start)
        finally:
            if self.stream is not None:
                self.stream.close()

    def _admit(self, queue: list[int], active: dict[int, _StepWork], start: dict) -> None:
        """Queue the next steps' requests that the staleness bound allows with the weights held; a step whose
        prompts are longer than the open stream was sized for waits until the stream drains (then it is reopened)."""
        while queue and self.version >= queue[0] - 1 - self.cfg.async_.max_staleness:
            if self.cfg.score.filter_groups and active:  # its prompts start where this step's last batch ends
                return
            self.ready = self.ready or self._prepare(queue[0], start)
            if self.ready.longest > self.stream_context and self.stream is not None:
                if active or self.eval_work is not None:
                    return
                self.stream.close()
                self.stream = None
            queue.pop(0)
            active[self.ready.step] = self._submit(self.ready)
            self.ready = None

    def _produce_episodes(self, step: int, start: dict) -> None:
        """Multi-turn (rollout.agent.env / rollout.agent.agent): step `step`'s episodes with the newest weights
        published, at least those the bound needs; weights change only between steps, so every episode is one
        policy's."""
        self._evaluate_pending()
        while self.version < step - 1 - self.cfg.async_.max_staleness or self._update_waiting():
            what = f"policy version {self.version + 1} from the trainers"
            self.weight_wait_s += self.channel.wait(f"w/{self.version + 1}/0", what, stop_aware=True)
            self._receive(self.version + 1)
            self._evaluate_pending()
        draws = self._new_draws()
        while True:  # one batch, or with dynamic sampling as many as the ranks need
            prompts, position, sampling = self._step_prompts(step)
            work = _StepWork(step, position, sampling, [], [], start, self.version)
            work.draws = draws
            result = self.rollout.generate(prompts, sampling)
            for record in result.records:
                record.policy_version, record.rollout_restarts = self.version, 0
            if self._finish(work, result.records, result.stats):
                return

    def _step_prompts(self, step: int) -> tuple[list, int, SamplingParams]:
        """This rank's slice of the next batch of prompts (step `step`'s, exactly the synchronous loop's), the data
        position after it, and the step's sampling settings (its seed)."""
        cfg = self.cfg
        want = cfg.data.prompts_per_step
        prompts = take_prompts(self.prompts, self.next_position, want, cfg.seed if cfg.data.shuffle else None)
        self.next_position += want
        mine = shard_range(len(prompts), self.roles.rank_in_role, self.roles.num_rollout)
        return (
            [prompts[i] for i in mine],
            self.next_position,
            dataclasses.replace(cfg.rollout.sampling, seed=cfg.seed + step),
        )

    def _prepare(self, step: int, start: dict) -> _StepWork:
        """Step `step`'s next prompts (and seed) exactly as the synchronous loop takes them, this rank's slice, as
        token requests (each with the step's seed: several steps share one stream)."""
        prompts, position, sampling = self._step_prompts(step)
        requests = build_requests(prompts, self.engine.encoder, sampling)
        self.engine.check_requests(requests, sampling)
        tokens = [dataclasses.replace(t, seed=sampling.seed) for t in token_requests(requests, sampling)]
        work = _StepWork(step, position, sampling, requests, tokens, start)
        work.draws = self._new_draws()
        return work

    def _submit(self, work: _StepWork) -> _StepWork:
        """Queue the step's requests in the open stream (opened, sized for the bound's steps, when there is none)
        under the weights held now."""
        if self.stream is None:  # room for later steps' somewhat longer prompts; a step longer still waits (_produce)
            self._open(work.sampling, work.longest * 5 // 4, len(work.tokens))
        work.began, work.spans = time.perf_counter(), [[[0, self.version]] for _ in work.tokens]
        if self.eval_work is not None:
            self.eval_work.overlap_samples += len(work.pending)
        for i in sorted(work.pending):
            self.stream.submit((work.step, i), work.tokens[i])
        return work

    def _open(self, sampling: SamplingParams, context: int, per_step: int) -> None:
        """A stream with the training's sampling, room for eval requests too when they share it."""
        slots = per_step * (1 + self.cfg.async_.max_staleness)  # the steps the bound lets run at once
        context = max(context, self.eval_context)
        sampling = stream_sampling(sampling, self.cfg.eval if self.eval_in_stream else None)
        self.stream, self.stream_context = self.engine.open_stream(sampling, context, slots), context

    def _step_stream(self) -> None:
        """One engine step; finished samples go to their step's work or to the eval in flight (which is put in the
        store once its last sample is in)."""
        for tag, generated in self.stream.step():
            if is_eval_tag(tag):
                self.eval_work.take(tag[2], generated)
            else:
                work = self.active[tag[0]]
                work.results[tag[1]] = generated
                work.pending.discard(tag[1])
        if self.eval_work is not None and self.eval_work.is_done:
            self._put_eval(self.eval_work.finish(self.tokenizer))

    def _new_weights(self, active: dict[int, _StepWork]) -> None:
        """Take the next policy version. 'continue': in-flight samples go on under it (where each one's new run of
        tokens begins is recorded); 'drop': they are dropped and start again under it, with the same draws."""
        live = [(work, i) for work in active.values() for i in sorted(work.pending)]
        if self.cfg.async_.partial_rollouts == "continue" or not live:
            progress = self.stream.progress() if self.stream is not None else {}
            self._receive(self.version + 1)
            if self.stream is not None:
                self.stream.weights_changed()
            for work, i in live:
                work.spans[i].append([progress.get((work.step, i), 0), self.version])
            return
        self.stream.close()
        self._receive(self.version + 1)
        first = next(iter(active.values()))
        self._open(first.sampling, self.stream_context, len(first.tokens))
        for work, i in live:
            work.restarts[i] += 1
            work.spans[i] = [[0, self.version]]
            self.stream.submit((work.step, i), work.tokens[i])

    def _put(self, work: _StepWork) -> bool:
        """The finished batch's records (with the versions that generated them) into the store, or with dynamic
        sampling False when the ranks draw another batch of the step (_finish)."""
        results = work.results
        if work.sampling.stop:
            stops = StopStrings(self.tokenizer, work.sampling.stop)
            results = [stops.cut(g) for g in results]
        records = [to_record(r, g, self.tokenizer, work.sampling.temperature) for r, g in zip(work.requests, results)]
        for record, generated, spans, count in zip(records, results, work.spans, work.restarts):
            runs = _token_runs(spans, len(generated.response_ids))
            record.policy_version, record.rollout_restarts = runs[0][1], count
            record.policy_versions = runs if len(runs) > 1 else None
        seconds = time.perf_counter() - work.began
        return self._finish(work, records, RolloutStats(sum(len(g.response_ids) for g in results), seconds))

    def _finish(self, work: _StepWork, records: list[RolloutRecord], stats: RolloutStats) -> bool:
        """A finished batch of step `work.step`: delivered (True), or with dynamic sampling its informative groups
        kept and False when the ranks draw another batch (every rank decides alike from everyone's counts)."""
        if work.draws is None:
            self._deliver(work, records, stats)
            return True
        return self._add_batch(work, records, stats)

    def _deliver(self, work: _StepWork, records: list[RolloutRecord], stats: RolloutStats,
                 rewards: Rewards | None = None, batch_sizes: list[int] | None = None) -> None:  # fmt: skip
        """The step's records into the store (marked when a resumed run may have generated them before)."""
        cfg, start = self.cfg, work.start
        if start["start_step"] > 0 and work.step <= start["start_step"] + cfg.save_every + cfg.async_.max_staleness:
            for record in records:  # the stopped run may have generated (or trained) these samples already
                record.resumed_from = start["start_step"]
        share = BatchShare(records, stats, self.weight_wait_s, work.data_position, rewards, batch_sizes)
        self.channel.put(f"b/{work.step}/{self.roles.rank_in_role}", share)
        self.weight_wait_s = 0.0

    def _receive(self, version: int) -> None:
        source = BroadcastWeights(self.roles, self.channel, version)
        self.engine.update_weights(source)
        source.drain()
        self.version = version
        if eval_due(self.cfg.eval, version, self.start_step, self.cfg.steps):
            self.eval_pending, self.eval_received = version, time.perf_counter()

    def _update_waiting(self) -> bool:
        return self.channel.has(f"w/{self.version + 1}/0")


def _token_runs(spans: list[list[int]], length: int) -> list[list[int]]:
    """[index, version] where each run of a response's `length` tokens begins, from the updates seen while it was
    generated (an update before any new token replaces the run it would start; one after the last token is
    dropped)."""
    runs: list[list[int]] = []
    for index, version in spans:
        if index >= length:
            break
        if runs and runs[-1][0] == index:
            runs[-1] = [index, version]
        else:
            runs.append([index, version])
    return runs


@contextmanager
def _ignore_sigterm():
    """SIGTERM (the launcher stopping the job) is for the trainers, who finish the step and its checkpoint and then
    set `stop`; a rollout rank keeps serving them meanwhile (the launcher kills it if they never do)."""
    try:
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
