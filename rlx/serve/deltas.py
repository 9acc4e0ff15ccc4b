"""The text of a reply streamed as its tokens are sampled, never sending what the finished turn takes back.

A choice's text so far is its tokens decoded (special tokens skipped, as the finished turn's text is). What is sent
is the longest start of it that the finished reply's content must begin with: it stops before a stop string or a
tool-call block (the finished turn cuts the first, and moves the second into `tool_calls`), holds back a tail that
may be the start of one, and an incomplete UTF-8 character. Where tool calls are read, trailing whitespace waits too
(a reply with tool calls has its content stripped), and a reply that begins with whitespace is sent only once
finished (stripped or not depends on calls not yet sampled). When the turn finishes, the rest of its content
follows, so the pieces always add up to the reply's content exactly.

`held_back` is the start of a text that more tokens cannot change (tool calls are read from it too: tool_stream.py);
`covered` says which of the sampled tokens a sent text was written with (a streamed chunk carries their logprobs);
`token_pieces` cuts a finished reply's content where its tokens' texts end.
"""

from __future__ import annotations

from collections.abc import Callable

TOOL_CALL_OPEN = "<tool_call>"
"""Where a tool-call block begins in the text (every parser of rlx.chat.tool_calls reads such blocks)."""


class TextDeltas:
    """What of one choice's text has been sent, and what may be sent next."""

    def __init__(self, markers: tuple[str, ...], hold_whitespace: bool):
        """`markers`: strings the finished content ends before (stop strings, the tool-call opening);
        `hold_whitespace`: tool calls are read (content around them is stripped)."""
        self.markers, self.hold_whitespace = tuple(m for m in markers if m), hold_whitespace
        self.sent = ""
        self.is_closed = False
        """A marker (or leading whitespace under `hold_whitespace`) was seen: nothing more until the turn ends."""

    def feed(self, text: str) -> str:
        """The next piece to send, given the choice's whole text so far ('' when nothing more is safe yet)."""
        if self.is_closed:
            return ""
        safe = self._safe(text)
        if not safe.startswith(self.sent):  # cannot happen for a decoded prefix; never send what contradicts
            self.is_closed = True
            return ""
        piece, self.sent = safe[len(self.sent) :], safe
        return piece

    def finish(self, content: str) -> str:
        """The rest of the finished reply's `content` (what was sent is always its start)."""
        return content[len(self.sent) :] if content.startswith(self.sent) else ""

    def _safe(self, text: str) -> str:
        if self.hold_whitespace and text[:1].isspace():
            self.is_closed = True
            return self.sent
        text, found = held_back(text, self.markers)
        self.is_closed = found
        return text.rstrip() if self.hold_whitespace else text


def held_back(text: str, markers: tuple[str, ...]) -> tuple[str, bool]:
    """The start of `text` that more tokens cannot change: up to the first of `markers` (and whether one was found),
    less a tail that may become one and an incomplete UTF-8 character (it decodes as U+FFFD until its last byte)."""
    end, found = len(text.rstrip("\ufffd")), False
    for marker in markers:
        at = text.find(marker)
        if at >= 0:
            found, end = True, min(end, at)
    text = text[:end]
    for marker in markers:  # a tail that may become a marker waits
        for size in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:size]):
                text = text[:-size]
                break
    return text, found


def covered(decode: Callable[[list[int]], str], ids: list[int], start: int, text: str) -> int:
    """How many of `ids` (at least `start`, which must decode to a start of `text`) decode to a start of `text`: the
    tokens a text sent so far was written with. A binary search over the prefixes (their text grows with them;
    an incomplete UTF-8 character decodes as U+FFFD, and the token that completes it belongs with it)."""

    def fits(k: int) -> bool:
        return text.startswith(decode(ids[:k]).rstrip("\ufffd"))

    low, high = start, len(ids)
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    while low > start and not text.startswith(decode(ids[:low])):  # a character not complete in the text
        low -= 1
    return low


def token_pieces(content: str, token_texts: list[str]) -> list[tuple[str, int, int]] | None:
    """`content` cut where its tokens' texts (each decoded alone) end, each piece with the tokens [start, end) that
    wrote it (a token of no text goes with the next piece), when it is their texts' start; else None."""
    if not "".join(token_texts).startswith(content):
        return None
    pieces, at, start = [], 0, 0
    for i, text in enumerate(token_texts):
        if at >= len(content):
            break
        piece, at = content[at : at + len(text)], at + len(text)
        if piece:
            pieces.append((piece, start, i + 1))
            start = i + 1
    return pieces
