"""Chat-template renders without Jinja, for messages whose text fields the template only pastes in.

A turn's new messages (a tool result, a user message) usually differ from earlier turns' only in their
text: the content, a tool call id. A message list's *shape* is everything else (roles, field names,
non-text values). Per shape the template is rendered once with probe texts in place of the real ones:
str subclasses that record any look at their characters (comparisons, `in`, length, truthiness, indexing,
methods such as strip or split, formatting, str() outside the template's own output). Concatenation
gives another probe, so text built from a probe is watched too. If nothing looked, and three probe sets
(plain; with edge whitespace, quotes, a backslash and non-ASCII; numeric) render to the same text around
the probes, the template's control flow and output cannot depend on the texts: a later render of that
shape is the `Frame`'s pieces with the real texts pasted in. Operations that read a string's characters
in C without calling the probe (json.dumps, int()) are not recorded; the numeric and escaping probe sets
make such templates render differently per set, and they keep the full render. So do templates that look
at a text (Qwen3's `</think>` split of assistant content, `| trim`) and shapes with non-plain values.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass

ROLE = "role"
MAX_SHAPES = 256
"""Shapes remembered per template state; later new shapes are rendered in full every time."""
# Each set is a function of the probe's index: plain, one that escaping or stripping changes, a number.
PROBE_SETS = (
    lambda j: f"rlx-probe-{j}-a",
    lambda j: f" \n\"rlx\\probe-{j}\t<é&'>\n ",
    lambda j: f"9{j:03d}7319046285",
)
_TEMPLATE_FILE = "<template>"  # the file name of Jinja code compiled from a string (the template's own output)
_PLAIN = (str, int, float, bool, type(None))


def shape_key(messages: list[dict]) -> str | None:
    """What a render depends on besides the messages' text fields; None when a message is not a plain dict."""
    shape = []
    for message in messages:
        if type(message) is not dict or not is_plain(message):
            return None
        shape.append([(k, v) if k == ROLE or type(v) is not str else (k,) for k, v in message.items()])
    return repr(shape)


def text_values(messages: list[dict]) -> list[str]:
    """The texts a frame pastes in, in the order `shape_key` leaves them out."""
    return [v for m in messages for k, v in m.items() if k != ROLE and type(v) is str]


def is_plain(value) -> bool:
    if type(value) in _PLAIN:
        return True
    if type(value) in (list, tuple):
        return all(is_plain(v) for v in value)
    if type(value) is dict:
        return all(type(k) is str and is_plain(v) for k, v in value.items())
    return False


@dataclass(frozen=True)
class Frame:
    """The text of (anchor + messages) of one shape: `pieces[0] + texts[order[0]] + pieces[1] + ...`."""

    anchor: int
    """Index of the anchor conversation the messages follow."""
    pieces: tuple[str, ...]
    order: tuple[int, ...]
    """Which text goes after each piece but the last (a text may be pasted any number of times)."""
    cut: int = 0
    """Length of the anchor's text when the tokens of the rest are its own (a token cut), else 0."""

    def text(self, texts: list[str]) -> str:
        parts = [self.pieces[0]]
        for j, piece in zip(self.order, self.pieces[1:]):
            parts += (texts[j], piece)
        return "".join(parts)


def probe_frame(render: Callable[[list[dict]], str], messages: list[dict], anchor: int) -> Frame | None:
    """Split the render of `messages` (after anchor `anchor`, which `render` adds) around their text fields;
    None when the template looks at a text or renders the probe sets differently. `render` may raise: when
    every set raises (the anchor does not fit the template) the first error is re-raised, when some do, None."""
    frames, errors = [], []
    for make in PROBE_SETS:
        looked: list[str] = []
        texts = [make(j) for j in range(len(text_values(messages)))]
        probes = iter(_probe_class(looked)(t) for t in texts)
        probed = [{k: next(probes) if k != ROLE and type(v) is str else v for k, v in m.items()} for m in messages]
        try:
            rendered = render(probed)
        except Exception as e:  # re-raised below when every set fails
            errors.append(e)
            rendered = None
        if looked:
            return None
        if rendered is not None:
            frames.append(_split(rendered, texts, anchor))
    if errors:
        if len(errors) < len(PROBE_SETS):
            return None
        raise errors[0]
    return frames[0] if all(f == frames[0] for f in frames[1:]) else None


def _split(rendered: str, texts: list[str], anchor: int) -> Frame:
    if not texts:
        return Frame(anchor, (rendered,), ())
    at = {t: j for j, t in enumerate(texts)}
    pattern = re.compile("|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True)))
    pieces, order, end = [], [], 0
    for match in pattern.finditer(rendered):
        pieces.append(rendered[end : match.start()])
        order.append(at[match.group()])
        end = match.end()
    pieces.append(rendered[end:])
    return Frame(anchor, tuple(pieces), tuple(order))


def _probe_class(looked: list[str]) -> type[str]:
    """A str subclass whose instances append to `looked` whatever reads their characters."""

    class Probe(str):
        def __add__(self, other):
            if not isinstance(other, str):
                return NotImplemented
            return Probe(str.__str__(self) + str.__str__(other))

        def __radd__(self, other):
            if not isinstance(other, str):
                return NotImplemented
            return Probe(str.__str__(other) + str.__str__(self))

        def __str__(self):
            if sys._getframe(1).f_code.co_filename != _TEMPLATE_FILE:  # e.g. `~` or `| join`: text leaves the probe
                looked.append("__str__")
            return str.__str__(self)

        def __getattribute__(self, name):
            if not name.startswith("__"):
                looked.append(name)
            return str.__getattribute__(self, name)

        def __bool__(self):
            looked.append("__bool__")
            return bool(str.__len__(self))

    for name in _READS:
        setattr(Probe, name, _recorded(name, looked))
    return Probe


_READS = (
    "__len__", "__contains__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__hash__",
    "__getitem__", "__iter__", "__mul__", "__rmul__", "__mod__", "__rmod__", "__format__", "__repr__",
)  # fmt: skip
"""str's methods that read the characters (or compare, hash or format them), recorded on a probe."""


def _recorded(name: str, looked: list[str]):
    def method(self, *args, **kwargs):
        looked.append(name)
        return getattr(str, name)(self, *args, **kwargs)

    return method
