"""What the episodes of a multi-turn rollout did (environment episodes or served agent runs), as typed fields.

A field left None is a metric the runner does not have (an agent has no render time, an environment no
segments); `metrics()` names each of the others as in metrics.jsonl. Each field says how several processes'
values combine (`merge`): counts add up, timings take the slowest process, means are weighted by each process's
number of samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

_SUM, _MAX, _MEAN = "sum", "max", "mean"


def _metric(name: str, merge: str):
    return field(default=None, metadata={"metric": name, "merge": merge})


@dataclass
class EpisodeStats:
    """The multi-turn metrics of one rollout call (one process's, or merged over processes)."""

    turns_mean: float | None = _metric("rollout/turns_mean", _MEAN)
    """Model turns per sample."""
    segments_mean: float | None = _metric("rollout/segments_mean", _MEAN)
    """Agents: trajectory segments per sample (the agent rewrote its history between them)."""
    inserted_tokens: int | None = _metric("rollout/inserted_tokens", _SUM)
    """Environments: tokens the environments' replies inserted (not trained on)."""
    env_reward_mean: float | None = _metric("env/reward_mean", _MEAN)
    """The environments' (or agents') reward per sample."""
    env_errors: int | None = _metric("env/errors", _SUM)
    """Samples whose environment or agent failed (under --on-env-error zero), dropped ones included."""
    env_timeouts: int | None = _metric("env/timeouts", _SUM)
    """Environment or agent calls abandoned after their timeout."""
    env_dropped: int | None = _metric("env/dropped", _SUM)
    """Samples left out: they failed before the model generated anything."""
    finish_stop: int | None = _metric("rollout/finish_stop", _SUM)
    """Environments: samples whose last turn ended with no reply from the environment."""
    finish_length: int | None = _metric("rollout/finish_length", _SUM)
    """Environments: samples cut by a token limit."""
    finish_max_turns: int | None = _metric("rollout/finish_max_turns", _SUM)
    """Environments: samples that reached max_turns."""
    finish_env_done: int | None = _metric("rollout/finish_env_done", _SUM)
    """Environments: samples the environment ended (or that failed)."""
    engine_s: float | None = _metric("timing/engine_s", _MAX)
    """Environments: seconds inside engine steps."""
    env_s: float | None = _metric("timing/env_s", _MAX)
    """Environments: seconds summed over environment calls (they overlap generation and each other)."""
    env_wait_s: float | None = _metric("timing/env_wait_s", _MAX)
    """Environments: seconds blocked on environments with nothing to generate."""
    render_s: float | None = _metric("timing/render_s", _MAX)
    """Environments: seconds building turns' tokens from the chat template (and loading images)."""
    env_wait_share: float | None = _metric("perf/env_wait_share", _MEAN)
    """Environments: env_wait_s as a share of the rollout's time."""
    preemptions: int | None = _metric("rollout/preemptions", _SUM)
    """Sequences evicted from the KV cache and recomputed (engines that preempt)."""
    steps_ahead: int | None = _metric("rollout/steps_ahead", _SUM)
    """Decode steps queued before the previous one's tokens were read (engines that overlap host and device)."""
    prefill_tokens: int | None = _metric("rollout/prefill_tokens", _SUM)
    """Prompt tokens prefilled (engines that count them)."""
    cached_prefix_tokens: int | None = _metric("rollout/cached_prefix_tokens", _SUM)
    """Prompt tokens found in the prefix cache (engines that count them)."""
    serve_engine_steps: int | None = _metric("serve/engine_steps", _MEAN)
    """Agents: engine steps the in-process server ran."""
    serve_largest_batch: int | None = _metric("serve/largest_batch", _MEAN)
    """Agents: the most requests the server batched in one step."""

    def metrics(self) -> dict[str, float]:
        """The metrics-line entries (the fields that are set), by name."""
        values = {f.metadata["metric"]: getattr(self, f.name) for f in fields(self)}
        return {name: float(v) for name, v in sorted(values.items()) if v is not None}

    def set_engine_counters(self, counters: dict[str, int]) -> None:
        """Take a token stream's counters (`TokenStream.stats()`: preemptions, steps_ahead, ...)."""
        for name in ("preemptions", "steps_ahead", "prefill_tokens", "cached_prefix_tokens"):
            if name in counters:
                setattr(self, name, counters[name])

    def __add__(self, other: EpisodeStats) -> EpisodeStats:
        """Two calls together (the batches of one dynamic-sampling step): timings add up, other metrics are the
        later call's (where it has them)."""
        out = replace(self)
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if theirs is None:
                continue
            both = mine is not None and f.metadata["merge"] == _MAX
            setattr(out, f.name, mine + theirs if both else theirs)
        return out

    @staticmethod
    def merge(parts: list[tuple[int, EpisodeStats]]) -> EpisodeStats:
        """One process's stats from several processes' (number of samples, stats); one process's as they are."""
        if len(parts) == 1:
            return replace(parts[0][1])
        total = max(sum(n for n, _ in parts), 1)
        out = EpisodeStats()
        for f in fields(EpisodeStats):
            values = [(n, getattr(s, f.name)) for n, s in parts if getattr(s, f.name) is not None]
            if not values:
                continue
            rule = f.metadata["merge"]
            if rule == _SUM:
                merged = sum(v for _, v in values)
            elif rule == _MAX:
                merged = max(v for _, v in values)
            else:
                merged = sum(n * v for n, v in values) / total
            setattr(out, f.name, merged)
        return out
