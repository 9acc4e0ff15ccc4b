"""What every rollout engine shares: the sequences to generate (prompt requests, and token requests of the
token-level call), what comes back for each, and how a prompt request becomes a record."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlx.formats.records import PromptRecord, RolloutRecord
from rlx.models.fingerprint import tokenizer_fingerprint
from rlx.models.vision.inputs import VisionInputs
from rlx.rollout.config import SamplingParams
from rlx.rollout.prompts import PromptEncoder

if TYPE_CHECKING:
    import torch

    from rlx.rollout.constraints import GrammarConstraint


@dataclass
class Request:
    """One sequence to generate: which prompt, which sample, its token ids."""

    prompt: PromptRecord
    sample_index: int
    prompt_ids: list[int]
    greedy: bool = False
    """ReMax's greedy baseline (decoded by argmax whatever the temperature)."""
    vision: VisionInputs | None = None
    """The prompt's images as the model takes them (vision-language models; None without images): the N
    requests of a prompt share one object."""

    @property
    def sample_id(self) -> str:
        return f"{self.prompt.id}/{self.sample_index}"


@dataclass
class TokenRequest:
    """One continuation to generate from exact token ids (the token-level call: multi-turn episodes, served agents)."""

    key: str
    """Seeds the request's random stream, whatever its batch: a prompt request's is its sample id, a multi-turn
    turn's `<sample_id>/<turn>`."""
    prompt_ids: list[int]
    """The whole context so far, token ids fed to the model as they are."""
    max_new_tokens: int
    """Longest continuation (at most the call's SamplingParams.max_new_tokens); longer ones stop with 'length'."""
    greedy: bool = False
    """Take the argmax at every step (whatever the temperature)."""
    vision: VisionInputs | None = None
    """The prompt's images as the model takes them (a single-turn request of a vision-language model), else None."""
    seed: int | None = None
    """The seed of the request's random stream when it is not the call's (SamplingParams.seed): an asynchronous
    rollout rank generates several steps, each with its own seed, in one stream."""
    temperature: float | None = None
    """The request's own temperature (0: greedy) when it is not the stream's (a served client's request)."""
    top_p: float | None = None
    """The request's own nucleus threshold when it is not the stream's."""
    top_k: int | None = None
    """The request's own top-k filter (0 or -1 = off) when it is not the stream's."""
    constraint: GrammarConstraint | None = None
    """A grammar the tokens must follow (rlx.rollout.constraints; engines hf and native): its state is advanced as
    the request is generated, so a constrained request is submitted once."""
    num_top_logprobs: int = 0
    """Also return, at each sampled position, the most likely tokens and their logprobs (Generated.top_logprobs):
    how many (0 = none; engines hf and native)."""
    num_prompt_routes: int = 0
    """MoE models: also return the routing of the positions that predicted the prompt's last n tokens
    (Generated.prompt_routed_experts): a multi-turn episode's next turn asks for its inserted tokens' (0 = none)."""

    def __post_init__(self):
        most = max(len(self.prompt_ids) - 1, 0)  # the first prompt token has no predicting position
        if not 0 <= self.num_prompt_routes <= most:
            raise ValueError(
                f"token request {self.key!r}: num_prompt_routes {self.num_prompt_routes} is not in [0, {most}]"
            )
        ranges = {"temperature": lambda t: t >= 0, "top_p": lambda p: 0 < p <= 1, "top_k": lambda k: k >= -1}
        for name, valid in ranges.items():
            value = getattr(self, name)
            if value is not None and not valid(value):
                raise ValueError(f"token request {self.key!r}: {name} {value} is out of range")

    def sampling_of(self, stream: SamplingParams) -> SamplingParams:
        """The stream's sampling with this request's own temperature, top_p, top_k and seed where it has them."""
        own = {k: v for k in ("temperature", "top_p", "top_k", "seed") if (v := getattr(self, k)) is not None}
        return dataclasses.replace(stream, **own) if own else stream


@dataclass
class Generated:
    """What came back for one request."""

    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    stop_string: str | None = None
    """The stop string that ended it (rollout.sampling.stop): the response text is cut before it."""
    routed_experts: torch.Tensor | None = None
    """MoE models on engines that record routing: int16 [len(response_ids), layers, k], the experts of the
    position that predicted each token (rlx.models.routing); None otherwise."""
    prompt_routed_experts: torch.Tensor | None = None
    """With TokenRequest.num_prompt_routes = n on an engine that records routing: int16 [n, layers, k], the experts
    of the positions that predicted the prompt's last n tokens (computed as the engine read the prompt), so that
    `prompt_routed_experts` then `routed_experts` are the rows of the context's last n + len(response_ids) tokens;
    None otherwise."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """With TokenRequest.num_top_logprobs = k: at each position, the k most likely (token id, logprob) pairs, most
    likely first, from the distribution `logprobs` are taken from (after temperature, before top-k/top-p)."""


@dataclass
class PromptLogprobs:
    """A prompt's own tokens scored by the model teacher-forced (TokenStream.prompt_logprobs): entry i is about
    prompt token i + 1 given the tokens before it (the first token has no predicting position)."""

    logprobs: list[float]
    """Each token's logprob, from the distribution its sampled tokens' would come from (after the request's
    temperature, 1 for greedy; before top-k/top-p)."""
    ranks: list[int]
    """Each token's rank in that distribution (1: the most likely; tokens as likely count as ahead of it)."""
    top: list[list[tuple[int, float]]]
    """At each position the k most likely (token id, logprob) pairs, most likely first (k = the call's num_top)."""


def build_requests(prompts: list[PromptRecord], encoder: PromptEncoder, sampling: SamplingParams) -> list[Request]:
    """N requests per prompt, in prompt order then sample order (plus ReMax's greedy one when asked)."""
    requests = []
    for p in prompts:
        ids, vision = encoder.encode(p)
        requests += [Request(p, i, ids, vision=vision) for i in range(sampling.n)]
        if sampling.remax_baseline:  # ReMax: one greedy response per prompt, after its samples
            requests.append(Request(p, sampling.n, ids, greedy=True, vision=vision))
    return requests


def token_requests(requests: list[Request], sampling: SamplingParams) -> list[TokenRequest]:
    """Prompt requests as token requests: keyed by sample id, so their draws are the single-turn streams."""
    return [TokenRequest(r.sample_id, r.prompt_ids, sampling.max_new_tokens, r.greedy, r.vision) for r in requests]


def cut_response(text: str, stop: str | None) -> str:
    """The response text up to (not including) its first `stop` (rollout.sampling.stop; see stops.py)."""
    if not stop:
        return text
    at = text.find(stop)
    return text if at < 0 else text[:at]


def response_text(gen: Generated, tokenizer) -> str:
    """The decoded response (special tokens removed), cut before the stop string that ended it."""
    return cut_response(tokenizer.decode(gen.response_ids, skip_special_tokens=True), gen.stop_string)


def to_record(
    req: Request,
    gen: Generated,
    tokenizer,
    temperature: float,
    response: str | None = None,
    fingerprint: str | None = None,
) -> RolloutRecord:
    """The record of a prompt request; `response` (its `response_text`) and `fingerprint` (the tokenizer's) where
    the caller has them already."""
    p = req.prompt
    return RolloutRecord(
        id=req.sample_id,
        prompt_id=p.id,
        sample_index=req.sample_index,
        prompt=p.prompt,
        response=response_text(gen, tokenizer) if response is None else response,
        prompt_ids=req.prompt_ids,
        response_ids=gen.response_ids,
        rollout_logprobs=gen.logprobs,
        finish_reason=gen.finish_reason,
        temperature=temperature,
        is_greedy_baseline=req.greedy,
        data_source=p.data_source,
        ground_truth=p.ground_truth,
        extra=dict(p.extra),
        tokenizer=fingerprint or tokenizer_fingerprint(tokenizer),
        routed_experts=gen.routed_experts,
    )
