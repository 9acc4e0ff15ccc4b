"""One sample's requests behind `rlx serve`, kept as token-exact trajectory segments.

A chat request whose messages extend the previous request's messages plus the reply rlx gave it
continues the same segment: its context is the earlier tokens verbatim (the model's sampled tokens
are never re-tokenised), the rest of the closing of the last assistant turn, and the template tokens
of the new messages. Anything else (history rewritten, tools changed, a switch between chat and
completions) starts a new segment, recorded with the reason. /v1/completions prompts extend a
segment when their text (or token ids) starts with everything before it.

A request is planned first (`plan_chat`, `plan_completion`) and applied only once its generation
came back (`commit`), so a failed generation leaves the segment as it was.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from rlx.engine.agent.config import AgentConfig
from rlx.engine.agent.tool_calls import get_tool_call_parser
from rlx.engine.agent.trajectory import ChatRenderer, Trajectory
from rlx.engine.rollout.requests import Generated, cut_response
from rlx.engine.rollout.stops import StopStrings


def message_text(content) -> str:
    """A message's content as text: a string, None, or OpenAI text parts ({"type": "text", "text": ...}). Any other
    part (an image, audio, a file) is a ValueError naming its type: the endpoint does not take them yet, and dropping
    them would train the model on a conversation it never saw."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        kinds = [p.get("type") if isinstance(p, dict) else type(p).__name__ for p in content]
        other = next((k for k in kinds if k != "text"), None)
        if other is not None:
            raise ValueError(f"content parts of type {other!r} are not supported by this endpoint (text parts only)")
        return "".join(p.get("text", "") for p in content)
    raise ValueError(f"message content must be a string or a list of content parts, got {type(content).__name__}")


def normalize_message(message: dict) -> dict:
    """The parts of a chat message that reach the template, in one canonical form (to compare and render)."""
    out = {"role": message.get("role"), "content": message_text(message.get("content"))}
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [
            {
                "id": call.get("id"),
                "type": "function",
                "function": {"name": call["function"]["name"], "arguments": call["function"]["arguments"]},
            }
            for call in calls
        ]
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out


@dataclass
class Segment:
    """A stretch of one sample's requests that extend each other token-exactly."""

    kind: str
    """'chat' or 'completion'."""
    reason: str
    """Why it began: 'first request', 'history rewritten', 'tools changed' or 'endpoint changed'."""
    trajectory: Trajectory
    tools: list[dict] | None = None
    renderer: ChatRenderer | None = None
    text: str = ""
    """completion segments: the prompt text and every completion returned, concatenated."""
    last_turn_ids: list[int] = field(default_factory=list)
    last_turn_text: str = ""
    finish_reason: str = "stop"
    """The last generation's: 'stop' or 'length'."""


@dataclass
class Plan:
    """What a request adds before generating: the whole context, and how to record it once generated."""

    segment: Segment
    is_new: bool
    context_ids: list[int]
    inserted_ids: list[int] = field(default_factory=list)
    new_messages: list[dict] = field(default_factory=list)
    new_text: str = ""


class SampleSession:
    """Every request made to one sample's base URL (handled one at a time: `lock`)."""

    def __init__(
        self, sample_id: str, tokenizer, stop_ids: set[int], cfg: AgentConfig, stops: StopStrings | None = None
    ):
        self.sample_id, self.tokenizer, self.stop_ids, self.cfg = sample_id, tokenizer, set(stop_ids), cfg
        self.stops = stops
        """rollout.stop: a reply's text ends before its stop string (its tokens keep it)."""
        self.parse = get_tool_call_parser(cfg.tool_parser)
        self.segments: list[Segment] = []
        self.num_requests = 0
        self.hit_token_limit = False
        self.lock = threading.Lock()

    @property
    def current(self) -> Segment | None:
        return self.segments[-1] if self.segments else None

    def plan_chat(self, messages: list[dict], tools: list[dict] | None) -> Plan:
        messages = [normalize_message(m) for m in messages]
        seg = self.current
        reason = self._break_reason(seg, "chat", tools, messages)
        if reason is None:
            new = messages[len(seg.trajectory.messages) :]
            inserted = seg.renderer.turn_end_ids(seg.last_turn_ids) + seg.renderer.message_ids(new)
            return Plan(seg, False, seg.trajectory.token_ids() + inserted, inserted, new)
        renderer = ChatRenderer(self.tokenizer, self.stop_ids, tools, self.cfg.chat_template_kwargs)
        prompt_ids = renderer.opening_ids(messages)
        segment = Segment("chat", reason, Trajectory(prompt_ids, messages), tools, renderer)
        return Plan(segment, True, list(prompt_ids))

    def plan_completion(self, prompt: str | list[int]) -> Plan:
        seg = self.current
        reason = self._break_reason(seg, "completion", None, prompt)
        if reason is None:
            context = seg.trajectory.token_ids()
            if isinstance(prompt, list):
                inserted, new_text = prompt[len(context) :], self.tokenizer.decode(prompt[len(context) :])
            else:
                new_text = prompt[len(seg.text) :]
                inserted = list(self.tokenizer(new_text, add_special_tokens=False)["input_ids"]) if new_text else []
            return Plan(seg, False, context + inserted, inserted, new_text=new_text)
        if isinstance(prompt, list):
            prompt_ids, text = list(prompt), self.tokenizer.decode(prompt)
        else:
            prompt_ids, text = list(self.tokenizer(prompt)["input_ids"]), prompt
        segment = Segment("completion", reason, Trajectory(prompt_ids, []), text=text)
        return Plan(segment, True, list(prompt_ids))

    def _break_reason(self, seg: Segment | None, kind: str, tools, request) -> str | None:
        """None when the request continues `seg`, else why a new segment begins."""
        if seg is None:
            return "first request"
        if seg.kind != kind:
            return "endpoint changed"
        if kind == "chat":
            if (tools or None) != (seg.tools or None):
                return "tools changed"
            known = seg.trajectory.messages
            return None if request[: len(known)] == known else "history rewritten"
        if isinstance(request, list):
            return None if request[: seg.trajectory.num_tokens] == seg.trajectory.token_ids() else "history rewritten"
        return None if request.startswith(seg.text) else "history rewritten"

    def commit(self, plan: Plan, gen: Generated) -> tuple[dict | str, list[str]]:
        """Record the request and its generation; the reply (assistant message or completion text) and any
        tool-call problems (the message then carries the raw text and no tool calls)."""
        seg = plan.segment
        if plan.is_new:
            self.segments.append(seg)
        traj = seg.trajectory
        traj.add_inserted(plan.inserted_ids)
        traj.add_model_turn(gen.response_ids, gen.logprobs)
        self.num_requests += 1
        seg.last_turn_ids, seg.finish_reason = gen.response_ids, gen.finish_reason
        text = self.tokenizer.decode(gen.response_ids, skip_special_tokens=True)
        if self.stops is not None and gen.finish_reason == "stop":
            text = cut_response(text, self.stops.first(text))
        seg.last_turn_text = text
        if seg.kind == "completion":
            seg.text += plan.new_text + seg.last_turn_text
            return seg.last_turn_text, []
        parsed = self.parse(seg.last_turn_text, traj.num_turns - 1)
        message = parsed.message if not parsed.errors else {"role": "assistant", "content": seg.last_turn_text}
        traj.messages += plan.new_messages + [normalize_message(message)]
        return message, parsed.errors
