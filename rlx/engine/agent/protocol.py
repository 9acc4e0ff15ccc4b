"""The token-level generation call the multi-turn code is written against.

Engines will expose `generate_tokens(requests, sampling) -> list[Generated]`; until they do, the
agent package codes against this Protocol (and `hf_tokens.HFTokenEngine` adapts today's hf engine).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from rlx.engine.rollout.config import RolloutConfig
from rlx.engine.rollout.requests import Generated


@dataclass
class TokenRequest:
    """One continuation to generate from exact token ids."""

    key: str
    """Seeds the request's random stream (a sample's turn: `<sample_id>/<turn>`), whatever its batch."""
    prompt_ids: list[int]
    """The whole context so far, token ids fed to the model as they are."""
    max_new_tokens: int
    """Longest continuation; a longer one stops with finish_reason 'length'."""
    greedy: bool = False
    """Take the argmax at every step."""


class TokenEngine(Protocol):
    """Anything that turns token requests into continuations (sampled with `sampling`'s settings)."""

    def generate_tokens(self, requests: list[TokenRequest], sampling: RolloutConfig) -> list[Generated]:
        """One `Generated` per request, in order."""
        ...


__all__ = ["Generated", "TokenEngine", "TokenRequest"]
