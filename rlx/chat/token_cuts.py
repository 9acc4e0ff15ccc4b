"""Where a tokenizer's ids of a text are the ids of its two parts: a cut before an added token.

A Hugging Face fast tokenizer first cuts the text at its non-normalized added tokens (leftmost-longest
matches), then normalizes, pre-tokenizes and encodes each piece on its own; of the pieces' steps only
Metaspace's prepend_scheme 'first' depends on where a piece lies (at offset 0), and no piece after an
added token lies there. So encode(a + b) == encode(a) + encode(b) when b starts with such a token, no
such token's text in a + b crosses the cut, and no added token strips its neighbours' spaces or must
stand alone as a word (lstrip, rstrip, single_word). Other tokenizers are never cut.
"""

from __future__ import annotations

import re

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast


class TokenCuts:
    """Decides `is_cut(text, at)` for one tokenizer."""

    def __init__(self, tokenizer):
        added = list(getattr(tokenizer, "added_tokens_decoder", {}).values())
        self.is_usable = (
            type(tokenizer).__call__ is PreTrainedTokenizerBase.__call__
            and type(tokenizer)._encode_plus is PreTrainedTokenizerFast._encode_plus
            and not getattr(tokenizer, "split_special_tokens", True)
            and not any(t.lstrip or t.rstrip or t.single_word for t in added)
        )
        texts = sorted({t.content for t in added if not t.normalized and t.content}, key=len, reverse=True)
        self.is_usable = self.is_usable and bool(texts)
        self.longest = len(texts[0]) if texts else 0
        self._pattern = re.compile("|".join(map(re.escape, texts))) if texts else None

    def is_cut(self, text: str, at: int) -> bool:
        """encode(text) == encode(text[:at]) + encode(text[at:]); reads text[at - longest : at + longest] only."""
        if not self.is_usable or at <= 0 or self._pattern.match(text, at) is None:
            return False
        for start in range(max(0, at - self.longest + 1), at):
            match = self._pattern.match(text, start)  # the longest token there: alternatives are longest first
            if match is not None and match.end() > at:
                return False
        return True
