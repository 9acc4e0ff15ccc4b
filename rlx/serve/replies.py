"""Finished turns as OpenAI's replies: a chat.completion or text_completion object (one choice per turn: the
request's n), or the chunks of its stream.

A streamed reply (live.py) is built by `StreamedReply`, as vLLM's OpenAI server streams: every chunk has the reply's
id, created and model; a chat choice opens with its role delta (`content: ""`, and the prompt's token ids with
`return_token_ids`); each piece of text carries the logprobs (and, with `return_token_ids`, the ids) of the tokens it
was written with, so the pieces' logprobs add up to the non-streamed reply's; each tool call is a delta of its id,
type and name, then one of its arguments; the last chunk has the finish_reason and the tokens no text took (a
tool-call block's go with the first call's delta). With `stream_options.continuous_usage_stats` every chunk has the
usage so far; with `include_usage` a last chunk with no choices has the request's usage. The trajectory is recorded
exactly as for the same request without `stream`.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from rlx.serve.api import Settings


@dataclass
class Span:
    """Sampled tokens that go with one piece of a reply (a streamed chunk, or a whole choice)."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    """Each token decoded alone (when the request asked for logprobs or streams)."""
    top: list[list[tuple[str, float]]] = field(default_factory=list)
    """At each position, the most likely tokens (decoded alone) and their logprobs, when the request asked."""


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

    def span(self, start: int = 0, end: int | None = None) -> Span:
        """The sampled tokens [start, end) of the turn."""
        return Span(self.response_ids[start:end], self.logprobs[start:end], self.token_texts[start:end],
                    self.top_logprobs[start:end])  # fmt: skip


ID_PREFIX = {"chat.completion": "chatcmpl-", "chat.completion.chunk": "chatcmpl-", "text_completion": "cmpl-"}


def _head(turn: Turn, kind: str, model: str) -> dict:
    return {"id": f"{ID_PREFIX[kind]}{turn.id}", "object": kind, "created": turn.created, "model": model}


def _chat_logprobs(span: Span) -> dict:
    def entry(text: str, logprob: float) -> dict:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    tops = span.top or [[] for _ in span.texts]
    content = [
        {**entry(text, logprob), "top_logprobs": [entry(t, lp) for t, lp in top]}
        for text, logprob, top in zip(span.texts, span.logprobs, tops)
    ]
    return {"content": content, "refusal": None}


def _completion_logprobs(span: Span, settings: Settings, text_offset: int = 0) -> dict:
    """`text_offset`: where the span's first token's text begins in the reply's (its tokens' texts laid end to end:
    echo with logprobs is refused, api.py; a stop string's tokens are listed past the text's end)."""
    offsets, at = [], text_offset
    for text in span.texts:
        offsets.append(at)
        at += len(text)
    top = [dict(pairs) for pairs in span.top] if settings.top_logprobs else None
    return {"tokens": span.texts, "token_logprobs": span.logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_finish_reason(turn: Turn) -> str:
    """OpenAI's (and vLLM's): 'tool_calls' where the model chose to call ('auto', 'required'), 'stop' where the
    request named the function."""
    if turn.finish_reason == "length":
        return "length"
    return "tool_calls" if turn.message.get("tool_calls") and not turn.settings.is_named_tool else "stop"


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
        logprobs = _chat_logprobs(turn.span()) if turn.settings.logprobs else None
        choice = {"index": index, "message": message, "finish_reason": chat_finish_reason(turn), "logprobs": logprobs}
        _with_token_ids(turn, reply, choice)
        reply["choices"].append(choice)
    return reply


def completion_reply(turns: list[Turn], model: str) -> dict:
    """A text_completion object with one choice per turn (the request's n)."""
    reply = {**_head(turns[0], "text_completion", model), "choices": [], "usage": _usage(turns)}
    for index, turn in enumerate(turns):
        logprobs = _completion_logprobs(turn.span(), turn.settings) if turn.settings.logprobs else None
        choice = {"index": index, "text": turn.text, "finish_reason": turn.finish_reason, "logprobs": logprobs}
        _with_token_ids(turn, reply, choice)
        reply["choices"].append(choice)
    return reply


def _usage_so_far(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class StreamedReply:
    """The chunks of one streamed reply, every choice's: what each choice has sent, and each next chunk."""

    def __init__(self, settings: Settings, prompt_ids: list[list[int]], model: str, is_chat: bool):
        """`prompt_ids`: each choice's context (its prompt's token ids)."""
        self.settings, self.prompt_ids, self.is_chat = settings, prompt_ids, is_chat
        kind = "chat.completion.chunk" if is_chat else "text_completion"
        self.rid = secrets.token_hex(12)
        """The reply's own id (its turns' Turn.id once they are generated)."""
        self.head = {"id": f"{ID_PREFIX[kind]}{self.rid}", "object": kind, "created": int(time.time()), "model": model}
        self.num_tokens = [0] * len(prompt_ids)
        """Tokens each choice has sent (their logprobs and ids went with its chunks)."""
        self.text_at = [0] * len(prompt_ids)
        """Where each choice's next token's text begins (completions' text_offset)."""
        self.is_open = [False] * len(prompt_ids)
        """Whether the choice has sent a chunk (a completion choice's first carries the prompt's ids)."""

    def role(self, index: int) -> dict:
        """A chat choice's first chunk: the role (and `content: ""`, as vLLM sends before it knows the reply)."""
        delta = {"role": "assistant", "content": ""}
        chunk = {**self.head, "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]}
        if self.settings.return_token_ids:
            chunk["prompt_token_ids"] = self.prompt_ids[index]
        if self.settings.continuous_usage:
            chunk["usage"] = _usage_so_far(len(self.prompt_ids[index]), 0)
        self.is_open[index] = True
        return chunk

    def text(self, index: int, text: str, span: Span | None, finish_reason: str | None = None) -> dict:
        """A chunk of choice `index` with a piece of its text (chat: its content) written by the tokens of `span`."""
        fields = ({"delta": {"content": text} if text else {}}) if self.is_chat else {"text": text}
        return self.chunk(index, fields, span, finish_reason)

    def chunk(self, index: int, fields: dict, span: Span | None, finish_reason: str | None = None) -> dict:
        """A chunk of choice `index`: `fields` (chat: the delta; completions: the text), the logprobs and ids of the
        tokens of `span`, the usage so far where the request asked for it."""
        span = span or Span()
        settings, logprobs = self.settings, None
        if settings.logprobs and span.ids:
            if self.is_chat:
                logprobs = _chat_logprobs(span)
            else:
                logprobs = _completion_logprobs(span, settings, self.text_at[index])
                self.text_at[index] += sum(len(t) for t in span.texts)
        choice = {"index": index, **fields, "logprobs": logprobs, "finish_reason": finish_reason}
        if settings.return_token_ids:
            choice["token_ids"] = span.ids
            if not self.is_open[index]:  # vLLM's: a completion choice's first chunk carries the prompt's ids
                choice["prompt_token_ids"] = self.prompt_ids[index]
        self.is_open[index] = True
        self.num_tokens[index] += len(span.ids)
        chunk = {**self.head, "choices": [choice]}
        if settings.continuous_usage:
            chunk["usage"] = _usage_so_far(len(self.prompt_ids[index]), self.num_tokens[index])
        return chunk

    def finished(self, index: int, turn: Turn, pieces: list[tuple[str, int, int]]) -> Iterator[dict]:
        """Choice `index`'s last chunks once its turn is generated: `pieces` of its text still to send, each with
        its tokens [start, end) (contiguous from the tokens sent so far), its tool calls (the id, type and name, then
        the arguments), and the finish_reason with the tokens no piece took (a tool-call block's go with the first
        call's delta)."""
        turn.id, turn.created = self.rid, self.head["created"]
        for text, start, end in pieces:
            yield self.text(index, text, turn.span(start, end))
        rest = turn.span(self.num_tokens[index])
        calls = (turn.message.get("tool_calls") or []) if self.is_chat else []
        for number, call in enumerate(calls):
            function = call["function"]
            named = {"index": number, "id": call["id"], "type": "function", "function": {"name": function["name"]}}
            yield self.chunk(index, {"delta": {"tool_calls": [named]}}, rest if number == 0 else None)
            arguments = {"index": number, "function": {"arguments": function["arguments"]}}
            yield self.chunk(index, {"delta": {"tool_calls": [arguments]}}, None)
        finish = chat_finish_reason(turn) if self.is_chat else turn.finish_reason
        yield self.text(index, "", None if calls else rest, finish)

    def usage(self, turns: list[Turn]) -> Iterator[dict]:
        """The usage chunk (no choices) where the request asked for it (stream_options.include_usage)."""
        if self.settings.include_usage:
            yield {**self.head, "choices": [], "usage": _usage(turns)}
