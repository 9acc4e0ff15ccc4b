"""Asynchronous `rlx ppo` (a recipe's [async] table, under torchrun): rollout ranks generate while trainer ranks
train, each trained sample at most `async.max_staleness` policy updates old.

    torchrun --nproc_per_node 2 -m rlx ppo recipes/quickstart_async.toml     # rank 0 generates, rank 1 trains

The trainers run the synchronous loop (PPORun: score, train, artifacts, checkpoints, metrics, resume) with two
changes: a step's samples come from the rollout ranks' batches in the store instead of an engine in the process,
and after the update that makes policy version t (t = the step) the trainers broadcast the weights to the rollout
ranks (rlx/ppo/async_transport.py). With max_staleness = 0 a rollout rank generates step t's samples with
exactly the weights after step t - 1: the synchronous loop, bit for bit. The rollout side is
rlx/ppo/async_rollout.py.

Dynamic sampling (score.filter_groups): the rollout ranks draw and filter the step's batches (async_rollout.py)
and send the kept samples' rule rewards along; the trainers merge the shares batch by batch, in the synchronous
loop's order (rlx/ppo/dynamic_sampling.py), and report `dynamic_sampling/gen_batches` and
`dynamic_sampling/kept_groups` as it does. Every kept sample is checked against the bound like any other.

[eval]: the rollout ranks evaluate the weights after each due step (pushed to them even when no later batch needs
them) and the lead trainer writes their graded shares as the synchronous loop writes its own.

Metrics per step: `async/staleness_mean`, `async/staleness_max` (updates between the generating policy and the
one trained), `async/partial_rollout_share` (samples that new weights reached while they were generated: restarted
under them, async.partial_rollouts = 'drop', or finished by them, 'continue'),
`async/queue_depth` (later steps' batches already waiting when this one was taken), `async/trainer_wait_s`
(seconds the trainers waited for this batch), `async/rollout_weight_wait_s` (seconds rollout ranks waited for
weights the bound required while producing it, the slowest rank), `timing/weight_push_s`; at evaluated steps
`async/eval_pending_s` (seconds from a rollout rank receiving the weights to its eval share being graded, the slowest
rank) and `async/eval_overlap_samples` (training samples admitted next to the eval's in the stream, every rank).
"""

from __future__ import annotations

import time
from pathlib import Path

from rlx.evaluation.evaluate import EVAL_FILE, graded_metrics
from rlx.formats.records import RolloutRecord
from rlx.parallel.dist import broadcast_object
from rlx.parallel.roles import Roles, split_roles
from rlx.ppo.async_rollout import BatchShare, RolloutWorker
from rlx.ppo.async_transport import Channel, push_weights
from rlx.ppo.config import PPOConfig
from rlx.ppo.dynamic_sampling import merge_kept, sampling_metrics
from rlx.ppo.loop import PPORun
from rlx.ppo.rundir import step_dir
from rlx.rollout.base import RolloutStats
from rlx.rollout.stats import EpisodeStats
from rlx.utils.device import resolve_precision
from rlx.utils.io import write_jsonl


class RemoteRollouts:
    """What a trainer holds in place of a rollout engine: the engine lives on the rollout ranks."""

    ctx = None
    """The step's records come from the rollout ranks (every trainer gets them all); the trainers score every sample
    each (their ranks are not the whole launch, which a gather of shared rewards would take)."""

    def counters(self) -> dict[str, float]:
        return {}

    def sleep(self) -> float:
        return 0.0

    def wake(self) -> None:
        return None

    def unmapped_bytes(self) -> int:
        return 0  # no engine on this rank

    def close(self) -> None:
        return None


class AsyncPPORun(PPORun):
    """The trainers' side of an asynchronous run (every trainer rank; the first one writes the run folder)."""

    def __init__(self, cfg: PPOConfig, run_dir: Path, resume: bool, overwrite: bool, roles: Roles):
        self.roles = roles
        self.channel = Channel(roles.store, roles.timeout_s)
        super().__init__(cfg, run_dir, resume, overwrite)

    def _build_engine(self) -> RemoteRollouts:
        return RemoteRollouts()

    def _start(self, inputs, resume: bool, overwrite: bool) -> None:
        super()._start(inputs, resume, overwrite)
        if self.roles.is_lead_trainer:
            self.channel.put("start", {"start_step": self.start_step, "data_position": self.data_position})
        if self.start_step < self.cfg.steps:
            self._push(self.start_step)  # the rollout ranks start from the run's current weights

    def run(self) -> None:
        try:
            super().run()
        finally:  # done or failed: the rollout ranks stop waiting for us
            if self.roles.is_lead_trainer:
                self.channel.put("stop", True)

    def _push(self, version: int) -> float:
        dtype = resolve_precision(self.cfg.rollout.precision, self.device)
        bucket_bytes = self.cfg.rollout.sync_bucket_mib << 20
        return push_weights(self.roles, self.channel, version, self.trainer.weights(), bucket_bytes, dtype)

    def _refresh_engine(self, step: int) -> None:
        return None  # the weights went out right after the update (_train)

    def _train(self, step: int, result) -> dict:
        metrics = super()._train(step, result)
        # a later batch may still need this version, or the rollout ranks evaluate it
        if step <= self.cfg.steps - 1 - self.cfg.async_.max_staleness or self._eval_due(step):
            metrics["timing/weight_push_s"] = self._push(step)
        return metrics

    def _evaluate(self, step: int) -> dict:
        """[eval] of the weights after `step`: the rollout ranks answer the held-out prompts (each a share) with
        exactly those weights; the lead trainer takes the graded shares and writes step_NNNNNN/eval.jsonl."""
        start, metrics = time.perf_counter(), None
        if self.roles.is_lead_trainer:
            shares = [self.channel.take(f"e/{step}/{r}", f"the evaluation of step {step} from rollout rank {r}")
                      for r in range(self.roles.num_rollout)]  # fmt: skip
            samples = [s for share in shares for s in share.samples]
            write_jsonl(step_dir(self.run_dir, step) / EVAL_FILE, (s.to_json() for s in samples))
            metrics = graded_metrics(samples)
            metrics["async/eval_pending_s"] = max(share.pending_s for share in shares)
            metrics["async/eval_overlap_samples"] = float(sum(share.overlap_samples for share in shares))
        metrics = broadcast_object(metrics)
        metrics["timing/eval_s"] = time.perf_counter() - start
        return metrics

    def _sample(self, step: int):
        """The step's samples from the rollout ranks' batches (taken by the lead, shared with every trainer)."""
        shares, waited, depth = None, 0.0, 0.0
        if self.roles.is_lead_trainer:
            start = time.perf_counter()
            num = self.roles.num_rollout
            shares = [self.channel.take(f"b/{step}/{r}", f"the batch of step {step} from rollout rank {r}")
                      for r in range(num)]  # fmt: skip
            waited = time.perf_counter() - start
            later = range(step + 1, step + 2 + self.cfg.async_.max_staleness)
            depth = sum(self.channel.has(f"b/{s}/{r}") for s in later for r in range(num)) / num
        shares, waited, depth = broadcast_object((shares, waited, depth))
        records, rewards = [r for share in shares for r in share.records], None
        self.data_position = shares[0].data_position
        metrics = _rollout_metrics(shares)
        if shares[0].rewards is not None:  # dynamic sampling: the informative groups the rollout ranks kept
            records, rewards = merge_kept([(s.records, s.rewards, s.batch_sizes) for s in shares])
            metrics.update(sampling_metrics(step, records, len(shares[0].batch_sizes)))
        metrics.update(self._staleness(step, records))
        metrics["async/trainer_wait_s"] = waited
        metrics["async/queue_depth"] = depth
        return records, rewards, metrics

    def _staleness(self, step: int, records: list[RolloutRecord]) -> dict[str, float]:
        """The staleness of the step's samples; a sample past the bound is a bug, never trained on."""
        lags = [step - 1 - r.policy_version for r in records]
        bound = self.cfg.async_.max_staleness
        worst = max(range(len(records)), key=lambda i: lags[i])
        if lags[worst] > bound or min(lags) < 0:
            raise RuntimeError(
                f"step {step}: sample {records[worst].id} comes from policy version {records[worst].policy_version}, "
                f"outside async.max_staleness = {bound}"
            )
        return {
            "async/staleness_mean": sum(lags) / len(lags),
            "async/staleness_max": float(max(lags)),
            "async/partial_rollout_share": sum(bool(r.rollout_restarts or r.policy_versions) for r in records)
            / len(records),
        }


def _rollout_metrics(shares: list[BatchShare]) -> dict[str, float]:
    """The step's generation statistics over the rollout ranks (they generate in parallel: the slowest one's time)."""
    tokens = sum(s.stats.tokens for s in shares)
    episodes = [(len(s.records), s.stats.episodes) for s in shares if s.stats.episodes is not None]  # multi-turn
    merged = EpisodeStats.merge(episodes) if episodes else None
    metrics = RolloutStats(tokens, max(s.stats.seconds for s in shares), episodes=merged).metrics()
    metrics["async/rollout_weight_wait_s"] = max(s.weight_wait_s for s in shares)
    return metrics


def run_async_ppo(cfg: PPOConfig, run_dir: Path, resume: bool = False, overwrite: bool = False) -> None:
    """This process's part of an asynchronous run: a rollout rank or a trainer, by its rank (see module doc)."""
    roles = split_roles(cfg.async_.rollout_ranks, cfg.train.device, cfg.train.sp_degree)
    if roles.is_rollout:
        RolloutWorker(cfg, run_dir, roles).run()
        return
    try:
        run = AsyncPPORun(cfg, run_dir, resume, overwrite, roles)
    except BaseException:  # a failed start: the rollout ranks stop waiting for it
        if roles.is_lead_trainer:
            Channel(roles.store, roles.timeout_s).put("stop", True)
        raise
    try:
        run.run()
    finally:
        run.lock.release()
