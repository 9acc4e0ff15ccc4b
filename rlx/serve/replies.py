"""Finished turns as OpenAI's replies: a chat.completion or text_completion object (one choice per turn: the
request's n), or its stream of chunks.

A streamed reply (live.py) sends its content as the tokens are sampled; once the turn is generated, the chunks here
follow: the rest of the content (in pieces, one per sampled token, when nothing was sent before), tool calls as
deltas (one per call: id, name, the whole arguments), a last chunk with the finish_reason (and the logprobs and
token ids asked for), a usage chunk when `stream_options.include_usage` asked for it; then `data: [DONE]`. The
trajectory is recorded exactly as for the same request without `stream`.
"""

from __future__ import annotations

import secrets
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
    top_logprobs: list[list[tuple[str, float]]] = field(default_factory=list)
    """At each position, the most likely tokens (decoded alone) and their logprobs, when the request asked."""
    id: str = field(default_factory=lambda: secrets.token_hex(12))
    """Unique: a reply's id is it with its kind's prefix (`chatcmpl-`, `cmpl-`, `resp_`, as OpenAI's)."""
    created: int = field(default_factory=lambda: int(time.time()))


ID_PREFIX = {"chat.completion": "chatcmpl-", "chat.completion.chunk": "chatcmpl-", "text_completion": "cmpl-"}


def _head(turn: Turn, kind: str, model: str) -> dict:
    return {"id": f"{ID_PREFIX[kind]}{turn.id}", "object": kind, "created": turn.created, "model": model}


def _chat_logprobs(turn: Turn) -> dict | None:
    if not turn.settings.logprobs:
        return None

    def entry(text: str, logprob: float) -> dict:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    tops = turn.top_logprobs or [[] for _ in turn.token_texts]
    content = [
        {**entry(text, logprob), "top_logprobs": [entry(t, lp) for t, lp in top]}
        for text, logprob, top in zip(turn.token_texts, turn.logprobs, tops)
    ]
    return {"content": content, "refusal": None}


def _completion_logprobs(turn: Turn) -> dict | None:
    if not turn.settings.logprobs:
        return None
    offsets, at = [], 0  # into the reply's text (echo with logprobs is refused: api.py); a stop string's tokens
    for text in turn.token_texts:  # are listed past the text's end
        offsets.append(at)
        at += len(text)
    top = [dict(pairs) for pairs in turn.top_logprobs] if turn.settings.top_logprobs else None
    return {"tokens": turn.token_texts, "token_logprobs": turn.logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_finish_reason(turn: Turn) -> str:
    if turn.finish_reason == "length":
        return "length"
    return "tool_calls" if turn.message.get("tool_calls") else "stop"


def _usage(turns: list[Turn]) -> dict:
    """One request's usage: its prompt once (the choices share it), every choice's completion."""
    prompt, completion = len(turns[0].prompt_ids), sum(len(t.response_ids) for t in turns)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _with_token_ids(turn: Turn, reply: dict, choice: dict) -> None:
    """vLLM's `return_token_ids`: the prompt's and the choice's token ids."""
    if turn.settings.return_token_ids:
        reply["prompt_token_ids"] = turn.prompt_ids
        choice["token_ids"] = turn.response_ids


def chat_reply(turns: list[Turn], model: str) -> dict:
    """A chat.completion object with one choice per turn (the request's n)."""
    reply = {**_head(turns[0], "chat.completion", model), "choices": [], "usage": _usage(turns)}
    for index, turn in enumerate(turns):
        message = turn.message
        if message.get("tool_calls") and not message.get("content"):  # OpenAI's: no text beside the calls is null
            message = {**message, "content": None}
        choice = {"index": index, "message": message, "finish_reason": chat_finish_reason(turn),
                  "logprobs": _chat_logprobs(turn)}  # fmt: skip
        _with_token_ids(turn, reply, choice)
        reply["choices"].append(choice)
    return reply


def completion_reply(turns: list[Turn], model: str) -> dict:
    """A text_completion object with one choice per turn (the request's n)."""
    reply = {**_head(turns[0], "text_completion", model), "choices": [], "usage": _usage(turns)}
    for index, turn in enumerate(turns):
        choice = {"index": index, "text": turn.text, "finish_reason": turn.finish_reason,
                  "logprobs": _completion_logprobs(turn)}  # fmt: skip
        _with_token_ids(turn, reply, choice)
        reply["choices"].append(choice)
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


def _last_choice(turn: Turn, head: dict, index: int, finish: str, logprobs: dict | None, **delta) -> dict:
    choice = {"index": index, **delta, "finish_reason": finish, "logprobs": logprobs}
    last = {**head, "choices": [choice]}
    _with_token_ids(turn, last, choice)
    return last


def _rest(content: str, turn: Turn, sent: str | None) -> list[str]:
    """The pieces of `content` still to send after `sent` (None or '': all of it, a piece per token)."""
    if not sent:
        return _pieces(content, turn.token_texts)
    rest = content[len(sent) :] if content.startswith(sent) else ""
    return [rest] if rest else []


def chat_chunks(turns: list[Turn], model: str, sent: list[str] | None = None) -> Iterator[dict]:
    """The chat.completion.chunk objects of a streamed reply: each choice in turn, then the usage. `sent`: the
    content each choice streamed already (its role chunk too), None when nothing was sent."""
    head = _head(turns[0], "chat.completion.chunk", model)

    def chunk(index: int, delta: dict) -> dict:
        return {**head, "choices": [{"index": index, "delta": delta, "finish_reason": None, "logprobs": None}]}

    for index, turn in enumerate(turns):
        if sent is None:
            yield chunk(index, {"role": "assistant", "content": ""})
        for piece in _rest(turn.message.get("content") or "", turn, sent[index] if sent else None):
            yield chunk(index, {"content": piece})
        for number, call in enumerate(turn.message.get("tool_calls") or []):
            yield chunk(index, {"tool_calls": [{"index": number, **call}]})
        yield _last_choice(turn, head, index, chat_finish_reason(turn), _chat_logprobs(turn), delta={})
    if turns[0].settings.include_usage:
        yield {**head, "choices": [], "usage": _usage(turns)}


def completion_chunks(turns: list[Turn], model: str, sent: list[str] | None = None) -> Iterator[dict]:
    """The text_completion chunks of a streamed reply: each choice in turn, then the usage. `sent`: the text each
    choice streamed already."""
    head = _head(turns[0], "text_completion", model)
    for index, turn in enumerate(turns):
        for piece in _rest(turn.text, turn, sent[index] if sent else None):
            yield {**head, "choices": [{"index": index, "text": piece, "finish_reason": None, "logprobs": None}]}
        yield _last_choice(turn, head, index, turn.finish_reason, _completion_logprobs(turn), text="")
    if turns[0].settings.include_usage:
        yield {**head, "choices": [], "usage": _usage(turns)}
