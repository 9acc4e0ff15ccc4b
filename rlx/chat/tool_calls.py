"""Tool calls read from assistant text, in the form the model's chat template writes them; parsers by name.

A parser turns one assistant turn's decoded text into the assistant message (OpenAI format: `role`,
`content` without the tool-call blocks, `tool_calls` as `{id, type: "function", function: {name,
arguments}}` with `arguments` a JSON string) plus the problems it found. A malformed call is not a
crash: its problem goes back to the model as a tool message (`tool_error_messages`).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from rlx.errors import UserError

_QWEN_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass
class ParsedTurn:
    """One assistant turn as a chat message, and why any of its tool calls could not be read."""

    message: dict
    """{"role": "assistant", "content": str, "tool_calls": [...] (only when there are any)}."""
    errors: list[str] = field(default_factory=list)
    """One line per malformed tool call (empty when every call was read)."""


def call_id(turn: int, index: int) -> str:
    """The id of a turn's index-th tool call: the same in an environment rollout and behind `rlx serve`. `index`
    counts every call the turn wrote, read or not, so a malformed call does not shift the ids of those after it (the
    index `rlx serve` streams a call under before the turn is read: rlx.serve.tool_stream)."""
    return f"call_{turn}_{index}"


def _read_call(body: str, number: int) -> tuple[dict | None, str | None]:
    """(name and arguments, None) for one block's text, or (None, why it is not a tool call)."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return None, f"tool call {number} is not valid JSON ({e.msg} at character {e.pos})"
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None, f'tool call {number} must be a JSON object with a "name" string'
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        return None, f'tool call {number} ("{call["name"]}"): "arguments" must be a JSON object'
    return {"name": call["name"], "arguments": arguments}, None


def parse_qwen(text: str, turn: int) -> ParsedTurn:
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks (Qwen2.5/Qwen3, Hermes)."""
    calls, errors = [], []
    for number, match in enumerate(_QWEN_BLOCK.finditer(text), start=1):
        call, error = _read_call(match.group(1).strip(), number)
        if error:
            errors.append(error)
            continue
        function = {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}
        calls.append({"id": call_id(turn, number - 1), "type": "function", "function": function})
    rest = _QWEN_BLOCK.sub("", text)
    if "<tool_call>" in rest:
        errors.append("a <tool_call> block is not closed with </tool_call>")
        rest = rest[: rest.index("<tool_call>")]
    # without tool calls the text is the content as generated; around calls, the template re-adds the spacing
    message = {"role": "assistant", "content": rest.strip() if calls or errors else text}
    if calls:
        message["tool_calls"] = calls
    return ParsedTurn(message, errors)


def parse_json_list(text: str, turn: int) -> ParsedTurn:
    """`<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>` blocks, each a JSON list of calls (or one
    call), as SmolLM2's instruct templates ask for them."""
    calls, errors, number = [], [], 0
    for match in _QWEN_BLOCK.finditer(text):
        body = match.group(1).strip()
        try:
            items = json.loads(body)
        except json.JSONDecodeError as e:
            number += 1
            errors.append(f"tool call {number} is not valid JSON ({e.msg} at character {e.pos})")
            continue
        for item in items if isinstance(items, list) else [items]:
            number += 1
            call, error = _read_call(json.dumps(item), number)
            if error:
                errors.append(error)
                continue
            function = {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}
            calls.append({"id": call_id(turn, number - 1), "type": "function", "function": function})
    rest = _QWEN_BLOCK.sub("", text)
    if "<tool_call>" in rest:
        errors.append("a <tool_call> block is not closed with </tool_call>")
        rest = rest[: rest.index("<tool_call>")]
    message = {"role": "assistant", "content": rest.strip() if calls or errors else text}
    if calls:
        message["tool_calls"] = calls
    return ParsedTurn(message, errors)


def parse_plain(text: str, turn: int) -> ParsedTurn:
    """No tool calls: the whole text is the content."""
    return ParsedTurn({"role": "assistant", "content": text})


TOOL_CALL_PARSERS: dict[str, Callable[[str, int], ParsedTurn]] = {
    "qwen": parse_qwen,
    "hermes": parse_qwen,
    "smollm2": parse_json_list,
    "none": parse_plain,
}
_LIST_IN_BLOCK = re.compile(r"<tool_call>(?:\s|\\n)*\[")  # a newline may be written as \n in a Jinja string


_CALL_BLOCKS = {  # the block each parser reads around one call's JSON object: (opening, closing) text
    "qwen": ("<tool_call>\n", "\n</tool_call>"),
    "hermes": ("<tool_call>\n", "\n</tool_call>"),
    "smollm2": ("<tool_call>[", "]</tool_call>"),
}


def call_block(parser: str) -> tuple[str, str]:
    """The text the named parser reads around one tool call's JSON object, as a required tool call is sampled in
    it (rlx.rollout.constraints.Grammars.for_tool_call). UserError for a parser that reads no tool calls."""
    if parser not in _CALL_BLOCKS:
        raise UserError(f"the tool parser {parser!r} reads no tool calls, so none can be required")
    return _CALL_BLOCKS[parser]


def parser_for_template(chat_template: str | None) -> str:
    """The parser name for the tool-call form a chat template asks the model for: 'smollm2' where it shows a JSON
    list inside <tool_call> (SmolLM2), else 'qwen' (<tool_call>{json}</tool_call>, also the form read by default)."""
    if isinstance(chat_template, dict):  # a tokenizer's named templates
        chat_template = chat_template.get("tool_use") or chat_template.get("default")
    if isinstance(chat_template, str) and _LIST_IN_BLOCK.search(chat_template):
        return "smollm2"
    return "qwen"


def get_tool_call_parser(name: str, chat_template: str | None = None) -> Callable[[str, int], ParsedTurn]:
    """The parser registered under `name`; 'auto' chooses by `chat_template` (see `parser_for_template`)."""
    if name == "auto":
        name = parser_for_template(chat_template)
    if name not in TOOL_CALL_PARSERS:
        raise UserError(f"unknown tool parser {name!r} (known: auto, {', '.join(TOOL_CALL_PARSERS)})")
    return TOOL_CALL_PARSERS[name]


def tool_error_messages(errors: list[str]) -> list[dict]:
    """The reply to a turn with malformed tool calls: one tool message per problem; no call of that turn ran."""
    return [
        {"role": "tool", "content": f"Error: {error}. No tool call of this message was run; fix it and try again."}
        for error in errors
    ]
