"""A finished turn as OpenAI's replies: a chat.completion or text_completion object, or its stream of chunks.

Streaming sends the turn once it is generated (the engine stream hands whole turns back), in OpenAI's chunk
format: a first chunk with the role, the content in pieces (one per sampled token where the content is the
decoded text), tool calls as deltas (one per call: id, name, the whole arguments), a last chunk with the
finish_reason, a usage chunk when `stream_options.include_usage` asked for it, and `data: [DONE]`. The
trajectory is recorded exactly as for the same request without `stream`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from rlx.serve.api import Settings


@dataclass
class Turn:
    """One answered request: what it asked, the context and what was sampled, and the reply's text or message."""

    settings: Settings
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    message: dict | None = None
    """chat: the assistant message (content, tool_calls)."""
    text: str = ""
    """completions: the reply's text (the prompt first, with echo)."""
    token_texts: list[str] = field(default_factory=list)
    """Each sampled token decoded alone (for logprobs and stream pieces)."""
    id: str = field(default_factory=lambda: f"rlx-{time.monotonic_ns()}")
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def usage(self) -> dict:
        prompt, completion = len(self.prompt_ids), len(self.response_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _head(turn: Turn, kind: str, model: str) -> dict:
    return {"id": turn.id, "object": kind, "created": turn.created, "model": model}


def _chat_logprobs(turn: Turn) -> dict | None:
    if not turn.settings.logprobs:
        return None
    content = [
        {"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []}
        for text, logprob in zip(turn.token_texts, turn.logprobs)
    ]
    return {"content": content, "refusal": None}


def _completion_logprobs(turn: Turn) -> dict | None:
    if not turn.settings.logprobs:
        return None
    offsets, at = [], len(turn.text) - len("".join(turn.token_texts))
    for text in turn.token_texts:
        offsets.append(max(at, 0))
        at += len(text)
    return {"tokens": turn.token_texts, "token_logprobs": turn.logprobs, "top_logprobs": None, "text_offset": offsets}


def chat_finish_reason(turn: Turn) -> str:
    if turn.finish_reason == "length":
        return "length"
    return "tool_calls" if turn.message.get("tool_calls") else "stop"


def _token_ids(turn: Turn, reply: dict, choice: dict) -> None:
    """vLLM's `return_token_ids`: the prompt's and the choice's token ids."""
    if turn.settings.return_token_ids:
        reply["prompt_token_ids"] = turn.prompt_ids
        choice["token_ids"] = turn.response_ids


def chat_reply(turn: Turn, model: str) -> dict:
    choice = {"index": 0, "message": turn.message, "finish_reason": chat_finish_reason(turn),
              "logprobs": _chat_logprobs(turn)}  # fmt: skip
    reply = {**_head(turn, "chat.completion", model), "choices": [choice], "usage": turn.usage}
    _token_ids(turn, reply, choice)
    return reply


def completion_reply(turn: Turn, model: str) -> dict:
    choice = {"index": 0, "text": turn.text, "finish_reason": turn.finish_reason,
              "logprobs": _completion_logprobs(turn)}  # fmt: skip
    reply = {**_head(turn, "text_completion", model), "choices": [choice], "usage": turn.usage}
    _token_ids(turn, reply, choice)
    return reply


def _pieces(text: str, token_texts: list[str]) -> list[str]:
    """`text` cut where the tokens' texts end when it is their concatenation's start, else whole."""
    pieces, at = [], 0
    if "".join(token_texts).startswith(text):
        for piece in token_texts:
            if at >= len(text):
                break
            pieces.append(text[at : at + len(piece)])
            at += len(piece)
        return [p for p in pieces if p]
    return [text] if text else []


def chat_chunks(turn: Turn, model: str) -> Iterator[dict]:
    head = _head(turn, "chat.completion.chunk", model)

    def chunk(delta: dict, finish: str | None = None, **extra) -> dict:
        return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None, **extra}]}

    yield chunk({"role": "assistant", "content": ""})
    content = turn.message.get("content") or ""
    for piece in _pieces(content, turn.token_texts):
        yield chunk({"content": piece})
    for index, call in enumerate(turn.message.get("tool_calls") or []):
        yield chunk({"tool_calls": [{"index": index, **call}]})
    last = chunk({}, chat_finish_reason(turn))
    last["choices"][0]["logprobs"] = _chat_logprobs(turn)
    if turn.settings.return_token_ids:
        last["choices"][0]["token_ids"] = turn.response_ids
        last["prompt_token_ids"] = turn.prompt_ids
    yield last
    if turn.settings.include_usage:
        yield {**head, "choices": [], "usage": turn.usage}


def completion_chunks(turn: Turn, model: str) -> Iterator[dict]:
    head = _head(turn, "text_completion", model)

    def chunk(text: str, finish: str | None = None) -> dict:
        return {**head, "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}

    for piece in _pieces(turn.text, turn.token_texts):
        yield chunk(piece)
    last = chunk("", turn.finish_reason)
    last["choices"][0]["logprobs"] = _completion_logprobs(turn)
    if turn.settings.return_token_ids:
        last["choices"][0]["token_ids"] = turn.response_ids
        last["prompt_token_ids"] = turn.prompt_ids
    yield last
    if turn.settings.include_usage:
        yield {**head, "choices": [], "usage": turn.usage}


async def sse(chunks: Iterator[dict]):
    """Server-sent events: one `data:` line per chunk, then `data: [DONE]`."""
    for chunk in chunks:
        yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
    yield "data: [DONE]\n\n"
