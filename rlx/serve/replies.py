"""Finished turns as OpenAI's replies: a chat.completion or text_completion object (one choice per turn: the
request's n), or the chunks of its stream.

Each choice has vLLM's `stop_reason` (the stop string or the non-EOS stop token that ended it, else null); with
`return_token_ids`, its `token_ids`, and the prompt's: beside the choices of a chat reply, in each choice of a
completion (where vLLM puts them).

A streamed reply (live.py) is built by `StreamedReply`, as vLLM's OpenAI server streams: every chunk has the reply's
id, created and model; a chat choice opens with its role delta (`content: ""`, and the prompt's token ids with
`return_token_ids`); a completion choice's first chunk begins with the prompt's text where the request asked for
`echo`; each piece of text carries the logprobs (and, with `return_token_ids`, the ids) of the tokens it was written
with, so the pieces' logprobs add up to the non-streamed reply's; each tool call is a delta of its id, type and name,
then its arguments (in pieces as they are sampled, tool_stream.py, or whole once generated); the last chunk has the
finish_reason, the stop_reason (a completion's chunks all have one: null before) and the tokens no chunk took (with
the first tool-call delta sent once the turn is generated, if any). With `stream_options.continuous_usage_stats`
every chunk has the usage so far; with `include_usage` a last chunk with no choices has the request's usage. The
trajectory is recorded exactly as for the same request without `stream`.
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
    echo: str = ""
    """completions with echo: the prompt's text, which `text` begins with."""
    stop_reason: int | str | None = None
    """vLLM's: the stop string, or the stop token other than the tokenizer's EOS, that ended the turn; else None."""
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


Finish = tuple[str, int | str | None]
"""A choice's finish_reason and vLLM's stop_reason (on its last chunk)."""

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


def _with_token_ids(turn: Turn, reply: dict, choice: dict, is_chat: bool) -> None:
    """vLLM's `return_token_ids`: the choice's token ids and the prompt's (chat: beside the choices; completions: in
    each choice, as vLLM places them)."""
    if turn.settings.return_token_ids:
        (reply if is_chat else choice)["prompt_token_ids"] = turn.prompt_ids
        choice["token_ids"] = turn.response_ids


def chat_reply(turns: list[Turn], model: str) -> dict:
    """A chat.completion object with one choice per turn (the request's n)."""
    reply = {**_head(turns[0], "chat.completion", model), "choices": [], "usage": _usage(turns)}
    for index, turn in enumerate(turns):
        message = turn.message
        if message.get("tool_calls") and not message.get("content"):  # OpenAI's: no text beside the calls is null
            message = {**message, "content": None}
        logprobs = _chat_logprobs(turn.span()) if turn.settings.logprobs else None
        choice = {"index": index, "message": message, "logprobs": logprobs, "finish_reason": chat_finish_reason(turn),
                  "stop_reason": turn.stop_reason}  # fmt: skip
        _with_token_ids(turn, reply, choice, is_chat=True)
        reply["choices"].append(choice)
    return reply


def completion_reply(turns: list[Turn], model: str) -> dict:
    """A text_completion object with one choice per turn (the request's n)."""
    reply = {**_head(turns[0], "text_completion", model), "choices": [], "usage": _usage(turns)}
    for index, turn in enumerate(turns):
        logprobs = _completion_logprobs(turn.span(), turn.settings) if turn.settings.logprobs else None
        choice = {"index": index, "text": turn.text, "logprobs": logprobs, "finish_reason": turn.finish_reason,
                  "stop_reason": turn.stop_reason}  # fmt: skip
        _with_token_ids(turn, reply, choice, is_chat=False)
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
        self.echo = [""] * len(prompt_ids)
        """Completions with echo: each choice's prompt text, which its first chunk's text begins with (vLLM's)."""
        self.calls: list[list[dict]] = [[] for _ in prompt_ids]
        """Each chat choice's tool calls streamed as they were sampled: their id, name and the arguments sent."""

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

    def text(self, index: int, text: str, span: Span | None, finish: Finish | None = None) -> dict:
        """A chunk of choice `index` with a piece of its text (chat: its content) written by the tokens of `span`
        (a completion choice's first begins with the echoed prompt); `finish`: the choice's finish_reason and
        stop_reason, on its last chunk."""
        if self.is_chat:
            fields = {"delta": {"content": text} if text else {}}
        else:
            fields = {"text": text if self.is_open[index] else self.echo[index] + text}
        return self.chunk(index, fields, span, finish)

    def call_named(self, index: int, number: int, call_id: str, name: str, span: Span | None) -> dict:
        """The chunk that opens choice `index`'s tool call `number`: its id, type and name (vLLM's first delta)."""
        self.calls[index].append({"id": call_id, "name": name, "arguments": ""})
        named = {"index": number, "id": call_id, "type": "function", "function": {"name": name}}
        return self.chunk(index, {"delta": {"tool_calls": [named]}}, span)

    def call_arguments(self, index: int, number: int, piece: str, span: Span | None) -> dict:
        """A chunk with a piece of the arguments of choice `index`'s tool call `number`."""
        self.calls[index][number]["arguments"] += piece
        return self.chunk(index, {"delta": {"tool_calls": [{"index": number, "function": {"arguments": piece}}]}}, span)

    def chunk(self, index: int, fields: dict, span: Span | None, finish: Finish | None = None) -> dict:
        """A chunk of choice `index`: `fields` (chat: the delta; completions: the text), the logprobs and ids of the
        tokens of `span`, the usage so far where the request asked for it; `finish`: (finish_reason, stop_reason)."""
        span = span or Span()
        settings, logprobs = self.settings, None
        if settings.logprobs and span.ids:
            if self.is_chat:
                logprobs = _chat_logprobs(span)
            else:
                logprobs = _completion_logprobs(span, settings, self.text_at[index])
                self.text_at[index] += sum(len(t) for t in span.texts)
        choice = {"index": index, **fields, "logprobs": logprobs, "finish_reason": finish and finish[0]}
        if finish or not self.is_chat:  # vLLM's: a chat choice's with its finish_reason, a completion's in every chunk
            choice["stop_reason"] = finish and finish[1]
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
        its tokens [start, end) (contiguous from the tokens sent so far), what of its tool calls was not streamed
        (a call's id, type and name, then its arguments or the rest of them), and the finish_reason and stop_reason;
        the tokens no chunk took go with the first tool-call delta here, else with the finish_reason."""
        turn.id, turn.created = self.rid, self.head["created"]
        for text, start, end in pieces:
            yield self.text(index, text, turn.span(start, end))
        rest = turn.span(self.num_tokens[index])
        deltas = self._unsent_calls(index, turn)
        for number, delta in enumerate(deltas):
            yield self.chunk(index, {"delta": {"tool_calls": [delta]}}, rest if number == 0 else None)
        finish = chat_finish_reason(turn) if self.is_chat else turn.finish_reason
        yield self.text(index, "", None if deltas else rest, (finish, turn.stop_reason))

    def _unsent_calls(self, index: int, turn: Turn) -> list[dict]:
        """The deltas of choice `index`'s tool calls not streamed yet: a whole call (its name, then its arguments),
        or the rest of a streamed call's arguments."""
        deltas, streamed = [], self.calls[index]
        for number, call in enumerate((turn.message.get("tool_calls") or []) if self.is_chat else []):
            function = call["function"]
            if number >= len(streamed):
                named = {"name": function["name"]}
                deltas.append({"index": number, "id": call["id"], "type": "function", "function": named})
                more = function["arguments"]
            else:  # the rest of a streamed call's arguments (none where a key given twice changed what was sent)
                sent = streamed[number]["arguments"]
                more = function["arguments"][len(sent) :] if function["arguments"].startswith(sent) else ""
            if more:
                deltas.append({"index": number, "function": {"arguments": more}})
        return deltas

    def usage(self, turns: list[Turn]) -> Iterator[dict]:
        """The usage chunk (no choices) where the request asked for it (stream_options.include_usage)."""
        if self.settings.include_usage:
            yield {**self.head, "choices": [], "usage": _usage(turns)}
