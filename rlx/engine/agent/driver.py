"""Multi-turn rollouts with Python environments over the token-level engine call.

Every active episode of the batch generates its next turn in one `generate_tokens` call; the
environment steps of the turn then run concurrently in threads (with a timeout); episodes that end
leave the batch. Each turn draws from its own random stream keyed `<sample_id>/<turn>`, so a sample's
tokens do not depend on which other samples share its batch.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

from rlx.engine.agent.config import AgentConfig
from rlx.engine.agent.environment import CallPool, Environment, EnvironmentFactory
from rlx.engine.agent.protocol import Generated, TokenEngine, TokenRequest
from rlx.engine.agent.records import FINISH_REASONS, trajectory_record
from rlx.engine.agent.tool_calls import ParsedTurn, get_tool_call_parser, tool_error_messages
from rlx.engine.agent.trajectory import ChatRenderer, Trajectory
from rlx.engine.records import PromptRecord, RolloutRecord
from rlx.engine.rollout.config import RolloutConfig
from rlx.errors import UserError


@dataclass
class Episode:
    """One sample's episode in progress."""

    prompt: PromptRecord
    sample_index: int
    env: Environment | None = None
    renderer: ChatRenderer | None = None
    trajectory: Trajectory | None = None
    env_reward: float = 0.0
    finish_reason: str | None = None
    env_error: str | None = None
    last_turn_ids: list[int] = field(default_factory=list)
    last_turn_text: str = ""

    @property
    def sample_id(self) -> str:
        return f"{self.prompt.id}/{self.sample_index}"


class EnvRollout:
    """Runs episodes of a Python environment for prompts and returns their rollout records."""

    def __init__(
        self,
        engine: TokenEngine,
        tokenizer,
        stop_ids: set[int],
        sampling: RolloutConfig,
        cfg: AgentConfig,
        envs: EnvironmentFactory | None = None,
    ):
        if not cfg.env and envs is None:
            raise UserError("multi-turn rollouts need an environment (--env path/file.py:NAME or module:NAME)")
        self.engine, self.tokenizer, self.stop_ids = engine, tokenizer, set(stop_ids)
        self.sampling, self.cfg = sampling, cfg
        self.envs = envs or EnvironmentFactory(cfg.env)
        self.parse = get_tool_call_parser(cfg.tool_parser)
        self.last_stats: dict[str, float] = {}
        self._seconds = {"generate": 0.0, "env": 0.0, "render": 0.0}

    def generate(self, prompts: list[PromptRecord]) -> list[RolloutRecord]:
        """`sampling.n` episodes per prompt, in prompt order then sample order."""
        episodes = [Episode(p, i) for p in prompts for i in range(self.sampling.n)]
        self._seconds = {"generate": 0.0, "env": 0.0, "render": 0.0}
        pool = CallPool(self.cfg.env_workers, self.cfg.env_timeout_s)
        try:
            self._start(episodes, pool)
            while active := [ep for ep in episodes if ep.finish_reason is None]:
                to_step = self._generate_turn(active)
                self._step(to_step, pool)
        finally:
            pool.close()
        self.last_stats = self._stats(episodes)
        return [self._record(ep) for ep in episodes]

    def _start(self, episodes: list[Episode], pool: CallPool) -> None:
        """Make every sample's environment and reset it (concurrently); render the opening prompts."""

        def start(ep: Episode):
            env = self.envs.make(ep.sample_id, ep.prompt.to_json())
            return env, *env.reset()

        began = time.perf_counter()
        where = f"environment {self.envs.spec} for sample"
        calls = [(lambda ep=ep: start(ep), f"{where} {ep.sample_id!r}") for ep in episodes]
        outcomes = pool.run(calls)
        self._seconds["env"] += time.perf_counter() - began
        for ep, outcome in zip(episodes, outcomes):
            if outcome.error:  # no opening messages: nothing to score, whatever on_env_error says
                raise UserError(outcome.error)
            ep.env, messages, tools = outcome.value
            began = time.perf_counter()
            ep.renderer = ChatRenderer(self.tokenizer, self.stop_ids, tools, self.cfg.chat_template_kwargs)
            ep.trajectory = Trajectory(ep.renderer.opening_ids(messages), copy.deepcopy(messages))
            self._seconds["render"] += time.perf_counter() - began
            if ep.trajectory.num_tokens >= self.cfg.max_total_tokens:
                raise UserError(
                    f"sample {ep.sample_id!r}: the opening prompt has {ep.trajectory.num_tokens} tokens, "
                    f"not below max_total_tokens = {self.cfg.max_total_tokens}"
                )

    def _generate_turn(self, active: list[Episode]) -> list[Episode]:
        """One model turn for every active episode; returns those whose environment steps next."""
        requests = [
            TokenRequest(
                key=f"{ep.sample_id}/{ep.trajectory.num_turns}",
                prompt_ids=ep.trajectory.token_ids(),
                max_new_tokens=min(self.sampling.max_new_tokens, self.cfg.max_total_tokens - ep.trajectory.num_tokens),
                greedy=self.sampling.temperature == 0,
            )
            for ep in active
        ]
        began = time.perf_counter()
        generated = self.engine.generate_tokens(requests, self.sampling)
        self._seconds["generate"] += time.perf_counter() - began
        to_step = []
        for ep, gen in zip(active, generated):
            parsed = self._add_turn(ep, gen)
            if gen.finish_reason != "stop":  # cut by a token limit: the turn has no end to reply to
                ep.finish_reason = "length"
            elif parsed.errors:  # malformed tool calls: the model hears why; the environment is not stepped
                self._continue(ep, tool_error_messages(parsed.errors), done=False)
            else:
                to_step.append(ep)
        return to_step

    def _add_turn(self, ep: Episode, gen: Generated) -> ParsedTurn:
        ep.trajectory.add_model_turn(gen.response_ids, gen.logprobs)
        ep.last_turn_ids = gen.response_ids
        ep.last_turn_text = self.tokenizer.decode(gen.response_ids, skip_special_tokens=True)
        parsed = self.parse(ep.last_turn_text, ep.trajectory.num_turns - 1)
        ep.trajectory.messages.append(parsed.message)
        return parsed

    def _step(self, episodes: list[Episode], pool: CallPool) -> None:
        """Step the environments of `episodes` with their last assistant message, concurrently."""
        if not episodes:
            return
        calls = [
            (lambda ep=ep: ep.env.step(copy.deepcopy(ep.trajectory.messages[-1])), ep.env.where("step()"))
            for ep in episodes
        ]
        began = time.perf_counter()
        outcomes = pool.run(calls)
        self._seconds["env"] += time.perf_counter() - began
        for ep, outcome in zip(episodes, outcomes):
            if outcome.error:
                self._fail(ep, outcome.error)
                continue
            replies, reward, done = outcome.value
            ep.env_reward += reward
            self._continue(ep, replies, done)

    def _fail(self, ep: Episode, error: str) -> None:
        if self.cfg.on_env_error == "raise":
            raise UserError(f"{error} (--on-env-error zero scores such episodes 0 instead)")
        ep.env_error, ep.env_reward, ep.finish_reason = error, 0.0, "env_done"

    def _continue(self, ep: Episode, replies: list[dict], done: bool) -> None:
        """Append the environment's reply, or end the episode. A reply that ends the episode is kept in
        `messages` only: no model turn follows it, so its tokens would train nothing."""
        traj = ep.trajectory
        if done or traj.num_turns >= self.cfg.max_turns or not replies:
            traj.messages += copy.deepcopy(replies)
            ep.finish_reason = "env_done" if done else "max_turns" if replies else "stop"
            return
        began = time.perf_counter()
        ids = ep.renderer.turn_end_ids(ep.last_turn_ids) + ep.renderer.message_ids(replies)
        self._seconds["render"] += time.perf_counter() - began
        traj.messages += copy.deepcopy(replies)
        if traj.num_tokens + len(ids) >= self.cfg.max_total_tokens:  # no room left for a model token
            ep.finish_reason = "length"
            return
        traj.add_inserted(ids)

    def _record(self, ep: Episode) -> RolloutRecord:
        return trajectory_record(
            ep.prompt,
            ep.sample_index,
            ep.trajectory,
            finish_reason=ep.finish_reason,
            response=ep.last_turn_text,
            temperature=self.sampling.temperature,
            env_reward=ep.env_reward,
            extra={"env_error": ep.env_error} if ep.env_error else None,
        )

    def _stats(self, episodes: list[Episode]) -> dict[str, float]:
        model_tokens = sum(sum(ep.trajectory.loss_mask) for ep in episodes)
        inserted = sum(len(ep.trajectory.loss_mask) for ep in episodes) - model_tokens
        count = max(len(episodes), 1)
        stats = {
            "rollout/tokens": float(model_tokens),
            "rollout/inserted_tokens": float(inserted),
            "rollout/turns_mean": sum(ep.trajectory.num_turns for ep in episodes) / count,
            "env/reward_mean": sum(ep.env_reward for ep in episodes) / count,
            "env/errors": float(sum(ep.env_error is not None for ep in episodes)),
            "timing/generate_s": self._seconds["generate"],
            "timing/env_s": self._seconds["env"],
            "timing/render_s": self._seconds["render"],
            "perf/rollout_tokens_per_s": model_tokens / max(self._seconds["generate"], 1e-9),
        }
        for reason in FINISH_REASONS:
            stats[f"rollout/finish_{reason}"] = float(sum(ep.finish_reason == reason for ep in episodes))
        return stats
