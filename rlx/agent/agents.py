"""Agents over the OpenAI-compatible endpoint: `NAME(record, base_url) -> float` for every sample, concurrently.

The server runs in this process; each sample's agent gets its own base URL, so every request it
makes (through the `openai` client or any HTTP client) lands in that sample's trajectory. The
sample's record is its last trajectory segment; earlier segments (the agent rewrote its history)
are kept in `segments` with the reason each began.

An agent that needs the run's settings or holds a resource for the whole run (a worker process) is a subclass of
`RunAgent`: the class named by `agent` is built once per run with the run's AgentConfig (`load_agent`), called per
sample, and closed when the run ends (verifiers_agent.py and openai_agents_agent.py are such agents).

The record handed to the agent keeps its prompt's image parts (`{"type": "image", "image": REF}`); the agent may
send them as they are or as OpenAI `image_url` parts (request_images.py). A sample's images, the prompt's and any
the agent sent later, are kept in token order in the record's `image_refs`, as an environment episode's are.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from rlx.agent.environment import CallPool, EnvError, load_object, report_dropped
from rlx.chat.records import trajectory_record
from rlx.errors import UserError
from rlx.formats.records import PromptRecord, RolloutRecord
from rlx.models.vision.images import image_refs
from rlx.rollout.agent_config import AgentConfig
from rlx.rollout.base import RolloutEngine, RolloutResult, RolloutStats
from rlx.rollout.config import SamplingParams
from rlx.rollout.stats import EpisodeStats
from rlx.serve.config import EndpointConfig
from rlx.serve.server import AgentServer
from rlx.serve.sessions import SampleSession
from rlx.serve.stream import StreamWorker


class RunAgent:
    """An agent built once per run with the run's AgentConfig: called as `agent(record, base_url) -> reward` for every
    sample (from several threads at once), then closed."""

    def __init__(self, cfg: AgentConfig):
        self.cfg = cfg

    def __call__(self, record: dict, base_url: str) -> float:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the agent holds (called once, after the run's last rollout)."""


def load_agent(spec: str, cfg: AgentConfig) -> Callable:
    """The agent `spec` names: a function as it is, a RunAgent subclass built with `cfg`."""
    agent = load_object(spec, "--agent")
    return agent(cfg) if isinstance(agent, type) and issubclass(agent, RunAgent) else agent


class AgentRollout:
    """Runs an agent per sample against an in-process server and returns the samples' rollout records."""

    def __init__(
        self, engine: RolloutEngine, tokenizer, sampling: SamplingParams, cfg: AgentConfig, agent: str | Callable
    ):
        self.engine, self.tokenizer, self.stop_ids = engine, tokenizer, set(engine.stop_ids)
        self.sampling, self.cfg = sampling, cfg
        self.name = agent if isinstance(agent, str) else getattr(agent, "__name__", type(agent).__name__)
        self.agent = load_agent(agent, cfg) if isinstance(agent, str) else agent
        self._owned = isinstance(agent, str) and isinstance(self.agent, RunAgent)
        """A RunAgent built here (from its name) is closed after generate(); one given is its giver's."""

    def generate(self, prompts: list[PromptRecord]) -> RolloutResult:
        """`sampling.n` agent runs per prompt, in prompt order then sample order, and what they did. Under
        --on-env-error zero, a sample whose agent made no request that generated (it never called, every request was
        refused, or it failed first) has no model token to train on: it is left out, counted in env/errors and
        env/dropped."""
        began = time.perf_counter()
        samples = [(p, i) for p in prompts for i in range(self.sampling.n)]
        worker = StreamWorker(self.engine, self.sampling, self.cfg.max_total_tokens, max(len(samples), 1))
        # the run's sampling governs every request; samples stay open until the rollout ends; agents may send back
        # the prompts' own image references (and data: URIs)
        endpoint = EndpointConfig(session_idle_s=0, max_sessions=0)
        known = {ref for p in prompts for ref in image_refs(p.prompt, p.id)}
        server = AgentServer(
            worker, self.tokenizer, self.stop_ids, self.sampling, self.cfg, endpoint=endpoint, strict=True,
            known_image_refs=known,
        ).start()  # fmt: skip
        pool = CallPool(self.cfg.env_workers, self.cfg.agent_timeout_s)
        try:
            calls = [(self._call(server, p, i), f"agent {self.name} for sample {p.id}/{i!s}") for p, i in samples]
            outcomes = pool.run(calls)
        finally:
            pool.close()
            server.close()
            worker.close()
            if self._owned:
                self.agent.close()
        records, errors, dropped = [], 0, []
        for (prompt, index), outcome in zip(samples, outcomes):
            session = server.sessions.get(f"{prompt.id}/{index}")
            if outcome.error and self.cfg.on_env_error == "raise":
                raise UserError(f"{outcome.error} (--on-env-error zero scores such samples 0 instead)")
            if session is None or not session.segments:  # nothing was generated for it
                dropped.append(self._no_trajectory(server, f"{prompt.id}/{index}", outcome.error))
                continue
            errors += outcome.error is not None
            with session.lock:  # a timed-out agent's last request may still be finishing
                records.append(self._record(prompt, index, session, outcome.value, outcome.error))
        report_dropped(dropped, len(samples))
        stats = _stats(records, errors + len(dropped), worker)
        stats.env_timeouts, stats.env_dropped = pool.num_timeouts, len(dropped)
        tokens = sum(sum(r.loss_mask) for r in records)
        return RolloutResult(records, RolloutStats(tokens, time.perf_counter() - began, episodes=stats))

    def _no_trajectory(self, server: AgentServer, sample_id: str, error: str | None) -> str:
        """Why sample `sample_id` has no trajectory (its agent's error, or what became of its requests); a
        UserError unless --on-env-error zero (or the agent failed, which 'raise' has reported already)."""
        num_calls = server.num_calls(sample_id)
        if num_calls == 0:
            why = "it never called its base_url"
        else:
            why = f"every one of its {num_calls} request(s) to its base_url was refused (see the agent's errors)"
        reason = f"agent {self.name} for sample {sample_id}: {why}"
        if error is None and self.cfg.on_env_error == "raise":
            raise UserError(reason + " (--on-env-error zero leaves such samples out instead)")
        return error or reason

    def _call(self, server: AgentServer, prompt: PromptRecord, index: int) -> Callable[[], float]:
        base_url = server.base_url(f"{prompt.id}/{index}")

        def run() -> float:
            reward = self.agent(prompt.to_json(), base_url)
            if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
                raise EnvError(
                    f"agent {self.name} for sample {prompt.id}/{index} returned {reward!r}, expected a finite number"
                )
            return float(reward)

        return run

    def _record(
        self, prompt: PromptRecord, index: int, session: SampleSession, reward: float | None, error: str | None
    ) -> RolloutRecord:
        last = session.segments[-1]
        finish = "env_done" if error else "length" if session.hit_token_limit else last.finish_reason
        extra: dict = {"num_segments": len(session.segments), "segment_reason": last.reason}
        if len(session.segments) > 1:
            extra["segments"] = [s.to_json() for s in session.segments[:-1]]
        if error:
            extra["env_error"] = error
        if session.client_session_ids:  # the client's own names for its conversation (e.g. a verifiers trace id)
            extra["client_session_ids"] = list(session.client_session_ids)
        return trajectory_record(
            prompt,
            index,
            last.trajectory,
            finish_reason=finish,
            response=last.last_turn_text,
            temperature=self.sampling.temperature,
            env_reward=0.0 if error else reward,
            extra=extra,
            image_refs=last.image_refs,
            tools=last.tools,
            tokenizer=self.tokenizer,
        )


def _stats(records: list[RolloutRecord], errors: int, worker: StreamWorker) -> EpisodeStats:
    count = max(len(records), 1)
    return EpisodeStats(
        turns_mean=sum(r.num_turns for r in records) / count,
        segments_mean=sum(r.extra["num_segments"] for r in records) / count,
        env_reward_mean=sum(r.env_reward for r in records) / count,
        env_errors=errors,
        serve_engine_steps=worker.num_steps,
        serve_largest_batch=worker.largest_batch,
    )
