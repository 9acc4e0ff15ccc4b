"""[eval] of an asynchronous run inside a rollout rank's open stream (async_rollout.py): the held-out prompts of one
policy version join the stream next to the training samples instead of draining it first.

A stream samples with one setting (temperature, top_p, top_k, stop strings: the training's). Eval requests fit it when
they are greedy (TokenRequest.greedy: the argmax whatever the stream's temperature) or sample with the training's
settings; in both cases their stop strings must be the training's, since the engines stop at the stream's during
generation (`shares_stream`). Each eval request carries its own key (the sample id) and seed
(eval.sampling.seed), so its draws are those of `rlx.evaluation.evaluate.evaluate` whatever runs next to it; a
stream's draws are made `max_new_tokens` wide and a narrower request reads a prefix of the same per-sample stream,
so the stream is opened as wide as the longer of the training and eval responses (`stream_sampling`). Evaluations
that do not fit keep the drain path (RolloutWorker._evaluate_pending), as do multi-turn runs, whose weights change
only between steps anyway.

    EvalShare       what a rollout rank puts in the store for an evaluated version (e/STEP/RANK)
    StreamEval      one version's eval requests while they are in the stream, and their graded samples
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from rlx.evaluation.evaluate import EvalConfig, EvalSample, eval_due, evaluate, grade
from rlx.parallel.dist import shard_range
from rlx.rollout.config import RolloutConfig, SamplingParams
from rlx.rollout.requests import Generated, build_requests, to_record, token_requests
from rlx.rollout.stops import StopStrings


@dataclass
class EvalShare:
    """A rollout rank's part of the evaluation of one policy version (key e/STEP/RANK)."""

    samples: list[EvalSample]
    """The graded samples of this rank's share of the held-out prompts."""
    pending_s: float = 0.0
    """Seconds from receiving the version to the share being graded (the rank took no newer weights meanwhile)."""
    overlap_samples: int = 0
    """Training samples admitted into the stream while the eval's samples were in flight (0 on the drain path)."""


def shares_stream(eval_cfg: EvalConfig, rollout_cfg: RolloutConfig) -> bool:
    """Whether the eval's requests can run in a stream opened with the training's sampling settings and give the
    tokens `evaluate` gives: greedy, or the same temperature, top_p and top_k; and the same stop strings."""
    mine, theirs = eval_cfg.sampling, rollout_cfg.sampling
    if mine.stop != theirs.stop or rollout_cfg.agent.is_multi_turn:
        return False
    if mine.temperature == 0:
        return True
    same = (mine.temperature, mine.top_p, mine.top_k) == (
        theirs.temperature,
        theirs.top_p,
        theirs.top_k,
    )
    return same and theirs.temperature > 0


def stream_sampling(sampling: SamplingParams, eval_cfg: EvalConfig | None) -> SamplingParams:
    """The setting a stream is opened with: the training's, its draws wide enough for eval responses too."""
    if eval_cfg is None or eval_cfg.sampling.max_new_tokens <= sampling.max_new_tokens:
        return sampling
    return dataclasses.replace(sampling, max_new_tokens=eval_cfg.sampling.max_new_tokens)


class StreamEval:
    """One policy version's eval requests (this rank's share of the held-out prompts) while in the stream."""

    def __init__(self, version: int, eval_cfg: EvalConfig, engine, prompts: list, received: float):
        self.version, self.cfg, self.received = version, eval_cfg, received
        self.sampling = eval_cfg.sampling
        self.requests = build_requests(prompts, engine.encoder, self.sampling)
        engine.check_requests(self.requests, self.sampling)
        greedy = self.sampling.is_greedy
        self.tokens = [
            dataclasses.replace(t, seed=self.sampling.seed, greedy=t.greedy or greedy)
            for t in token_requests(self.requests, self.sampling)
        ]
        self.results: list[Generated | None] = [None] * len(self.tokens)
        self.pending = set(range(len(self.tokens)))
        self.overlap_samples = 0
        """Training samples admitted while this eval is pending."""
        self.is_submitted = False

    @property
    def longest(self) -> int:
        """The longest context one of the requests may reach (prompt + max_new_tokens)."""
        return max((len(t.prompt_ids) + t.max_new_tokens for t in self.tokens), default=0)

    def submit(self, stream) -> None:
        """Queue every request in `stream`, tagged ('eval', version, index)."""
        for i, token in enumerate(self.tokens):
            stream.submit(("eval", self.version, i), token)
        self.is_submitted = True

    def take(self, index: int, generated: Generated) -> None:
        self.results[index] = generated
        self.pending.discard(index)

    @property
    def is_done(self) -> bool:
        return not self.pending

    def finish(self, tokenizer) -> EvalShare:
        """The graded samples (as `evaluate` makes them: stop strings cut, records at the eval's temperature)."""
        results = self.results
        if self.sampling.stop:
            stops = StopStrings(tokenizer, self.sampling.stop)
            results = [stops.cut(g) for g in results]
        records = [to_record(r, g, tokenizer, self.sampling.temperature) for r, g in zip(self.requests, results)]
        samples = grade(records, self.cfg) if records else []
        return EvalShare(samples, time.perf_counter() - self.received, self.overlap_samples)


def is_eval_tag(tag) -> bool:
    """Whether a stream result's tag is an eval request's (StreamEval.submit) rather than a training sample's."""
    return tag[0] == "eval"


class RankEval:
    """A rollout rank's [eval] of the versions due (a part of async_rollout.RolloutWorker, whose state it uses): in
    the open stream next to the training samples, or on the drain path; the graded shares go into the store."""

    def _eval_share_work(self, version: int) -> StreamEval:
        """This rank's share of the held-out prompts as stream requests of `version`."""
        mine = shard_range(len(self.eval_prompts), self.roles.rank_in_role, self.roles.num_rollout)
        prompts = [self.eval_prompts[i] for i in mine]
        return StreamEval(version, self.cfg.eval, self.engine, prompts, self.eval_received)

    def _eval_drained(self, active: dict) -> bool:
        """Start a pending [eval]: its requests for the stream (submitted by `_submit_eval`), or on the drain path
        once nothing is in flight; True when the drain path ran it (the caller's loop starts over)."""
        if self.eval_pending is None or self.eval_work is not None:
            return False
        if not self.eval_in_stream:
            if active:
                return False
            self._evaluate_pending()
            return True
        self.eval_work = self._eval_share_work(self.eval_pending)
        if self.eval_work.is_done:  # no held-out prompt falls to this rank
            self._put_eval(self.eval_work.finish(self.tokenizer))
        return False

    def _submit_eval(self) -> None:
        """The pending eval's requests into the stream (opened for them when there is none), once."""
        if self.eval_work is None or self.eval_work.is_submitted:
            return
        if self.stream is None:
            per_step = len(shard_range(self.cfg.data.prompts_per_step, self.roles.rank_in_role, self.roles.num_rollout))
            slots = max(len(self.eval_work.tokens), per_step * self.cfg.rollout.sampling.n)
            self._open(dataclasses.replace(self.cfg.rollout.sampling, seed=self.cfg.seed), self.eval_context, slots)
        self.eval_work.submit(self.stream)

    def _put_eval(self, share: EvalShare) -> None:
        self.channel.put(f"e/{self.eval_pending}/{self.roles.rank_in_role}", share)
        self.eval_pending, self.eval_work = None, None

    def _evaluate_pending(self) -> None:
        """[eval] of the version due: one in the stream is stepped to its end (training samples in flight go on
        meanwhile); else, with no samples in flight (the drain path), this rank's share of the held-out prompts is
        answered alone. The graded share goes into the store for the trainers."""
        if self.eval_pending is None:
            return
        if self.eval_work is not None:
            self._submit_eval()
            while self.eval_pending is not None:
                self._step_stream()
            return
        if self.stream is not None:
            self.stream.close()
            self.stream = None
        mine = shard_range(len(self.eval_prompts), self.roles.rank_in_role, self.roles.num_rollout)
        samples = evaluate(self.cfg.eval, self.engine, [self.eval_prompts[i] for i in mine])[0] if mine else []
        self._put_eval(EvalShare(samples, time.perf_counter() - self.eval_received))

    def _evaluate_last_versions(self) -> None:
        """The versions after the last step's samples that are due for [eval] (the trainers push only those)."""
        for version in range(self.version + 1, self.cfg.steps + 1):
            if eval_due(self.cfg.eval, version, self.start_step, self.cfg.steps):
                self.channel.wait(f"w/{version}/0", f"policy version {version} from the trainers", stop_aware=True)
                self._receive(version)
                self._evaluate_pending()
