"""The rollout-engine interface: settings at construction, sampling settings per call, a typed result.

    engine = build_engine(rollout_cfg, model, tokenizer, ctx)      # RolloutConfig: the engine's settings
    engine = build_engine(rollout_cfg, vlm, tokenizer, ctx, processor)   # a vision-language model's images
    result = engine.generate(prompts, sampling)                     # SamplingParams: this call's draws
    result.records, result.stats                                    # RolloutRecord list + RolloutStats
    engine.sleep(); ...train...; engine.wake(); engine.update_weights(trainer)

`generate` is the one outline every engine shares: encode the prompts into requests (N per prompt, plus
ReMax's greedy one), give this process its share, let the engine generate token ids for it
(`generate_local`), gather every process's results back in request order, and turn them into records.

The token-level call (multi-turn episodes, served agents) comes in two forms, over this process's requests:

    generated = engine.generate_tokens(token_requests, sampling)         # a batch, in order
    stream = engine.open_stream(sampling, max_context, num_seqs)          # the interleaving form:
    stream.submit(tag, token_request)                                     #   requests join at any time
    while stream.keep_going(busy): finished = stream.step()              #   results as they finish

Each request draws from the random stream keyed by `TokenRequest.key`, so its tokens do not depend on what
else runs with it; a prompt request's key is its sample id, so `generate_local` is the token-level call over
the prompt requests (engines implement `open_stream`, and may replace `generate_local`). Engines differ in how
they decode and in how they take new weights.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from tqdm import tqdm

from rlx.errors import UserError
from rlx.formats.records import PromptRecord, RolloutRecord
from rlx.logprobs import sequence_logprobs
from rlx.models.fingerprint import tokenizer_fingerprint
from rlx.models.lora import is_lora_model
from rlx.models.lora_merge import iter_merged_weights
from rlx.models.lora_state import adapter_state
from rlx.parallel.dist import TensorParallelGroup, all_gather_objects, all_reduce, shard_range
from rlx.parallel.fsdp import gathered_weights
from rlx.rollout.config import RolloutConfig, SamplingParams
from rlx.rollout.lengths import limit_reason, model_context
from rlx.rollout.prompts import PromptEncoder, context_limit, stop_token_ids
from rlx.rollout.requests import (
    Generated,
    PromptLogprobs,
    Request,
    TokenRequest,
    build_requests,
    response_text,
    to_record,
    token_requests,
)
from rlx.rollout.stats import EpisodeStats
from rlx.rollout.stops import StopStrings
from rlx.utils.device import resolve_precision


@dataclass
class RolloutStats:
    """What one `generate` call did (over every process)."""

    tokens: int
    """Response tokens generated."""
    seconds: float
    """Wall time of the call."""
    preemptions: int | None = None
    """Sequences evicted from the KV cache and recomputed (engines that preempt; this process's count)."""
    steps_ahead: int | None = None
    """Decode steps queued before the previous one's tokens were read (engines that overlap host and device)."""
    episodes: EpisodeStats | None = None
    """Multi-turn rollouts: what the episodes did (turns, environment reward and time, ...)."""
    local_seconds: float | None = None
    """Under a launcher: this process's own share (generation, a replica's fill included), before the gather."""
    gather_seconds: float | None = None
    """Under a launcher: the gather of every process's samples, the wait for the slowest process included."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    def metrics(self) -> dict[str, float]:
        """The metrics-line entries of the call."""
        out = {
            "rollout/tokens": float(self.tokens),
            "timing/generate_s": self.seconds,
            "perf/rollout_tokens_per_s": self.tokens_per_s,
        }
        if self.preemptions is not None:
            out["rollout/preemptions"] = float(self.preemptions)
        if self.steps_ahead is not None:
            out["rollout/steps_ahead"] = float(self.steps_ahead)
        if self.local_seconds is not None:
            out["timing/generate_local_s"] = self.local_seconds
        if self.gather_seconds is not None:
            out["timing/generate_gather_s"] = self.gather_seconds
        return {**(self.episodes.metrics() if self.episodes is not None else {}), **out}

    def __add__(self, other: RolloutStats) -> RolloutStats:
        """Two calls together (e.g. the batches of one dynamic-sampling step); episode timings add up, other episode
        metrics are the later call's."""

        def add(a, b):
            return None if a is None and b is None else (a or 0) + (b or 0)

        episodes = self.episodes if other.episodes is None else other.episodes
        if self.episodes is not None and other.episodes is not None:
            episodes = self.episodes + other.episodes
        return RolloutStats(
            self.tokens + other.tokens,
            self.seconds + other.seconds,
            add(self.preemptions, other.preemptions),
            add(self.steps_ahead, other.steps_ahead),
            episodes,
            add(self.local_seconds, other.local_seconds),
            add(self.gather_seconds, other.gather_seconds),
        )


@dataclass
class RolloutResult:
    """The records of a `generate` call, in prompt order then sample order, and its statistics."""

    records: list[RolloutRecord]
    stats: RolloutStats


@dataclass
class LocalGeneration:
    """What `generate_local` returns: one Generated per request of this process's share, in order."""

    generated: list[Generated]
    preemptions: int | None = None
    steps_ahead: int | None = None


class TokenStream(ABC):
    """The interleaving form of the token-level call, for one sampling setting (one `open_stream`).

    Requests are submitted with a tag at any time (between steps); `step` advances the engine a little (one
    model step, or one batch) and returns the (tag, Generated) pairs that finished. A caller whose requests wait
    on something else (an environment) keeps stepping the others meanwhile. Where the engine decodes in
    lockstep over processes (a sharded model's forward is a collective), `keep_going` and `step` are collectives:
    every process calls them the same number of times, and `keep_going` is true while any process is busy."""

    lockstep: bool = False

    def __init__(self, sampling: SamplingParams, device: torch.device | None = None):
        self.sampling, self.device = sampling, device

    def check(self, request: TokenRequest) -> None:
        """Requests must ask for 1 to sampling.max_new_tokens tokens (the draws are made that wide)."""
        if not 1 <= request.max_new_tokens <= self.sampling.max_new_tokens:
            raise ValueError(
                f"token request {request.key!r}: max_new_tokens {request.max_new_tokens} is not in "
                f"[1, {self.sampling.max_new_tokens}]"
            )

    @abstractmethod
    def submit(self, tag: Any, request: TokenRequest) -> None:
        """Queue `request`; its result comes back from a later `step` with `tag`."""

    @abstractmethod
    def step(self) -> list[tuple[Any, Generated]]:
        """Advance the engine; the requests that finished, with their tags."""

    @property
    @abstractmethod
    def has_work(self) -> bool:
        """Whether requests of this process are queued or being generated."""

    def keep_going(self, busy: bool) -> bool:
        """Whether to step again: `busy` (this process has work or will submit more), over every process in
        lockstep engines."""
        if self.lockstep:
            return bool(all_reduce(float(busy), "max", device=self.device))
        return busy

    def stats(self) -> dict[str, int]:
        """Engine counters of the stream: 'preemptions', 'steps_ahead' (where the engine has them)."""
        return {}

    def progress(self) -> dict[Any, int]:
        """Tokens generated so far by each submitted request that has not finished, by tag (those counted in a
        model step already launched included); a request absent has none yet. The default suits streams that
        finish whole batches within one `step` (nothing is ever partly generated between steps)."""
        return {}

    def partial(self, tags: Collection[Any]) -> dict[Any, Generated]:
        """What each of `tags` (submitted requests that have not finished) sampled so far, read back to the host:
        its tokens, their logprobs and, where it asked, each position's alternatives (`finish_reason` ''), for
        callers that show a reply as it is generated (rlx serve's token streaming); a request absent has none yet.
        The default suits streams that finish whole batches within one `step`."""
        return {}

    def prompt_logprobs(self, request: TokenRequest, num_top: int) -> PromptLogprobs:
        """`request`'s prompt tokens scored by the model this stream generates with, teacher-forced (each token given
        the tokens before it, under the request's temperature as its sampled tokens' logprobs are), with the `num_top`
        most likely tokens at each position; called between steps (rlx serve's prompt_logprobs and echo). The
        default: an engine whose stream cannot (RolloutEngine.gives_prompt_logprobs false)."""
        raise UserError("this rollout engine does not compute the logprobs of a prompt's own tokens (hf and native do)")

    def weights_changed(self) -> None:
        """The engine's weights were updated while this stream is open (async.partial_rollouts = 'continue'):
        generate with the new ones from the next step on; keys and values computed with the old ones are not
        found again by later requests. The default: an engine generating with the updated module directly."""
        return None

    def close(self) -> None:
        """Release what the stream holds (its KV blocks); the engine keeps its caches for the next call."""
        return None


class WeightSource(Protocol):
    """Where new policy weights come from (a trainer, or a checkpoint folder)."""

    module: torch.nn.Module | None
    """The live policy module in this process, when there is one an engine may generate with directly."""

    def named_weights(self, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors with Hugging Face names (sharded ones gathered about `bucket_bytes` at a time: every
        process of the launch drains the iterator together); with LoRA adapters, the merged weights."""

    def adapter_state(self) -> dict[str, torch.Tensor] | None:
        """A LoRA policy's adapters by stable name (every process calls it together), for engines that apply them
        on the base they hold; None for a policy of full weights."""


class ModuleWeights:
    """A WeightSource over a module held in this process (plain, or FSDP-sharded: its shards are all-gathered a
    bucket at a time, so every rank must drain `named_weights` in step; a LoRA module's weights come merged)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def named_weights(self, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
        if is_lora_model(self.module):  # as state_dict names them, the adapters merged (one tensor gathered at a time)
            return iter_merged_weights(self.module, tied=True)
        return gathered_weights(self.module, bucket_bytes)

    def adapter_state(self) -> dict[str, torch.Tensor] | None:
        return adapter_state(self.module) if is_lora_model(self.module) else None


class RolloutEngine(ABC):
    """Samples responses with a causal LM held in this process; subclasses implement `generate_local`."""

    name: ClassVar[str]
    takes_images: ClassVar[bool] = False
    """Whether the engine generates from prompts with images (vision-language models)."""
    gives_top_logprobs: ClassVar[bool] = False
    """Whether the engine fills Generated.top_logprobs for token requests that ask (TokenRequest.num_top_logprobs)."""
    takes_constraints: ClassVar[bool] = False
    """Whether the engine samples a token request within its grammar (TokenRequest.constraint)."""
    gives_prompt_logprobs: ClassVar[bool] = False
    """Whether the engine's streams score a request's prompt tokens (TokenStream.prompt_logprobs)."""
    stream_group: TensorParallelGroup | None = None
    """The tensor-parallel group whose ranks hold one engine between them (vllm, native with tp_degree > 1): its first
    rank submits the requests of the group's streams, the others mirror them (mirror.py); None: each process runs its
    own stream."""

    def __init__(self, model, tokenizer, cfg: RolloutConfig, ctx, processor=None):
        """`processor`: a vision-language model's VisionProcessor (prompts with image parts need it)."""
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        self.device = ctx.device
        self.dtype = resolve_precision(cfg.precision, self.device)
        self.ctx = ctx if ctx.distributed and ctx.world > 1 else None  # one process: nothing to split or gather
        self.stop_ids = stop_token_ids(model, tokenizer)
        config = getattr(model, "config", None)  # None: an engine holding no HF model (vllm from a folder)
        limit = context_limit(config, cfg.vision.max_prompt_tokens) if processor is not None else 0
        self.encoder = PromptEncoder(
            tokenizer, cfg.chat_template, processor, config, limit, cfg.agent.chat_template_kwargs
        )

    @classmethod
    def model_dtype(cls, cfg: RolloutConfig, device: torch.device) -> torch.dtype:
        """The dtype a model this engine owns alone (`rlx rollout`) is best loaded in: float32 by default (the
        engine computes under autocast, as the trainer does)."""
        return torch.float32

    # --- the shared outline ----------------------------------------------------------------------

    def generate(self, prompts: list[PromptRecord], sampling: SamplingParams, progress: bool = True) -> RolloutResult:
        """N responses per prompt (in prompt order, then sample order), from every process's share."""
        requests = build_requests(prompts, self.encoder, sampling)
        self._check_images(requests)
        self.check_requests(requests, sampling)
        mine = self.local_share(len(requests))
        start = time.perf_counter()
        local = self.generate_local([requests[i] for i in mine], sampling, progress)
        finished = finish_generated(local.generated, self.tokenizer, sampling.stop)  # this share's texts, here
        local_end = time.perf_counter()
        results: list[tuple[Generated, str] | None] = [None] * len(requests)
        for indices, part in all_gather_objects((mine, finished)) if self.ctx else [(mine, finished)]:
            for i, item in zip(indices, part):
                results[i] = item
        end = time.perf_counter()
        stats = RolloutStats(
            sum(len(g.response_ids) for g, _ in results),
            end - start,
            local.preemptions,
            local.steps_ahead,
            local_seconds=local_end - start if self.ctx else None,
            gather_seconds=end - local_end if self.ctx else None,
        )
        fingerprint = tokenizer_fingerprint(self.tokenizer)
        records = [
            to_record(r, g, self.tokenizer, sampling.temperature, response=text, fingerprint=fingerprint)
            for r, (g, text) in zip(requests, results)
        ]
        return RolloutResult(records, stats)

    def local_share(self, count: int) -> list[int]:
        """The indices of the requests this process generates: a contiguous slice per rank."""
        return list(shard_range(count, self.ctx.rank, self.ctx.world) if self.ctx else range(count))

    def stream_share(self, count: int) -> range:
        """The items (prompts) whose episodes this process runs on its streams: a contiguous slice per process, or per
        tensor-parallel group, whose first rank runs them all (its other ranks none: their streams mirror it)."""
        group = self.stream_group
        if self.ctx is None:
            return range(count)
        if group is None or group.degree == 1:
            return shard_range(count, self.ctx.rank, self.ctx.world)
        return shard_range(count, group.index, group.count) if group.rank == 0 else range(0)

    def _check_images(self, requests: list[Request]) -> None:
        with_images = next((r for r in requests if r.vision is not None), None)
        if with_images is not None and not self.takes_images:
            raise UserError(
                f"prompt {with_images.prompt.id!r} has images, which engine {self.name!r} does not take "
                f"(use engine 'hf' or 'native')"
            )

    def check_requests(self, requests: list[Request], sampling: SamplingParams) -> None:
        """Raise a UserError for requests this engine cannot serve (before any generation): by default, a prompt
        whose length + max_new_tokens passes the model's context (commands filter or refuse such prompts up
        front with rollout.on_long_prompt; this catches direct callers). An engine holding no HF model (vllm
        built from a folder) checks its own limit."""
        config = getattr(self.model, "config", None)
        context = model_context(config) if config is not None else None
        for r in requests:
            reason = limit_reason(len(r.prompt_ids), self.cfg, sampling.max_new_tokens, context)
            if reason is not None:
                raise UserError(f"prompt {r.prompt.id!r}: {reason}")

    def generate_local(self, requests: list[Request], sampling: SamplingParams, progress: bool) -> LocalGeneration:
        """Token ids and logprobs for this process's requests (every process calls it together): the token-level
        call over them, keyed by sample id."""
        show = progress and (self.ctx is None or self.ctx.is_main)
        with tqdm(total=len(requests), desc="rollout", unit="seq", disable=None if show else True, leave=False) as bar:
            return self.run_stream(token_requests(requests, sampling), sampling, bar.update)

    def generate_tokens(self, requests: list[TokenRequest], sampling: SamplingParams) -> list[Generated]:
        """One continuation per request of this process, in order (every process calls it together)."""
        return self.run_stream(requests, sampling).generated

    def run_stream(self, requests: list[TokenRequest], sampling: SamplingParams, on_finished=None) -> LocalGeneration:
        """Every request through one stream, in order; `on_finished(count)` after each step that finished some."""
        longest = max((len(r.prompt_ids) + r.max_new_tokens for r in requests), default=1)
        stream = self.open_local_stream(sampling, longest, len(requests))
        out: list[Generated | None] = [None] * len(requests)
        try:
            for i, request in enumerate(requests):
                stream.submit(i, request)
            while stream.keep_going(stream.has_work):
                finished = stream.step()
                for i, generated in finished:
                    out[i] = generated
                if finished and on_finished is not None:
                    on_finished(len(finished))
        finally:
            stream.close()
        stats = stream.stats()
        return LocalGeneration(out, stats.get("preemptions"), stats.get("steps_ahead"))

    def open_stream(self, sampling: SamplingParams, max_context: int, num_seqs: int) -> TokenStream:
        """A stream for token requests of this process (every process opens it together); `max_context` bounds
        any request's prompt + new tokens and `num_seqs` how many run at once (what a KV cache is sized for).
        Under a `stream_group` only its first rank submits: the others' streams mirror it (mirror.py), so their
        callers run no episodes of their own (`stream_share`) and keep stepping. An engine implements this, or only
        `generate_local` (it then serves single-turn rollouts only)."""
        raise UserError(f"rollout engine {self.name!r} has no token-level call: it cannot run multi-turn rollouts")

    def open_local_stream(self, sampling: SamplingParams, max_context: int, num_seqs: int) -> TokenStream:
        """A stream this process submits to itself, for requests every rank of a tensor-parallel group holds alike
        from the start (`run_stream`'s batch); `open_stream` under a `stream_group` wraps it so the group's first rank
        submits for all. The default: `open_stream` (an engine without tensor parallelism)."""
        return self.open_stream(sampling, max_context, num_seqs)

    # --- memory and weights ------------------------------------------------------------------------

    def counters(self) -> dict[str, float]:
        """The engine's own running counts (e.g. KV caches built), logged as `rollout/<name>` each step."""
        return {}

    def sleep(self) -> float:
        """Release what the engine keeps between calls so the trainer has the memory; returns the bytes freed."""
        return 0.0

    def wake(self) -> None:
        """Take back what `sleep` released (weights must then be refreshed with `update_weights`)."""
        return None

    def unmapped_bytes(self) -> int:
        """Bytes torch's allocator counts as allocated that hold no device memory now (released by `sleep` under
        torch's feet): a phase's device peak leaves them out (rlx.observe.memory.measure_phase)."""
        return 0

    def update_weights(self, source: WeightSource) -> float:
        """Generate with `source`'s weights from now on; returns the seconds it took. The default: an engine that
        generates with the live module has nothing to do, else the weights are copied into its own model in
        place (every process calls it together)."""
        start = time.perf_counter()
        if source.module is not self.model:
            copy_weights(self.model, source.named_weights(self.cfg.sync_bucket_mib << 20))
        return time.perf_counter() - start

    def close(self) -> None:
        """Shut the engine down (after every collective of the command)."""
        return None


def teacher_forced(module: torch.nn.Module, request: TokenRequest, stream: SamplingParams, num_top: int,
                   device: torch.device, dtype: torch.dtype) -> PromptLogprobs:  # fmt: skip
    """`request`'s prompt tokens scored by `module` (a Hugging Face causal LM) in one forward: the engines' shared
    TokenStream.prompt_logprobs, under the request's own temperature where it has one (1 for greedy)."""
    ids = torch.tensor(request.prompt_ids, dtype=torch.long, device=device)
    temperature = request.sampling_of(stream).train_temperature
    logprobs, ranks, top_logprobs, top_ids = sequence_logprobs(module, ids, temperature, num_top, dtype)
    top = [list(zip(i, v)) for i, v in zip(top_ids.tolist(), top_logprobs.tolist())]
    return PromptLogprobs(logprobs.tolist(), ranks.tolist(), top)


def finish_generated(generated: list[Generated], tokenizer, stop: tuple[str, ...]) -> list[tuple[Generated, str]]:
    """Each response cut at its first stop string (`stop`: rollout.sampling.stop), with its decoded text: the
    per-sample CPU work of a process's own share, done before the shares are gathered (not by every process for
    every sample)."""
    if stop:
        stops = StopStrings(tokenizer, stop)
        generated = [stops.cut(g) for g in generated]
    return [(g, response_text(g, tokenizer)) for g in generated]


@torch.no_grad()
def copy_weights(model: torch.nn.Module, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy (name, tensor) pairs into `model`'s parameters in place (its dtype and device kept); on CUDA, returns once
    the copies are done (so a weight sync's time includes them)."""
    params = dict(model.named_parameters())
    for name, tensor in weights:
        if name in params:
            params[name].copy_(tensor)
    model.tie_weights()
    device = next((p.device for p in params.values()), None)
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def build_engine(cfg: RolloutConfig, model, tokenizer, ctx, processor=None) -> RolloutEngine:
    """The engine named by `cfg.engine` (registry.py) around a model held in this process; under a launcher each
    process generates its share of the requests. `processor`: a vision-language model's VisionProcessor."""
    from rlx.rollout.registry import engine_class

    if processor is None:
        return engine_class(cfg.engine)(model, tokenizer, cfg, ctx)
    return engine_class(cfg.engine)(model, tokenizer, cfg, ctx, processor=processor)
