"""Token-exact multi-turn trajectories: the model's sampled tokens kept verbatim, inserted tokens masked.

A trajectory holds one sample's opening prompt ids, then every later token in order: the model's
sampled tokens (loss_mask 1, with the sampler's logprobs) and tokens rlx inserted (loss_mask 0,
logprob 0): the end of an assistant turn the model did not generate (the newline after <|im_end|>),
the template tokens of the environment's reply messages, and the next generation prompt.

The template tokens of new messages are found without re-rendering the conversation: they are
render(anchor + new) minus render(anchor), for a fixed anchor conversation, checked to be a
prefix-extension. Re-rendering the real history would be wrong for templates that rewrite it
(Qwen3 drops earlier <think> blocks once a new user message follows), and would re-tokenise the
model's text.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from rlx.engine.rollout.prompts import has_chat_template
from rlx.errors import UserError

_SYSTEM = {"role": "system", "content": "rlx"}
_USER = {"role": "user", "content": "rlx"}
_ASSISTANT = {"role": "assistant", "content": "rlx"}
# Fixed conversations the new messages are rendered after, tried in order: ending with a user turn
# (nothing in it depends on what follows in the templates we know), without a system turn (templates
# that refuse one), then ending with an assistant turn (templates that insist on alternating roles).
_ANCHORS = ([_SYSTEM, _USER], [_USER], [_SYSTEM, _USER, _ASSISTANT], [_USER, _ASSISTANT])
_CONTENT_MARK = "rlx-content-mark"


class ChatRenderer:
    """Token ids of chat messages under a tokenizer's chat template, with one sample's tools."""

    def __init__(self, tokenizer, stop_ids: set[int], tools: list[dict] | None = None, template_kwargs=None):
        if not has_chat_template(tokenizer):
            raise UserError(
                "multi-turn rollouts need a tokenizer with a chat template (this one has none): "
                "set tokenizer.chat_template in the model's tokenizer_config.json"
            )
        self.tokenizer, self.stop_ids, self.tools = tokenizer, set(stop_ids), tools
        self.template_kwargs = dict(template_kwargs or {})
        self._anchor_cache: dict[int, list[int]] = {}

    def render_text(self, messages: list[dict], add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tools=self.tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **self.template_kwargs,
            )
        except Exception as e:  # jinja errors, raise_exception() in templates
            roles = ",".join(str(m.get("role")) for m in messages)
            problem = f"{type(e).__name__}: {e}"
            raise UserError(f"the chat template failed on messages with roles [{roles}]: {problem}") from None

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def render_ids(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        return self.encode(self.render_text(messages, add_generation_prompt))

    def opening_ids(self, messages: list[dict]) -> list[int]:
        """The first prompt: the messages and the generation prompt of the first assistant turn."""
        ids = self.render_ids(messages, add_generation_prompt=True)
        if not ids:
            raise UserError("the chat template renders the opening messages as no tokens")
        return ids

    def message_ids(self, messages: list[dict]) -> list[int]:
        """The template tokens of `messages` followed by the next assistant turn's generation prompt."""
        problem = "they do not extend the conversation before them"
        for i, anchor in enumerate(_ANCHORS):
            try:
                if i not in self._anchor_cache:
                    self._anchor_cache[i] = self.render_ids(anchor, add_generation_prompt=False)
                base = self._anchor_cache[i]
                full = self.render_ids([*anchor, *messages], add_generation_prompt=True)
            except UserError as e:  # this template refuses this anchor: try the next
                problem = str(e)
                continue
            if full[: len(base)] == base:
                return full[len(base) :]
        roles = ",".join(str(m.get("role")) for m in messages)
        raise UserError(f"cannot add messages with roles [{roles}] token-exactly: {problem}")

    @functools.cached_property
    def closing_ids(self) -> list[int]:
        """The template tokens after an assistant message's content (e.g. `<|im_end|>` and a newline)."""
        mark = {"role": "assistant", "content": _CONTENT_MARK}
        text = ""
        for anchor in (a for a in _ANCHORS if a[-1] is _USER):
            try:
                text = self.render_text([*anchor, mark], add_generation_prompt=False)
                break
            except UserError:
                continue
        at = text.rfind(_CONTENT_MARK)
        if at < 0:
            raise UserError("the chat template does not write an assistant message's content; cannot end turns")
        return self.encode(text[at + len(_CONTENT_MARK) :])

    def turn_end_ids(self, turn_ids: list[int]) -> list[int]:
        """The tokens that end an assistant turn in the template but were not generated after `turn_ids`:
        after a stop token the rest of the closing (the newline after <|im_end|>), else all of it."""
        closing = self.closing_ids
        if turn_ids and closing and turn_ids[-1] in self.stop_ids and closing[0] in self.stop_ids:
            return closing[1:]
        return closing


@dataclass
class Trajectory:
    """One sample's tokens in order, which of them the model generated, and the conversation so far."""

    prompt_ids: list[int]
    """The opening prompt: the environment's first messages and the first generation prompt."""
    messages: list[dict]
    """The conversation (role, content, tool_calls)."""
    response_ids: list[int] = field(default_factory=list)
    """Every token after the prompt: model turns and inserted tokens, in order."""
    loss_mask: list[int] = field(default_factory=list)
    """1 on tokens the model generated, 0 on inserted ones; same length as response_ids."""
    rollout_logprobs: list[float] = field(default_factory=list)
    """The sampler's logprob of each model token, 0 on inserted ones."""
    num_turns: int = 0
    """Assistant turns generated."""

    def add_model_turn(self, ids: list[int], logprobs: list[float]) -> None:
        if len(ids) != len(logprobs):
            raise ValueError(f"a model turn has {len(ids)} tokens but {len(logprobs)} logprobs")
        self.response_ids += ids
        self.loss_mask += [1] * len(ids)
        self.rollout_logprobs += [float(x) for x in logprobs]
        self.num_turns += 1

    def add_inserted(self, ids: list[int]) -> None:
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)
        self.rollout_logprobs += [0.0] * len(ids)

    @property
    def num_tokens(self) -> int:
        """The whole context: prompt and response tokens."""
        return len(self.prompt_ids) + len(self.response_ids)

    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def to_json(self) -> dict:
        return {
            "prompt_ids": self.prompt_ids,
            "response_ids": self.response_ids,
            "loss_mask": self.loss_mask,
            "rollout_logprobs": self.rollout_logprobs,
            "messages": self.messages,
            "num_turns": self.num_turns,
        }
