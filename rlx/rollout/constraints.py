"""Grammar-constrained sampling: a request whose tokens must follow a grammar (rlx serve's response_format).

`Grammars` compiles JSON schemas with llguidance (the optional extra `rlx[grammar]`; its tokenizer view is built
once per tokenizer) into a `GrammarConstraint` per request. An engine that honours TokenRequest.constraint (hf,
native) masks the logits of that request's row to the tokens the grammar allows before it samples, and tells the
constraint each token it sampled. The logprobs it reports are then those of the masked distribution (what was
sampled from), not the policy's: such turns are not on-policy data, which is why `rlx rollout --agent` refuses them.
Once the grammar is complete only the model's stop tokens remain allowed. JSON is laid out as json.dumps does
(", " and ": ", no other whitespace).
"""

from __future__ import annotations

import json

import torch

from rlx.errors import UserError

EXTRA = "pip install 'rlx[grammar]' (llguidance)"
"""How to get the library constrained sampling needs."""


def grammar_library_available() -> bool:
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON laid out as json.dumps does, with no other whitespace: a model cannot pad a reply with whitespace until it
runs out of tokens (a schema's own "x-guidance" options take precedence)."""


class GrammarConstraint:
    """One request's grammar state: which tokens may come next, advanced by each sampled token."""

    def __init__(self, matcher, vocab_size: int, stop_ids: list[int]):
        self.matcher, self.vocab_size, self.stop_ids = matcher, vocab_size, stop_ids
        self.words = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)

    def allowed(self) -> torch.Tensor:
        """bool [vocab_size]: the tokens the grammar allows next (the stop tokens where it allows none: a matcher in
        an error state ends the turn rather than sample from nothing)."""
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, self.words)
        bits = (self.words[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # [words, 32]
        allowed = bits.flatten()[: self.vocab_size].bool()
        if not allowed.any():
            allowed[self.stop_ids] = True
        return allowed

    def advance(self, token: int) -> None:
        """Take the sampled `token` (a stop token once the grammar is complete ends it)."""
        if not self.matcher.is_stopped():
            self.matcher.consume_token(token)


def mask_constrained(logits: torch.Tensor, constraints: list[GrammarConstraint | None]) -> torch.Tensor:
    """logits [B, V] with each constrained row's disallowed tokens at -inf (the others unchanged)."""
    if not any(constraints):
        return logits
    allowed = torch.ones(logits.shape, dtype=torch.bool)
    for row, constraint in enumerate(constraints):
        if constraint is not None:
            width = min(constraint.vocab_size, logits.shape[-1])
            allowed[row] = False
            allowed[row, :width] = constraint.allowed()[:width]
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


class Grammars:
    """Compiles the grammars of requests for one tokenizer and vocabulary (the llguidance view of the tokenizer is
    built on first use, about a second)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: set[int]):
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, sorted(stop_ids)
        self._view = None

    def for_json(self, schema: dict | None) -> GrammarConstraint:
        """A constraint to JSON following `schema` (None: any JSON object). UserError for a schema llguidance
        cannot compile (the message names why)."""
        import llguidance

        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema or {"type": "object"}), _LAYOUT)
        except ValueError as e:
            raise UserError(f"the JSON schema cannot be compiled: {e}"[:300]) from None
        return self._constraint(grammar, "the JSON schema")

    def for_tool_call(self, tools: list[dict], block: tuple[str, str]) -> GrammarConstraint:
        """A constraint to one call of one of `tools` (chat-completions function schemas): its JSON object
        ({"name", "arguments" following the tool's parameters}) between `block`'s opening and closing text."""
        import llguidance

        calls = []
        for tool in tools:
            function = tool.get("function") or {}
            arguments = function.get("parameters") or {"type": "object"}
            calls.append({"type": "object", "required": ["name", "arguments"], "additionalProperties": False,
                          "properties": {"name": {"const": function.get("name")}, "arguments": arguments}})  # fmt: skip
        schema = {"anyOf": calls, "x-guidance": _LAYOUT}
        opening, closing = (json.dumps(text) for text in block)  # Lark string literals take JSON's escapes
        lark = f"start: {opening} call {closing}\ncall: %json {json.dumps(schema)}\n"
        return self._constraint(llguidance.LLMatcher.grammar_from_lark(lark), "the tools' call grammar")

    def _constraint(self, grammar: str, what: str) -> GrammarConstraint:
        import llguidance
        import llguidance.hf

        if self._view is None:
            try:
                self._view = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                          eos_token=self.stop_ids)  # fmt: skip
            except ValueError:  # a decoder llguidance does not read (e.g. a word-level one): token by token
                wrapper = llguidance.TokenizerWrapper(_TokenTable(self.tokenizer, self.vocab_size))
                self._view = llguidance.LLTokenizer(wrapper, n_vocab=self.vocab_size, eos_token=self.stop_ids)
        matcher = llguidance.LLMatcher(self._view, grammar, log_level=0)
        if matcher.is_error():
            raise UserError(f"{what} cannot be compiled: {matcher.get_error()}"[:300])
        return GrammarConstraint(matcher, self.vocab_size, self.stop_ids)


class _TokenTable:
    """A tokenizer as llguidance's generic wrapper reads it: each token's bytes (its text decoded alone: exact for
    tokenizers whose tokens are whole characters), the special ones, and encoding."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.eos_token_id, self.bos_token_id = tokenizer.eos_token_id, tokenizer.bos_token_id
        special = set(tokenizer.all_special_ids)
        self.special_token_ids = sorted(special | set(range(len(tokenizer), vocab_size)))
        self.tokens = [
            tokenizer.convert_ids_to_tokens(i).encode() if i in special else tokenizer.decode([i]).encode()
            for i in range(min(len(tokenizer), vocab_size))
        ] + [b"<unused>"] * max(vocab_size - len(tokenizer), 0)

    def __call__(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]
