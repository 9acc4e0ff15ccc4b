"""Stop strings (`rollout.sampling.stop`, `--stop`): a response ends where one of them first appears in its text.

Every engine ends such a sequence early (hf and native check the decoded tail after each token, vllm gets the
strings itself), and the shared outline then cuts every response the same way (`cut`), so the engines agree:
response_ids and logprobs end with the token that completed the stop string (the tokens that were sampled,
which training sees), finish_reason is 'stop', and the response text ends just before the stop string (as vLLM
and transformers' `stop_strings` leave it by default).
"""

from __future__ import annotations

import dataclasses

from rlx.rollout.requests import Generated

_SLACK_TOKENS = 8  # tokens decoded beyond the longest stop string's characters (pieces that decode to nothing)


class StopStrings:
    """The stop strings of one generate call, with the tokenizer that turns token ids into text."""

    def __init__(self, tokenizer, stops: tuple[str, ...]):
        self.tokenizer, self.stops = tokenizer, tuple(stops)
        self.window = max(len(s) for s in self.stops) + _SLACK_TOKENS

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _contains(self, text: str) -> bool:
        return any(s in text for s in self.stops)

    def hit(self, ids: list[int]) -> bool:
        """Whether the response so far ends in (or recently completed) a stop string: called after each token,
        it decodes only the last tokens (a stop string of c characters spans at most c tokens)."""
        return bool(ids) and self._contains(self._text(ids[-self.window :]))

    def first(self, text: str) -> str | None:
        """The stop string that appears earliest in `text` (the longest of those starting there), or None."""
        found = [(text.find(s), -len(s), s) for s in self.stops if s in text]
        return min(found)[2] if found else None

    def cut(self, gen: Generated) -> Generated:
        """`gen` ended at the token where a stop string first appears in the decoded text (the shortest prefix of
        response_ids whose text contains one: found by bisection); unchanged when its text contains none."""
        ids = gen.response_ids
        if not ids or not self._contains(self._text(ids)):
            return gen
        lo, hi = 1, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if self._contains(self._text(ids[:mid])):
                hi = mid
            else:
                lo = mid + 1
        stop = self.first(self._text(ids[:lo]))
        routed = gen.routed_experts[:lo] if gen.routed_experts is not None else None
        top = gen.top_logprobs[:lo] if gen.top_logprobs is not None else None
        return dataclasses.replace(gen, response_ids=ids[:lo], logprobs=gen.logprobs[:lo], finish_reason="stop",
                                   stop_string=stop, routed_experts=routed, top_logprobs=top)  # fmt: skip
