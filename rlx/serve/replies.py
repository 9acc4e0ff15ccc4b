"""Finished turns as OpenAI's replies: a chat.completion or text_completion object (one choice per turn: the
request's n), or the chunks of its stream.

A reply has every key vLLM's OpenAI server writes (it serializes its response models whole), null where rlx has
nothing to say (service_tier, system_fingerprint, kv_transfer_params, a message's refusal, ...), so a client that
indexes them finds them. Each choice has vLLM's `stop_reason` (the stop string or the non-EOS stop token that ended it,
else null); with `return_token_ids`, its `token_ids`, and the prompt's; with vLLM's `prompt_logprobs`, each prompt
token's logprob, rank and alternatives (null for the first token): both beside the choices of a chat reply and in each
choice of a completion (where vLLM puts them). A completion with `echo` and `logprobs` lists the prompt's tokens
before the sampled ones in its logprobs, the first with a null logprob, as vLLM does.

A streamed reply (live.py) is built by `StreamedReply`, as vLLM's OpenAI server streams: every chunk has the reply's
id, created and model; a chat choice opens with its role delta (`content: ""`, and the prompt's token ids with
`return_token_ids`); a completion choice's first chunk begins with the prompt's text where the request asked for
`echo` (and, with logprobs, lists the prompt's tokens first); each piece of text carries the logprobs (and, with
`return_token_ids`, the ids) of the tokens it was written with, so the pieces' logprobs add up to the non-streamed
reply's; each tool call is a delta of its id, type and name, then its arguments (in pieces as they are sampled,
tool_stream.py, or whole once generated); the last chunk has the finish_reason, the stop_reason (a completion's
chunks all have one: null before) and the tokens no chunk took (with the first tool-call delta sent once the turn is
generated, if any). With `stream_options.continuous_usage_stats` every chunk has the usage so far; with
`include_usage` a last chunk with no choices has the request's usage. The trajectory is recorded exactly as for the
same request without `stream`.
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
class PromptTokens:
    """A prompt's tokens as the served model scores them teacher-forced (vLLM's prompt_logprobs; a completion's echo
    with logprobs): position 0 is the first token, which nothing predicts (its logprob and rank None, no
    alternatives)."""

    ids: list[int]
    texts: list[str]
    """Each token decoded alone."""
    logprobs: list[float | None]
    """Each token's logprob given the tokens before it (at least -9999.0, as vLLM clamps -inf for JSON)."""
    ranks: list[int | None]
    """Its rank there (1: the most likely)."""
    top: list[list[tuple[int, str, float]]]
    """At each position the most likely tokens: (id, text decoded alone, logprob)."""


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
    prompt: PromptTokens | None = None
    """The context's tokens scored, where the request asked (Settings.prompt_top)."""
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


def _completion_logprobs(
    span: Span, settings: Settings, text_offset: int = 0, prompt: PromptTokens | None = None
) -> dict:
    """`text_offset`: where the first listed token's text begins in the reply's (the tokens' texts laid end to end, as
    vLLM counts them; a stop string's tokens are listed past the text's end). `prompt` (echo with logprobs): its
    tokens are listed first, the first one's logprob and alternatives null, as vLLM lists them."""
    k = settings.top_logprobs
    texts, logprobs, top = list(span.texts), list(span.logprobs), [dict(pairs) for pairs in span.top]
    if prompt is not None:
        texts, logprobs = prompt.texts + texts, prompt.logprobs + logprobs
        top = [None] + [{text: logprob for _, text, logprob in pairs[:k]} for pairs in prompt.top[1:]] + top
    offsets, at = [], text_offset
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {"tokens": texts, "token_logprobs": logprobs, "top_logprobs": top if k else None, "text_offset": offsets}


def prompt_logprobs(prompt: PromptTokens, k: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: None for the first token, then for each token {token id: {logprob, rank,
    decoded_token}} of the token itself and the k most likely there (ids are JSON keys: strings)."""
    out: list[dict | None] = [None]
    for i in range(1, len(prompt.ids)):
        entry = {str(prompt.ids[i]): {"logprob": prompt.logprobs[i], "rank": prompt.ranks[i],
                                      "decoded_token": prompt.texts[i]}}  # fmt: skip
        for rank, (token, text, logprob) in enumerate(prompt.top[i][:k], 1):
            entry.setdefault(str(token), {"logprob": logprob, "rank": rank, "decoded_token": text})
        out.append(entry)
    return out


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


_MESSAGE = {"role": "assistant", "content": None, "refusal": None, "annotations": None, "audio": None,
            "function_call": None, "reasoning": None, "reasoning_content": None}  # fmt: skip
"""The keys of a reply's message as vLLM's ChatMessage writes them where rlx has nothing to say: null `refusal`,
`annotations`, `audio`, `function_call`, and `reasoning` (vLLM's name) and `reasoning_content` (its earlier one, which
clients written for older vLLM read): rlx parses no reasoning out of the text. `tool_calls` only where there are some,
as vLLM (and OpenAI) leave an empty list out."""


def _prompt_field(turn: Turn) -> list[dict | None] | None:
    """The turn's vLLM `prompt_logprobs` where the request asked for them, else None."""
    k = turn.settings.prompt_logprobs
    return prompt_logprobs(turn.prompt, k) if k is not None and turn.prompt is not None else None


def _ids(turn: Turn) -> tuple[list[int] | None, list[int] | None]:
    """vLLM's `return_token_ids`: (the prompt's token ids, the choice's), each None where the request did not ask."""
    return (turn.prompt_ids, turn.response_ids) if turn.settings.return_token_ids else (None, None)


def chat_reply(turns: list[Turn], model: str) -> dict:
    """A chat.completion object with one choice per turn (the request's n), with every key of vLLM's (null where rlx
    has nothing: service_tier, system_fingerprint, kv_transfer_params, ...; the prompt's token ids and
    prompt_logprobs beside the choices, as vLLM places them)."""
    choices = []
    for index, turn in enumerate(turns):
        message = {**_MESSAGE, **turn.message}
        if message.get("tool_calls") and not message["content"]:  # OpenAI's: no text beside the calls is null
            message["content"] = None
        logprobs = _chat_logprobs(turn.span()) if turn.settings.logprobs else None
        choices.append({"index": index, "message": message, "logprobs": logprobs,
                        "finish_reason": chat_finish_reason(turn), "stop_reason": turn.stop_reason,
                        "token_ids": _ids(turn)[1], "routed_experts": None})  # fmt: skip
    return {**_head(turns[0], "chat.completion", model), "choices": choices, "service_tier": None,
            "system_fingerprint": None, "usage": {**_usage(turns), "prompt_tokens_details": None},
            "prompt_logprobs": _prompt_field(turns[0]), "prompt_token_ids": _ids(turns[0])[0], "prompt_text": None,
            "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}  # fmt: skip


def completion_reply(turns: list[Turn], model: str) -> dict:
    """A text_completion object with one choice per turn (the request's n), with every key of vLLM's (the prompt's
    token ids and prompt_logprobs in each choice, as vLLM places them; null where rlx has nothing)."""
    choices = []
    for index, turn in enumerate(turns):
        settings, logprobs = turn.settings, None
        if settings.logprobs:
            logprobs = _completion_logprobs(
                turn.span(), settings, prompt=turn.prompt if settings.echo_logprobs else None
            )
        prompt_ids, ids = _ids(turn)
        choices.append({"index": index, "text": turn.text, "logprobs": logprobs, "finish_reason": turn.finish_reason,
                        "stop_reason": turn.stop_reason, "token_ids": ids, "prompt_logprobs": _prompt_field(turn),
                        "prompt_token_ids": prompt_ids, "routed_experts": None})  # fmt: skip
    return {**_head(turns[0], "text_completion", model), "choices": choices, "service_tier": None,
            "system_fingerprint": None, "usage": {**_usage(turns), "prompt_tokens_details": None},
            "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}  # fmt: skip


def _usage_so_far(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class StreamedReply:
    """The chunks of one streamed reply, every choice's: what each choice has sent, and each next chunk."""

    def __init__(self, settings: Settings, prompt_ids: list[list[int]], model: str, is_chat: bool,
                 prompts: list[PromptTokens | None] | None = None):  # fmt: skip
        """`prompt_ids`: each choice's context (its prompt's token ids); `prompts`: each choice's context scored
        (a completion with echo and logprobs lists them in its first chunk)."""
        self.settings, self.prompt_ids, self.is_chat = settings, prompt_ids, is_chat
        self.prompts = prompts or [None] * len(prompt_ids)
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
        prompt = self.prompts[index] if settings.echo_logprobs and not self.is_open[index] else None
        if settings.logprobs and (span.ids or prompt is not None):
            if self.is_chat:
                logprobs = _chat_logprobs(span)
            else:
                logprobs = _completion_logprobs(span, settings, self.text_at[index], prompt)
                self.text_at[index] += sum(len(t) for t in logprobs["tokens"])
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
