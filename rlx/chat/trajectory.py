"""Token-exact multi-turn trajectories: the model's sampled tokens kept verbatim, inserted tokens masked.

A trajectory holds one sample's opening prompt ids, then every later token in order: the model's
sampled tokens (loss_mask 1, with the sampler's logprobs) and tokens rlx inserted (loss_mask 0,
logprob 0): the end of an assistant turn the model did not generate (the newline after <|im_end|>),
the template tokens of the environment's reply messages, and the next generation prompt.

The template tokens of new messages are found without re-rendering the conversation: they are
render(anchor + new) minus render(anchor), for a fixed anchor conversation, checked to be a
prefix-extension. Re-rendering the real history would be wrong for templates that rewrite it
(Qwen3 drops earlier <think> blocks once a new user message follows), and would re-tokenise the
model's text. A message list whose shape was seen before skips Jinja: its text is the shape's `Frame`
with the new texts pasted in (template_shapes.py says when that is the template's own output).
What a renderer learns about its template is shared by every renderer (one per episode) with the same
tokenizer, template, tools and template arguments.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rlx.chat.template_shapes import MAX_SHAPES, Frame, is_plain, probe_frame, shape_key, text_values
from rlx.chat.token_cuts import TokenCuts
from rlx.errors import UserError
from rlx.rollout.prompts import has_chat_template

if TYPE_CHECKING:
    import torch

_SYSTEM = {"role": "system", "content": "rlx"}
_USER = {"role": "user", "content": "rlx"}
_ASSISTANT = {"role": "assistant", "content": "rlx"}
# Fixed conversations the new messages are rendered after, tried in order: ending with a user turn
# (nothing in it depends on what follows in the templates we know), without a system turn (templates
# that refuse one), then ending with an assistant turn (templates that insist on alternating roles).
_ANCHORS = ([_SYSTEM, _USER], [_USER], [_SYSTEM, _USER, _ASSISTANT], [_USER, _ASSISTANT])
_CONTENT_MARK = "rlx-content-mark"
_MAX_STATES = 64
"""Template states kept per tokenizer (one per distinct tools list and template arguments)."""


@dataclass
class _TemplateState:
    """What renderers learn about one tokenizer + template + tools + template arguments."""

    anchor_ids: dict[int, list[int]] = field(default_factory=dict)
    """Tokens of each anchor conversation that renders."""
    closing_ids: list[int] | None = None
    frames: dict[str, Frame | None] = field(default_factory=dict)
    """Per message shape: its frame, or None when the template must render it."""
    cuts: TokenCuts | None = None


_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_STATES_LOCK = threading.Lock()  # the server's samples make renderers from several threads


def _shared_state(tokenizer, tools, template_kwargs: dict) -> _TemplateState:
    """The state shared with earlier renderers of the same key; a private one when the key cannot be trusted
    (tools or template arguments that are not plain data, whose repr need not identify them)."""
    if not (is_plain(tools) and is_plain(template_kwargs)):
        return _TemplateState()
    try:
        template = tokenizer.get_chat_template(None, tools)
    except Exception:  # no template for these tools: render_text reports it when used
        return _TemplateState()
    key = repr((template, tools, template_kwargs, tokenizer.special_tokens_map, len(tokenizer)))
    with _STATES_LOCK:
        states = _STATES.setdefault(tokenizer, OrderedDict())
        if key not in states:
            states[key] = _TemplateState()
            if len(states) > _MAX_STATES:
                states.popitem(last=False)
        return states[key]


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
        self._state = _shared_state(tokenizer, tools, self.template_kwargs)
        self.num_framed_renders = 0
        """message_ids calls answered from a frame, without rendering the template."""

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
        ids = self._framed_message_ids(messages)
        return self._rendered_message_ids(messages) if ids is None else ids

    def _framed_message_ids(self, messages: list[dict]) -> list[int] | None:
        """message_ids from the shape's frame; None when the shape has none or its tokens do not extend the
        anchor's (then the full render decides, as it would have: the frame's text is the render's)."""
        key = shape_key(messages)
        frames = self._state.frames
        if key is None or (key not in frames and len(frames) >= MAX_SHAPES):
            return None
        if any(not isinstance(m.get("content", ""), str) for m in messages):  # content parts are in the key: a frame
            return None  # would serve only this very content, at the cost of probing it
        if key not in frames:
            frames[key] = self._probe_frame(messages)
        frame = frames[key]
        if frame is None:
            return None
        text = frame.text(text_values(messages))
        if frame.cut:  # render(anchor) is text[:cut], whose tokens are base: the rest's tokens are the new ones
            ids = self.encode(text[frame.cut :])
        else:
            base = self._state.anchor_ids[frame.anchor]
            full = self.encode(text)
            if full[: len(base)] != base:
                return None
            ids = full[len(base) :]
        self.num_framed_renders += 1
        return ids

    def _probe_frame(self, messages: list[dict]) -> Frame | None:
        """The frame of `messages` after the first anchor they render after, as `_rendered_message_ids` tries them."""
        for i, anchor in enumerate(_ANCHORS):
            try:
                self._anchor_ids(i)
                frame = probe_frame(
                    lambda probed, anchor=anchor: self.render_text([*anchor, *probed], True), messages, i
                )
            except UserError:  # this template refuses this anchor: try the next
                continue
            return None if frame is None else dataclasses.replace(frame, cut=self._cut(frame))
        return None

    def _cut(self, frame: Frame) -> int:
        """The anchor text's length when the frame's first piece starts with it and is a token cut there
        (decided within the piece, which reaches a whole longest added token past it), else 0."""
        if self._state.cuts is None:
            self._state.cuts = TokenCuts(self.tokenizer)
        cuts, first = self._state.cuts, frame.pieces[0]
        anchor = self.render_text(_ANCHORS[frame.anchor], add_generation_prompt=False)
        at = len(anchor)
        if first.startswith(anchor) and len(first) >= at + cuts.longest and cuts.is_cut(first, at):
            return at
        return 0

    def _anchor_ids(self, i: int) -> list[int]:
        if i not in self._state.anchor_ids:
            self._state.anchor_ids[i] = self.render_ids(_ANCHORS[i], add_generation_prompt=False)
        return self._state.anchor_ids[i]

    def _rendered_message_ids(self, messages: list[dict]) -> list[int]:
        problem = "they do not extend the conversation before them"
        for i, anchor in enumerate(_ANCHORS):
            try:
                base = self._anchor_ids(i)
                full = self.render_ids([*anchor, *messages], add_generation_prompt=True)
            except UserError as e:  # this template refuses this anchor: try the next
                problem = str(e)
                continue
            if full[: len(base)] == base:
                return full[len(base) :]
        roles = ",".join(str(m.get("role")) for m in messages)
        raise UserError(f"cannot add messages with roles [{roles}] token-exactly: {problem}")

    @property
    def closing_ids(self) -> list[int]:
        """The template tokens after an assistant message's content (e.g. `<|im_end|>` and a newline)."""
        if self._state.closing_ids is None:
            self._state.closing_ids = self._render_closing_ids()
        return self._state.closing_ids

    def _render_closing_ids(self) -> list[int]:
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
    route_parts: list = field(default_factory=list, repr=False)
    """MoE models: the routing of the response tokens, in order: per model turn its Generated.routed_experts
    ([n, L, k] int16, or None from an engine that records none), per run of inserted tokens the rows the next turn's
    engine computed as it read them (its Generated.prompt_routed_experts) or, where it gave none, their count.
    `routed_experts()` assembles them."""

    @property
    def num_pending_inserted(self) -> int:
        """The inserted tokens since the last model turn: the next turn's request asks the engine for the routing of
        the positions that predicted them (TokenRequest.num_prompt_routes)."""
        last = self.route_parts[-1] if self.route_parts else None
        return last if isinstance(last, int) else 0

    def add_model_turn(
        self, ids: list[int], logprobs: list[float], routes: torch.Tensor | None = None,
        inserted_routes: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        """A turn the model generated; `routes`: its Generated.routed_experts (an MoE model's engine that records);
        `inserted_routes`: its Generated.prompt_routed_experts, the rows of the `num_pending_inserted` tokens before
        it (None: they have none)."""
        if len(ids) != len(logprobs):
            raise ValueError(f"a model turn has {len(ids)} tokens but {len(logprobs)} logprobs")
        if routes is not None and routes.shape[0] != len(ids):
            raise ValueError(f"a model turn has {len(ids)} tokens but {routes.shape[0]} rows of routed experts")
        if inserted_routes is not None:
            if inserted_routes.shape[0] != self.num_pending_inserted:
                raise ValueError(
                    f"{self.num_pending_inserted} inserted tokens before a model turn but {inserted_routes.shape[0]} "
                    "rows of routed experts for them"
                )
            self.route_parts[-1] = inserted_routes
        self.response_ids += ids
        self.loss_mask += [1] * len(ids)
        self.rollout_logprobs += [float(x) for x in logprobs]
        self.route_parts.append(routes)
        self.num_turns += 1

    def add_inserted(self, ids: list[int]) -> None:
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)
        self.rollout_logprobs += [0.0] * len(ids)
        if ids:
            self.route_parts.append(len(ids))

    def routed_experts(self) -> torch.Tensor | None:
        """The experts of every response token's predicting position, int16 [len(response_ids), L, k]: each model
        turn's rows as its engine recorded them, inserted tokens' as the next turn's engine computed them when it
        read them, -1 on inserted tokens without rows (no turn read them, or its engine cannot tell: replay routes
        them normally). None when no model turn recorded routing, or some turn did not (then nothing is replayed
        rather than part of the sample)."""
        import torch

        turns = [part for part in self.route_parts if not isinstance(part, int)]
        if not turns or any(t is None for t in turns):
            return None
        layers, k = turns[0].shape[1:]
        unrecorded = torch.full((1, layers, k), -1, dtype=torch.int16)
        rows = [
            unrecorded.expand(part, -1, -1) if isinstance(part, int) else part.to("cpu", torch.int16)
            for part in self.route_parts
        ]
        return torch.cat(rows)

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
