"""Tool calls streamed as they are sampled: each call's name once it is known, then its arguments in pieces.

The calls are the `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks the qwen (hermes) parser reads
(rlx.chat.tool_calls.parse_qwen), sent as vLLM's hermes parser sends them as their tokens come.

The pieces are the finished reply's arguments, not the sampled text: the parser writes the arguments it read with
`json.dumps` (`", "` and `": "` between items, strings escaped its way, numbers as Python writes them), so a JSON
lexer reads each block as it grows and writes every complete token of its arguments, and the known start of a
string, in that form. Their concatenation is the finished call's `arguments` exactly, but where an object repeats a
key: the pieces then hold it twice, as sampled, where the parser kept its last value in the first one's place (both
read as the same object). A block that is no longer a call's JSON stops all sending. A call the finished turn does
not read (the turn cut before `</tool_call>`, another block of it malformed) cannot be taken back: its deltas were
sent, as vLLM's are (live.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
STREAMED_PARSERS = ("qwen", "hermes")
"""The tool parsers (rlx.chat.tool_calls) whose calls are streamed as sampled; others' are sent once generated."""
_PUNCTUATION = {"{": "{", "}": "}", "[": "[", "]": "]", ":": ": ", ",": ", "}
"""Each JSON punctuation token as json.dumps writes it (its default separators)."""
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_OPEN_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*(\\(?:u[0-9a-fA-F]{0,3})?|\\u[dD][89abAB][0-9a-fA-F]{2})\Z")
"""An escape the start of a string ends in that more characters may change: a backslash, `\\u` with fewer than four
digits, or a high surrogate (the low one may follow: JSON then reads one character)."""
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_START = re.compile(r"[-+.eE0-9]*")
_AFTER_VALUE = ",}] \t\n\r"
_WHITESPACE = " \t\n\r"


@dataclass
class CallDelta:
    """What one streamed call sends next: its name (its first delta), or a piece of its arguments."""

    number: int
    """The call's place among the reply's calls."""
    name: str | None
    arguments: str
    end: int
    """How much of the reply's text the deltas up to this one were read from (their tokens go with them)."""


@dataclass
class _Block:
    """One `<tool_call>` block being read."""

    at: int
    """The next character to read (in the reply's text)."""
    stack: list[str] = field(default_factory=list)
    """The JSON containers open there ('{' or '[')."""
    expect: str = "value"
    """What may come next: 'value', 'value_or_close', 'key', 'key_or_close', 'colon' or 'next' (',' or a close)."""
    key: str | None = None
    """The call object's key whose value comes next."""
    name: str | None = None
    name_end: int = 0
    is_named: bool = False
    """The name delta was sent."""
    has_arguments: bool = False
    in_arguments: bool = False
    arguments: str = ""
    """The arguments' complete tokens so far, as json.dumps writes them."""
    partial: str = ""
    """The known start of the string being sampled in the arguments, as json.dumps writes it."""
    sent: str = ""
    read_end: int = 0
    is_done: bool = False
    """The call's JSON object is complete."""
    is_closed: bool = False
    """`</tool_call>` followed it."""


class CallStream:
    """The tool-call deltas of one choice's reply, fed its text as it grows."""

    def __init__(self):
        self.blocks: list[_Block] = []
        self.is_stopped = False
        """A block stopped being a call's JSON: nothing more is sent."""
        self._search_from = 0
        self._seen = ""
        """The text read so far: a later text must begin with it."""

    def feed(self, text: str) -> list[CallDelta]:
        """The deltas the reply's text so far allows beyond those sent (it must extend the text fed before, and hold
        back nothing but a stop string and what follows it)."""
        deltas: list[CallDelta] = []
        if not text.startswith(self._seen):  # the decoded text changed what was read (a tokenizer's clean-up)
            self.is_stopped = True
        while not self.is_stopped:
            if not self.blocks or self.blocks[-1].is_closed:
                opening = text.find(CALL_OPEN, self._search_from)
                if opening < 0:
                    break
                self.blocks.append(_Block(opening + len(CALL_OPEN)))
            block = self.blocks[-1]
            self._read(block, text)
            if self.is_stopped:
                break
            deltas += self._deltas(block, len(self.blocks) - 1)
            if not block.is_closed:
                break
        self._seen = text[: max(self._search_from, self.blocks[-1].at if self.blocks else 0)]
        return deltas

    def _read(self, block: _Block, text: str) -> None:
        """Read `block` as far as the text allows: to its `</tool_call>`, or to the end but a tail that may begin it."""
        close = text.find(CALL_CLOSE, block.at)
        limit = close if close >= 0 else len(text) - _tail_of(text, CALL_CLOSE)
        visible, block.partial = text[:limit], ""
        while not block.is_done and not self.is_stopped:
            token_end = block.at
            while block.at < limit and text[block.at] in _WHITESPACE:
                block.at += 1
            if block.read_end == token_end:  # whitespace after what was sent is read with it
                block.read_end = block.at
            if block.at >= limit:
                break
            kind, raw, end = _token(visible, block.at)
            if kind == "more":
                self.is_stopped = not self._take_start(block, raw, end)
                break
            self.is_stopped = kind == "bad" or not self._take(block, kind, raw, end)
            block.at = end
        if self.is_stopped:
            return
        if block.is_done and text[block.at : limit].strip(_WHITESPACE):
            self.is_stopped = True  # text after the call's JSON inside its block: not a call
        elif close >= 0:
            self.is_stopped = not block.is_done  # closed before its JSON was complete
            block.is_closed, self._search_from = True, close + len(CALL_CLOSE)

    @staticmethod
    def _take_start(block: _Block, raw: str, end: int) -> bool:
        """The start of a token that may go on (`raw`: a string's, up to `end`); False where it is not JSON."""
        if not (block.in_arguments and raw):
            return True
        try:
            block.partial = _canonical("string", raw + '"')[:-1]
        except ValueError:
            return False
        block.read_end = end
        return True

    @staticmethod
    def _take(block: _Block, kind: str, raw: str, end: int) -> bool:
        """One complete JSON token of `block`'s call; False where it cannot be one of a call's JSON."""
        try:
            canonical = _canonical(kind, raw)
        except ValueError:  # not JSON: a control character in a string, a bad escape
            return False
        depth, is_key = len(block.stack), block.expect in ("key", "key_or_close") and kind == "string"
        starts_value = block.expect in ("value", "value_or_close") and kind != "]"
        if depth == 0 and kind != "{":
            return False  # the call must be a JSON object
        if depth == 1 and is_key:
            block.key = json.loads(raw)
        elif depth == 1 and starts_value and block.key == "name" and block.name is None:
            if kind != "string" or not json.loads(raw):
                return False
            block.name, block.name_end = json.loads(raw), end
        elif depth == 1 and starts_value and block.key == "arguments" and not block.has_arguments:
            block.has_arguments, block.in_arguments = True, kind == "{"  # a string of JSON is read once finished
        if block.in_arguments:
            block.arguments, block.read_end = block.arguments + canonical, end
        if not _step(block, kind):
            return False
        block.in_arguments = block.in_arguments and len(block.stack) > 1
        return True

    @staticmethod
    def _deltas(block: _Block, number: int) -> list[CallDelta]:
        """What `block` sends now: its name once known, then the arguments written since."""
        if block.name is None:
            return []
        deltas = []
        if not block.is_named:
            block.is_named = True
            deltas.append(CallDelta(number, block.name, "", block.name_end))
        written = block.arguments + block.partial
        if len(written) > len(block.sent) and written.startswith(block.sent):
            end = block.at if block.is_done else max(block.read_end, block.name_end)  # done: the call's JSON is read
            deltas.append(CallDelta(number, None, written[len(block.sent) :], end))
            block.sent = written
        return deltas


def _tail_of(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (but is not all of it)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


def _token(text: str, at: int) -> tuple[str, str, int]:
    """The JSON token at text[at] (not whitespace): (kind, its text, where it ends). Kind 'more' where it may go on
    past the text (its text: a string's start up to an escape that more characters may change), 'bad' where it
    cannot be JSON; else '{', '}', '[', ']', ':', ',', 'string', 'number' or 'literal'."""
    char = text[at]
    if char in _PUNCTUATION:
        return char, char, at + 1
    if char == '"':
        match = _STRING.match(text, at)
        if match:
            return "string", match.group(), match.end()
        cut = len(text)
        while escape := _OPEN_ESCAPE.search(text, at + 1, cut):  # a high surrogate may wait before a cut escape
            cut = escape.start(1)
        return "more", text[at:cut], cut
    if char in "-0123456789":
        match = _NUMBER.match(text, at)
        if match and match.end() < len(text) and text[match.end()] in _AFTER_VALUE:
            return "number", match.group(), match.end()
        return ("more", "", at) if _NUMBER_START.fullmatch(text, at) else ("bad", "", at)
    for literal in ("true", "false", "null"):
        if text.startswith(literal, at):
            return "literal", literal, at + len(literal)
        if literal.startswith(text[at:]):
            return "more", "", at
    return "bad", "", at


def _canonical(kind: str, raw: str) -> str:
    """A complete token as json.dumps writes the value it reads to (ValueError where it is not JSON)."""
    if kind in ("string", "number"):
        return json.dumps(json.loads(raw), ensure_ascii=False)
    return _PUNCTUATION.get(kind, raw)


def _step(block: _Block, kind: str) -> bool:
    """Move `block`'s JSON grammar past a token of `kind`; False where the token cannot come there."""
    expect, top = block.expect, block.stack[-1] if block.stack else None
    if expect == "colon":
        block.expect = "value"
        return kind == ":"
    if expect in ("key", "key_or_close") and kind == "string":
        block.expect = "colon"
        return True
    closes = (expect == "key_or_close" and kind == "}") or (expect == "value_or_close" and kind == "]")
    closes = closes or (expect == "next" and (top, kind) in (("{", "}"), ("[", "]")))
    if closes:
        block.stack.pop()
    elif expect == "next" and kind == ",":
        block.expect = "key" if top == "{" else "value"
        return True
    elif expect in ("value", "value_or_close") and kind in ("{", "["):
        block.stack.append(kind)
        block.expect = "key_or_close" if kind == "{" else "value_or_close"
        return True
    elif expect not in ("value", "value_or_close") or kind not in ("string", "number", "literal"):
        return False
    block.expect, block.is_done = "next", not block.stack  # a value ended
    return True
