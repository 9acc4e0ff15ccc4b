"""A rollout rank of an asynchronous run: it generates every step's share of samples ahead of the trainers, as far
as the staleness bound lets it, and takes new weights whenever the trainers publish them.

For step s (prompts and seed exactly those of the synchronous loop's step s) rank r of R takes its slice of the
step's prompts, waits until it holds policy version s - 1 - max_staleness or newer (the bound: a batch trained at
step s comes from the weights after step s - 1 - k at the oldest), generates, and puts its records in the store.
Between engine steps it polls for a new version: when one has arrived, the samples still being generated are
dropped (async.partial_rollouts = 'drop'), the weights are received, and those samples start again under them
with the same random streams (their `rollout_restarts` counts it). Finished samples keep their version. Rollout
ranks hold no collective among themselves: each goes at its own pace.
"""

from __future__ import annotations

import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rlx.engine.checkpoints.loading import load_initial_policy, load_processor
from rlx.engine.data import take_prompts
from rlx.engine.parallel.dist import DistContext, shard_range
from rlx.engine.parallel.roles import Roles
from rlx.engine.ppo.async_transport import BroadcastWeights, Channel, StopSignal
from rlx.engine.ppo.config import PPOConfig
from rlx.engine.ppo.start import check_run_inputs
from rlx.engine.records import PromptRecord, RolloutRecord
from rlx.engine.rollout.base import RolloutStats, build_engine
from rlx.engine.rollout.config import SamplingParams
from rlx.engine.rollout.requests import build_requests, to_record, token_requests
from rlx.engine.rollout.stops import StopStrings
from rlx.models.loading import resolve_source


@dataclass
class BatchShare:
    """What a rollout rank puts in the store for one step (key b/STEP/RANK)."""

    records: list[RolloutRecord]
    stats: RolloutStats
    weight_wait_s: float
    """Seconds this rank waited for weights the staleness bound required, while producing this batch."""
    data_position: int
    """The prompt position after the step (what the step's checkpoint records)."""


class RolloutWorker:
    """The loop of one rollout rank."""

    def __init__(self, cfg: PPOConfig, run_dir: Path, roles: Roles):
        self.cfg, self.roles = cfg, roles
        self.channel = Channel(roles.store, roles.timeout_s)
        self.prompts = check_run_inputs(cfg, run_dir).prompts
        model, self.tokenizer, _ = load_initial_policy(cfg.model.path, cfg.model.init, cfg.seed)
        processor = load_processor(resolve_source(cfg.model.path), cfg.vision)
        ctx = DistContext(device=roles.device)  # no process group: this rank generates on its own
        self.engine = build_engine(cfg.rollout, model, self.tokenizer, ctx, processor)
        self.version = -1
        self.weight_wait_s = 0.0

    def run(self) -> None:
        cfg, channel = self.cfg, self.channel
        with _ignore_sigterm():  # the trainers decide when to stop (after a step's checkpoint); we serve until then
            try:
                start = channel.take("start", "the trainers' start", keep=True, stop_aware=True)
                steps = range(start["start_step"] + 1, cfg.steps + 1)
                if steps:
                    self._receive(start["start_step"])
                for step in steps:
                    self._produce(step, start)
                channel.wait("stop", "the trainers to finish", timeout_s=float("inf"))
            except StopSignal:
                pass
            finally:
                self.engine.close()

    def _produce(self, step: int, start: dict) -> None:
        cfg, lag = self.cfg, self.cfg.async_.max_staleness
        while self.version < step - 1 - lag:  # the staleness bound: wait for the weights it needs
            what = f"policy version {self.version + 1} from the trainers"
            self.weight_wait_s += self.channel.wait(f"w/{self.version + 1}/0", what, stop_aware=True)
            self._receive(self.version + 1)
        want = cfg.data.prompts_per_step
        position = start["data_position"] + (step - start["start_step"] - 1) * want
        prompts = take_prompts(self.prompts, position, want, cfg.seed if cfg.data.shuffle else None)
        mine = shard_range(len(prompts), self.roles.rank_in_role, self.roles.num_rollout)
        records, stats = self._generate([prompts[i] for i in mine], cfg.rollout.sampling(seed=cfg.seed + step))
        if start["start_step"] > 0 and step <= start["start_step"] + cfg.save_every + lag:
            for record in records:  # the stopped run may have generated (or trained) these samples already
                record.resumed_from = start["start_step"]
        share = BatchShare(records, stats, self.weight_wait_s, position + want)
        self.channel.put(f"b/{step}/{self.roles.rank_in_role}", share)
        self.weight_wait_s = 0.0

    def _receive(self, version: int) -> None:
        source = BroadcastWeights(self.roles, self.channel, version)
        self.engine.update_weights(source)
        source.drain()
        self.version = version

    def _generate(self, prompts: list[PromptRecord], sampling: SamplingParams):
        """This rank's records for `prompts`, dropping and restarting the unfinished ones whenever new weights
        arrive; statistics as `engine.generate` reports them."""
        requests = build_requests(prompts, self.engine.encoder, sampling)
        self.engine.check_requests(requests, sampling)
        tokens = token_requests(requests, sampling)
        results, versions, restarts = [None] * len(tokens), [0] * len(tokens), [0] * len(tokens)
        pending, started = set(range(len(tokens))), time.perf_counter()
        while pending:
            if self._update_waiting():
                self._receive(self.version + 1)
            longest = max(len(tokens[i].prompt_ids) + tokens[i].max_new_tokens for i in pending)
            stream = self.engine.open_stream(sampling, longest, len(pending))
            try:
                for i in sorted(pending):
                    stream.submit(i, tokens[i])
                while stream.has_work:
                    for i, generated in stream.step():
                        results[i], versions[i] = generated, self.version
                        pending.discard(i)
                    if pending and self._update_waiting():  # new weights: drop the unfinished samples
                        for i in pending:
                            restarts[i] += 1
                        break
            finally:
                stream.close()
        if sampling.stop:
            stops = StopStrings(self.tokenizer, sampling.stop)
            results = [stops.cut(g) for g in results]
        records = [to_record(r, g, self.tokenizer, sampling.temperature) for r, g in zip(requests, results)]
        for record, version, count in zip(records, versions, restarts):
            record.policy_version, record.rollout_restarts = version, count
        seconds = time.perf_counter() - started
        return records, RolloutStats(sum(len(g.response_ids) for g in results), seconds)

    def _update_waiting(self) -> bool:
        return self.channel.has(f"w/{self.version + 1}/0")


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
