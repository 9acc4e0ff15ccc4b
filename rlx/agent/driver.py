"""Multi-turn rollouts with Python environments over the engine's token-level stream.

Every episode's turn is a token request on one stream of the rollout engine (`RolloutEngine.open_stream`):
when a turn finishes, its environment step runs in a thread (with a timeout) while the engine keeps
generating the other episodes' turns, and the episode's next turn joins the stream once the environment has
answered. So one slow environment never stalls the batch. Each turn draws from its own random stream keyed
`<sample_id>/<turn>`, so a sample's tokens do not depend on which other samples run with it, on the engine
(hf and native draw alike), or on when its environment answered.

Timings (seconds, this process): `timing/generate_s` the whole rollout, `timing/engine_s` inside engine steps,
`timing/env_wait_s` blocked on environments with nothing to generate (the engine idles; `perf/env_wait_share`
of the whole), `timing/env_s` summed over environment calls (they overlap generation and each other),
`timing/render_s` building turns' tokens from the chat template (and loading the images of a vision-language
model's messages: images.py).
"""

from __future__ import annotations

import copy
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial

from rlx.agent.environment import CallPool, Environment, EnvironmentFactory, Outcome, report_dropped
from rlx.chat.images import EpisodeImages, ImageCache, why_no_images
from rlx.chat.records import FINISH_REASONS, trajectory_record
from rlx.chat.tool_calls import ParsedTurn, get_tool_call_parser, tool_error_messages
from rlx.chat.trajectory import ChatRenderer, Trajectory
from rlx.errors import UserError
from rlx.formats.records import PromptRecord, RolloutRecord
from rlx.models.vision.images import ImageError
from rlx.rollout.agent_config import AgentConfig
from rlx.rollout.base import RolloutEngine, RolloutResult, RolloutStats, TokenStream
from rlx.rollout.config import SamplingParams
from rlx.rollout.requests import Generated, TokenRequest, cut_response
from rlx.rollout.stats import EpisodeStats
from rlx.rollout.stops import StopStrings

LOCKSTEP_POLL_S = 0.01
"""Engines that step in lockstep over processes go back to the collective this often while waiting."""


@dataclass(eq=False)
class Episode:
    """One sample's episode in progress."""

    prompt: PromptRecord
    sample_index: int
    env: Environment | None = None
    renderer: ChatRenderer | None = None
    trajectory: Trajectory | None = None
    images: EpisodeImages | None = None
    env_reward: float = 0.0
    finish_reason: str | None = None
    env_error: str | None = None
    last_turn_ids: list[int] = field(default_factory=list)
    last_turn_text: str = ""
    tools: list[dict] | None = None
    """The tools the environment offered (its `tools` after reset())."""

    @property
    def sample_id(self) -> str:
        return f"{self.prompt.id}/{self.sample_index}"


class EnvRollout:
    """Runs episodes of a Python environment for prompts and returns their rollout records."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer,
        sampling: SamplingParams,
        cfg: AgentConfig,
        envs: EnvironmentFactory | None = None,
    ):
        if not cfg.env and envs is None:
            raise UserError("multi-turn rollouts need an environment (--env path/file.py:NAME or module:NAME)")
        self.engine, self.tokenizer, self.stop_ids = engine, tokenizer, set(engine.stop_ids)
        self.sampling, self.cfg = sampling, cfg
        self.envs = envs or EnvironmentFactory(cfg.env)
        self.parse = get_tool_call_parser(cfg.tool_parser)
        self.stops = StopStrings(tokenizer, sampling.stop) if sampling.stop else None
        self._seconds: dict[str, float] = {}
        self._images: ImageCache | None = None

    def generate(self, prompts: list[PromptRecord]) -> RolloutResult:
        """`sampling.n` episodes per prompt, in prompt order then sample order (this process's prompts), and what
        they did."""
        return self.run_episodes([Episode(p, i) for p in prompts for i in range(self.sampling.n)])

    def run_episodes(self, episodes: list[Episode]) -> RolloutResult:
        self._seconds = {"generate": 0.0, "env": 0.0, "env_wait": 0.0, "render": 0.0, "total": 0.0}
        began = time.perf_counter()
        pool = CallPool(self.cfg.env_workers, self.cfg.env_timeout_s)
        processor = self.engine.encoder.processor
        self._images = ImageCache(processor) if processor is not None else None
        stream = self.engine.open_stream(self.sampling, self.cfg.max_total_tokens, max(len(episodes), 1))
        try:
            self._start(episodes, pool)
            for ep in episodes:
                if ep.trajectory is not None:
                    self._submit_turn(stream, ep)
            self._loop(stream, pool, episodes)
        finally:
            stream.close()
            pool.close()
            self._images = None
        self._seconds["total"] = time.perf_counter() - began
        kept = [ep for ep in episodes if ep.trajectory is not None]  # the others' environments failed to start
        report_dropped([ep.env_error for ep in episodes if ep.trajectory is None], len(episodes))
        stats = self._stats(kept, stream.stats())
        num_dropped = len(episodes) - len(kept)
        stats.episodes.env_timeouts, stats.episodes.env_dropped = pool.num_timeouts, num_dropped
        stats.episodes.env_errors += num_dropped
        return RolloutResult([self._record(ep) for ep in kept], stats)

    def _loop(self, stream: TokenStream, pool: CallPool, episodes: list[Episode]) -> None:
        """Step the engine; hand finished turns to their environments; submit the turns of answered episodes.
        With nothing to generate, wait for an environment (briefly, where the engine steps in lockstep)."""
        stepping: dict[Future, Episode] = {}
        while stream.keep_going(any(ep.finish_reason is None for ep in episodes)):
            began = time.perf_counter()
            finished = stream.step()
            self._seconds["generate"] += time.perf_counter() - began
            for ep, generated in finished:
                self._after_turn(stream, pool, stepping, ep, generated)
            if not stepping:
                continue
            idle = not stream.has_work
            timeout = (LOCKSTEP_POLL_S if stream.lockstep else None) if idle else 0.0
            began = time.perf_counter()
            answered = pool.finished(set(stepping), timeout)
            if idle:
                self._seconds["env_wait"] += time.perf_counter() - began
            for future, outcome in answered:
                self._after_step(stream, stepping.pop(future), outcome)

    def _start(self, episodes: list[Episode], pool: CallPool) -> None:
        """Make every sample's environment and reset it (concurrently); render the opening prompts."""

        def start(ep: Episode):
            env = self.envs.make(ep.sample_id, ep.prompt.to_json())
            return env, *env.reset()

        where = f"environment {self.envs.spec} for sample"
        outcomes = pool.run([(lambda ep=ep: start(ep), f"{where} {ep.sample_id!r}: reset()") for ep in episodes])
        for ep, outcome in zip(episodes, outcomes):
            self._seconds["env"] += outcome.seconds
            if outcome.error:  # no opening messages, no model turn: under 'zero' the sample is left out (dropped)
                if self.cfg.on_env_error == "raise":
                    raise UserError(f"{outcome.error} (--on-env-error zero leaves such samples out instead)")
                ep.env_error, ep.finish_reason = outcome.error, "env_done"
                continue
            ep.env, messages, tools = outcome.value
            ep.tools = tools
            began = time.perf_counter()
            ep.renderer = ChatRenderer(self.tokenizer, self.stop_ids, tools, self.cfg.chat_template_kwargs)
            ep.images = self._episode_images(ep)
            render_ids = partial(ep.renderer.opening_ids, messages)
            opening = ep.images.render(messages, "the environment's reset()", render_ids)
            ep.images.add(opening, 0)
            ep.trajectory = Trajectory(opening.ids, copy.deepcopy(messages))
            self._seconds["render"] += time.perf_counter() - began
            if ep.trajectory.num_tokens >= self.cfg.max_total_tokens:
                raise UserError(
                    f"sample {ep.sample_id!r}: the opening prompt has {ep.trajectory.num_tokens} tokens, "
                    f"not below max_total_tokens = {self.cfg.max_total_tokens}"
                )

    def _submit_turn(self, stream: TokenStream, ep: Episode) -> None:
        traj = ep.trajectory
        room = self.cfg.max_total_tokens - traj.num_tokens
        request = TokenRequest(
            key=f"{ep.sample_id}/{traj.num_turns}",
            prompt_ids=traj.token_ids(),
            max_new_tokens=min(self.sampling.max_new_tokens, room),
            greedy=self.sampling.is_greedy,
            vision=ep.images.vision(),
            num_prompt_routes=traj.num_pending_inserted,  # their routing, as the engine reads them (MoE replay)
        )
        stream.submit(ep, request)

    def _episode_images(self, ep: Episode) -> EpisodeImages:
        engine = self.engine
        return EpisodeImages(ep.sample_id, self._images, engine.name, engine.takes_images, why_no_images(engine))

    def _after_turn(
        self, stream: TokenStream, pool: CallPool, stepping: dict[Future, Episode], ep: Episode, gen: Generated
    ) -> None:
        """A model turn came back: end the episode, answer malformed tool calls, or step the environment."""
        parsed = self._add_turn(ep, gen)
        if gen.finish_reason != "stop":  # cut by a token limit: the turn has no end to reply to
            ep.finish_reason = "length"
        elif parsed.errors:  # malformed tool calls: the model hears why; the environment is not stepped
            self._continue(stream, ep, tool_error_messages(parsed.errors), done=False)
        else:
            message = copy.deepcopy(ep.trajectory.messages[-1])
            stepping[pool.start(lambda: ep.env.step(message), ep.env.where("step()"))] = ep

    def _add_turn(self, ep: Episode, gen: Generated) -> ParsedTurn:
        ep.trajectory.add_model_turn(gen.response_ids, gen.logprobs, gen.routed_experts, gen.prompt_routed_experts)
        ep.last_turn_ids = gen.response_ids
        text = self.tokenizer.decode(gen.response_ids, skip_special_tokens=True)
        if self.stops is not None and gen.finish_reason == "stop":  # the message ends before its stop string
            text = cut_response(text, self.stops.first(text))
        ep.last_turn_text = text
        parsed = self.parse(ep.last_turn_text, ep.trajectory.num_turns - 1)
        ep.trajectory.messages.append(parsed.message)
        return parsed

    def _after_step(self, stream: TokenStream, ep: Episode, outcome: Outcome) -> None:
        self._seconds["env"] += outcome.seconds
        if outcome.error:
            self._env_failed(ep, outcome.error)
            return
        replies, reward, done = outcome.value
        ep.env_reward += reward
        self._continue(stream, ep, replies, done)

    def _env_failed(self, ep: Episode, error: str, replies: list[dict] | None = None) -> None:
        """The environment failed `ep` (`error` names it): the rollout stops, or under --on-env-error zero the
        episode ends with reward 0 (`replies`, the reply that failed, are kept in its messages)."""
        if self.cfg.on_env_error == "raise":
            raise UserError(f"{error} (--on-env-error zero scores such episodes 0 instead)")
        ep.env_error, ep.env_reward, ep.finish_reason = error, 0.0, "env_done"
        ep.trajectory.messages += copy.deepcopy(replies or [])

    def _continue(self, stream: TokenStream, ep: Episode, replies: list[dict], done: bool) -> None:
        """Append the environment's reply and submit the next turn, or end the episode. A reply that ends the
        episode is kept in `messages` only: no model turn follows it, so its tokens would train nothing."""
        traj = ep.trajectory
        if done or traj.num_turns >= self.cfg.max_turns or not replies:
            traj.messages += copy.deepcopy(replies)
            ep.finish_reason = "env_done" if done else "max_turns" if replies else "stop"
            return
        began = time.perf_counter()
        closing = ep.renderer.turn_end_ids(ep.last_turn_ids)
        try:
            rendered = ep.images.render(replies, "the environment's step()", partial(ep.renderer.message_ids, replies))
        except ImageError as e:  # the environment's fault, as a reply of the wrong types is
            self._env_failed(ep, f"{ep.env.where('step()')} returned an image that cannot be used: {e}", replies)
            return
        finally:
            self._seconds["render"] += time.perf_counter() - began
        traj.messages += copy.deepcopy(replies)
        if traj.num_tokens + len(closing) + len(rendered.ids) >= self.cfg.max_total_tokens:  # no room for a model token
            ep.finish_reason = "length"  # images included: their tokens count as any other
            return
        ep.images.add(rendered, traj.num_tokens + len(closing))
        traj.add_inserted(closing + rendered.ids)
        self._submit_turn(stream, ep)

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
            image_refs=ep.images.refs or None,
            tools=ep.tools,
            tokenizer=self.tokenizer,
        )

    def _stats(self, episodes: list[Episode], engine_stats: dict[str, int]) -> RolloutStats:
        model_tokens = sum(sum(ep.trajectory.loss_mask) for ep in episodes)
        inserted = sum(len(ep.trajectory.loss_mask) for ep in episodes) - model_tokens
        count, seconds = max(len(episodes), 1), self._seconds
        finished = {reason: sum(ep.finish_reason == reason for ep in episodes) for reason in FINISH_REASONS}
        stats = EpisodeStats(
            inserted_tokens=inserted,
            turns_mean=sum(ep.trajectory.num_turns for ep in episodes) / count,
            env_reward_mean=sum(ep.env_reward for ep in episodes) / count,
            env_errors=sum(ep.env_error is not None for ep in episodes),
            engine_s=seconds["generate"],
            env_s=seconds["env"],
            env_wait_s=seconds["env_wait"],
            render_s=seconds["render"],
            env_wait_share=seconds["env_wait"] / max(seconds["total"], 1e-9),
            **{f"finish_{reason}": n for reason, n in finished.items()},
        )
        stats.set_engine_counters(engine_stats)
        return RolloutStats(model_tokens, seconds["total"], episodes=stats)
