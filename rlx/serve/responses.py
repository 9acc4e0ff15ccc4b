"""OpenAI's Responses API (`POST /v1/responses`) on top of the chat path: text, function tools, images, and either
`previous_response_id` or the full input.

A request's `instructions` and `input` items become chat messages (`to_chat`): a string is a user message;
message items keep their role (`developer` reads as `system`) with `input_text`/`output_text`/`input_image` parts;
`function_call` items become the assistant message's tool calls and `function_call_output` items tool messages.
With `previous_response_id`, the messages of that response (its input and its reply, as recorded) come first, and
the request continues the same sample. The chat request then runs as any other (same segment rules, so a
conversation continued either way extends its trajectory token-exactly) and its reply becomes a `response`
object whose output holds a message item and one `function_call` item per tool call.
With `stream: true` the reply is the Responses API's server-sent events: created, in progress, the message's text
and each function call (its item, then its arguments in pieces) as the engine samples them (live.py, as chat
completions stream them: tool_stream.py reads the calls), then what was not streamed, the done events and
`response.completed` (or `response.incomplete` when cut at max_output_tokens); the turn is recorded as without
`stream`.
Refused with HTTP 400 naming the field: non-function tools, structured text formats, reasoning, truncation other
than 'disabled', and every field the Responses API does not define.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from rlx.serve.api import RequestError, refuse
from rlx.serve.replies import Turn

MAX_STORED = 10000
"""Responses kept for `previous_response_id` (the oldest dropped first)."""
_FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "previous_response_id", "max_output_tokens",
           "temperature", "top_p", "stream", "store", "metadata", "user", "parallel_tool_calls", "text",
           "truncation", "reasoning", "include", "service_tier", "safety_identifier", "prompt_cache_key"}  # fmt: skip
_NEUTRAL = {"stream": (None, False, True), "text": (None, {"format": {"type": "text"}}),
            "truncation": (None, "disabled"), "reasoning": (None,), "include": (None, [])}  # fmt: skip
_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponseStore:
    """The recorded responses: id -> (sample id, the chat messages so far including the reply)."""

    def __init__(self, limit: int = MAX_STORED):
        self.limit, self._items, self._lock = limit, OrderedDict(), threading.Lock()

    def get(self, response_id: str) -> tuple[str, list[dict]]:
        with self._lock:
            found = self._items.get(response_id)
        if found is None:
            raise RequestError(
                404, f"no response {response_id!r:.80} is kept here", "not_found", "previous_response_id"
            )
        return found

    def put(self, response_id: str, sample: str, messages: list[dict]) -> None:
        with self._lock:
            self._items[response_id] = (sample, messages)
            while len(self._items) > self.limit:
                self._items.popitem(last=False)


def _check_fields(body: dict) -> None:
    for name in body:
        if name not in _FIELDS:
            raise refuse(name, "not a field of the Responses API this endpoint takes")
    for name, allowed in _NEUTRAL.items():
        if name in body and body[name] not in allowed:
            raise refuse(name, f"only {' or '.join(repr(a) for a in allowed if a is not None)} is supported here")


def _parts(content, where: str):
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(400, f"{where}: content must be a string or a list of parts", param="input")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image":
            parts.append({"type": "image_url", "image_url": {"url": part.get("image_url")}})
        else:
            raise refuse("input", f"{where}: parts of type {kind!r} are not supported (input_text, input_image)")
    return parts


def _items_to_messages(items, messages: list[dict]) -> None:
    """Append the chat messages of Responses input `items` to `messages`."""
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
        return
    if not isinstance(items, list) or not items and not messages:
        raise RequestError(400, "'input' must be a string or a non-empty list of items", param="input")
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ("user", "assistant", "system", "developer"):
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": _parts(item.get("content"), f"input item {i}")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}  # fmt: skip
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output")})
        else:
            raise refuse("input", f"input item {i}: items of type {kind!r} are not supported")


def _tools(tools) -> list[dict] | None:
    if not tools:
        return None
    out = []
    for tool in tools if isinstance(tools, list) else [None]:
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise refuse("tools", "only function tools ({'type': 'function', 'name': ..., 'parameters': ...})")
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def to_chat(body: dict, store: ResponseStore) -> tuple[dict, str | None]:
    """(a chat-completions body, the sample of `previous_response_id` or None) for a Responses request body."""
    _check_fields(body)
    messages, sample = [], None
    if body.get("previous_response_id") is not None:
        sample, earlier = store.get(str(body["previous_response_id"]))
        messages = [dict(m) for m in earlier]
    elif isinstance(body.get("instructions"), str):
        messages.append({"role": "system", "content": body["instructions"]})
    _items_to_messages(body.get("input"), messages)
    chat = {"messages": messages}
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    renamed = {"max_output_tokens": "max_tokens"}
    for key in ("model", "tool_choice", "max_output_tokens", "temperature", "top_p", "store", "metadata", "user",
                "parallel_tool_calls", "service_tier", "safety_identifier", "prompt_cache_key"):  # fmt: skip
        if body.get(key) is not None:
            chat[renamed.get(key, key)] = body[key]
    return chat, sample


def response_object(turn: Turn, model: str, previous: str | None) -> dict:
    """The `response` object of a chat turn."""
    message, output = turn.message, []
    cut = turn.finish_reason == "length"
    if message.get("content") or not message.get("tool_calls"):  # a message cut at the limit is 'incomplete'
        text = {"type": "output_text", "text": message.get("content") or "", "annotations": []}
        output.append({"type": "message", "id": f"msg_{turn.id}", "role": "assistant",
                       "status": "incomplete" if cut else "completed", "content": [text]})  # fmt: skip
    for call in message.get("tool_calls") or []:
        output.append({"type": "function_call", "id": f"fc_{call['id']}", "call_id": call["id"],
                       "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                       "status": "completed"})  # fmt: skip
    return {
        "id": f"resp_{turn.id}", "object": "response", "created_at": turn.created, "model": model,
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "output": output, "previous_response_id": previous, "error": None,
        "usage": {"input_tokens": len(turn.prompt_ids), "output_tokens": len(turn.response_ids),
                  "total_tokens": len(turn.prompt_ids) + len(turn.response_ids)},
    }  # fmt: skip


def numbered(events: list[tuple[str, dict]], first: int = 0) -> list[dict]:
    """(type, fields) pairs as event objects numbered from `first`."""
    return [{"type": kind, "sequence_number": first + i, **fields} for i, (kind, fields) in enumerate(events)]


def start_events(response: dict) -> list[tuple[str, dict]]:
    """`response.created` and `response.in_progress`, with the response as it stands before any output."""
    started = {**response, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    return [("response.created", {"response": started}), ("response.in_progress", {"response": started})]


def message_opening(index: int, item_id: str) -> list[tuple[str, dict]]:
    """A message output item and its text part, added before their text."""
    item = {"type": "message", "id": item_id, "role": "assistant", "status": "in_progress", "content": []}
    part = {"type": "output_text", "text": "", "annotations": []}
    ids = {"item_id": item_id, "output_index": index, "content_index": 0}
    return [("response.output_item.added", {"output_index": index, "item": item}),
            ("response.content_part.added", {**ids, "part": part})]  # fmt: skip


def text_delta(index: int, item_id: str, piece: str) -> tuple[str, dict]:
    ids = {"item_id": item_id, "output_index": index, "content_index": 0}
    return "response.output_text.delta", {**ids, "delta": piece, "logprobs": []}


def call_opening(index: int, item: dict) -> tuple[str, dict]:
    """A function call's output item, added (with no arguments yet) before its arguments."""
    opening = {**item, "arguments": "", "status": "in_progress"}
    return "response.output_item.added", {"output_index": index, "item": opening}


def arguments_delta(index: int, item_id: str, piece: str) -> tuple[str, dict]:
    return "response.function_call_arguments.delta", {"item_id": item_id, "output_index": index, "delta": piece}


def output_events(response: dict, streamed: dict[str, str] | None = None) -> list[tuple[str, dict]]:
    """The rest of a response's events once it is finished: each output item's text or arguments after what was
    `streamed` of them (item id -> text or arguments sent; an item in it was added already), their done events,
    then `response.completed` (`response.incomplete` when cut)."""
    events: list[tuple[str, dict]] = []
    streamed = streamed or {}
    for index, item in enumerate(response["output"]):
        sent, is_added = streamed.get(item["id"], ""), item["id"] in streamed
        if item["type"] == "message":
            text = item["content"][0]["text"]
            events += [] if is_added else message_opening(index, item["id"])
            rest = text[len(sent) :] if text.startswith(sent) else ""
            events += [text_delta(index, item["id"], rest)] if rest else []
            ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
            events += [("response.output_text.done", {**ids, "text": text, "logprobs": []}),
                       ("response.content_part.done", {**ids, "part": item["content"][0]})]  # fmt: skip
        else:
            events += [] if is_added else [call_opening(index, item)]
            arguments = item["arguments"]
            rest = arguments[len(sent) :] if arguments.startswith(sent) else ""
            events += [arguments_delta(index, item["id"], rest)] if rest else []
            ids = {"item_id": item["id"], "output_index": index}
            events.append(("response.function_call_arguments.done", {**ids, "name": item["name"],
                                                                     "arguments": arguments}))  # fmt: skip
        events.append(("response.output_item.done", {"output_index": index, "item": item}))
    done = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    return [*events, (done, {"response": response})]
