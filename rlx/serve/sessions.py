"""One sample's requests behind `rlx serve`, kept as token-exact trajectory segments.

A chat request whose messages extend the previous request's messages plus the reply rlx gave it
continues the same segment: its context is the earlier tokens verbatim (the model's sampled tokens
are never re-tokenised), the rest of the closing of the last assistant turn, and the template tokens
of the new messages. Anything else (history rewritten, tools changed, a switch between chat and
completions) starts a new segment, recorded with the reason. /v1/completions prompts extend a
segment when their text (or token ids) starts with everything before it.

A request is planned first (`plan_chat`, `plan_completion`) and applied only once its generation
came back (`commit`), so a failed generation leaves the segment as it was.

Chat messages may hold images (a vision-language model on the hf or native engine): each becomes the processor's
image tokens where the template puts it, as an environment's reply's images do (images.py), every later request of
the segment generates with all of its images so far, and requests are compared with each image's reference
replaced by the digest of its pixels (request_images.py), so a changed image rewrites the history.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field
from functools import partial

from rlx.chat.images import EpisodeImages, RenderedImages
from rlx.chat.tool_calls import call_id, get_tool_call_parser, parse_plain, parser_for_template
from rlx.chat.trajectory import ChatRenderer, Trajectory
from rlx.errors import UserError
from rlx.models.vision.inputs import VisionInputs
from rlx.rollout.agent_config import AgentConfig
from rlx.rollout.requests import Generated, cut_response
from rlx.rollout.stops import StopStrings
from rlx.serve.replies import PromptTokens
from rlx.serve.request_images import ImagePolicy, RequestImages, has_images, read_content

_SOURCE = "the request's"
_CALL_IDS_LOCK = threading.Lock()


def normalize_message(message: dict, where: str = "a message", policy: ImagePolicy | None = None) -> dict:
    """The parts of a chat message that reach the template, in one canonical form (to compare and render): its content
    a string, or text and image parts (request_images.py: references as `policy` takes them; `where` names the
    message in errors)."""
    out = {"role": message.get("role"), "content": read_content(message.get("content"), where, policy)}
    if out["role"] == "assistant" and has_images(out):
        raise UserError(f"{where} (assistant) has image parts: images go in user, tool or system messages")
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
    images: EpisodeImages | None = None
    """chat segments: their images so far (references in token order, pixels, offsets)."""
    keys: list[dict] = field(default_factory=list)
    """chat segments: the messages with each image's reference replaced by its content digest (to compare by)."""
    turn_settings: list[dict] = field(default_factory=list)
    """What each turn's request asked and was sampled with (max_tokens, temperature, seed, stop, metadata...)."""

    @property
    def image_refs(self) -> list[str] | None:
        """The segment's image references in token order (None without images)."""
        return (self.images.refs or None) if self.images is not None else None

    def to_json(self) -> dict:
        """An earlier segment as a record's `segments` keep it."""
        refs = self.image_refs
        out = {"reason": self.reason, **self.trajectory.to_json(), **({"image_refs": refs} if refs else {})}
        return {**out, "turn_settings": self.turn_settings} if self.turn_settings else out


@dataclass
class ChatRequest:
    """A chat request's messages read (`SampleSession.read_messages`): as the template takes them, and as compared."""

    messages: list[dict]
    keys: list[dict]


@dataclass
class Plan:
    """What a request adds before generating: the whole context, and how to record it once generated."""

    segment: Segment
    is_new: bool
    context_ids: list[int]
    inserted_ids: list[int] = field(default_factory=list)
    new_messages: list[dict] = field(default_factory=list)
    new_text: str = ""
    new_keys: list[dict] = field(default_factory=list)
    images: RenderedImages | None = None
    """The new messages' images, which join the segment's at token `image_start` on commit."""
    image_start: int = 0
    vision: VisionInputs | None = None
    """Every image of the context (the segment's and the new ones) with their offsets; None without images."""
    prompt: PromptTokens | None = None
    """The context's tokens scored by the model, where the request asked (vLLM's prompt_logprobs, echo with
    logprobs: turns.prepare_turns)."""
    call_ids: list[str] = field(default_factory=list)
    """The ids of the turn's tool calls so far (SampleSession.call_id_for): a streamed call's first delta carries its
    id before the turn is committed, and commit gives the call the same."""
    turn: int = field(init=False)
    """The turn's number in its segment (its tool calls are `call_<turn>_<i>` under `rlx rollout --agent`)."""

    def __post_init__(self):
        self.turn = self.segment.trajectory.num_turns


class SampleSession:
    """Every request made to one sample's base URL (handled one at a time: `lock`)."""

    def __init__(
        self, sample_id: str, tokenizer, stop_ids: set[int], cfg: AgentConfig, stops: StopStrings | None = None,
        images: RequestImages | None = None, unique_call_ids: bool = False,
    ):  # fmt: skip
        """`unique_call_ids`: tool calls get random ids, as OpenAI's and vLLM's (`rlx serve`); else `call_<turn>_<i>`,
        the ids a Python environment's rollout gives (`rlx rollout --agent`: the same trajectory either way)."""
        self.sample_id, self.tokenizer, self.stop_ids, self.cfg = sample_id, tokenizer, set(stop_ids), cfg
        self.unique_call_ids = unique_call_ids
        self.images = images or RequestImages(None, "?", False, "the server was started without image support")
        """What the engine makes of image parts (request_images.py)."""
        self.stops = stops
        """rollout.sampling.stop: a reply's text ends before its stop string (its tokens keep it)."""
        template = getattr(tokenizer, "chat_template", None)
        self.parser_name = parser_for_template(template) if cfg.tool_parser == "auto" else cfg.tool_parser
        """The tool parser reading this sample's replies (and the block a required tool call is sampled in)."""
        self.parse = get_tool_call_parser(self.parser_name)
        self.segments: list[Segment] = []
        self.num_requests = 0
        self.hit_token_limit = False
        self.lock = threading.Lock()
        """Held while a request of this sample is answered (a second one meanwhile is refused: server.py)."""
        self.last_used = 0.0
        """time.monotonic() of the last request (for closing idle sessions)."""
        self.evicted: str | None = None
        """Why the server closed this session before it stopped (idle, over the cap), else None."""
        self.client_session_ids: list[str] = []
        """The X-Session-ID labels its client sent with requests addressed by path (/s/<id>/v1), distinct, in the order
        first seen: e.g. the verifiers trace id of the rollout played under this sample."""

    def add_client_label(self, label: str) -> None:
        """Keep `label` (an X-Session-ID header of a request the path addressed) unless it is kept already."""
        if label not in self.client_session_ids:
            self.client_session_ids.append(label)

    @property
    def current(self) -> Segment | None:
        return self.segments[-1] if self.segments else None

    def read_messages(self, messages: list[dict]) -> ChatRequest:
        """A chat request's messages in canonical form, and its keys (loading and processing its images: done before
        `plan_chat`, outside the server's tokenizer lock)."""
        read = [normalize_message(m, f"message {i}", self.images.policy) for i, m in enumerate(messages)]
        return ChatRequest(read, self.images.keys(read, self.sample_id))

    def plan_chat(self, request: ChatRequest, tools: list[dict] | None) -> Plan:
        messages, seg = request.messages, self.current
        reason = self._break_reason(seg, "chat", tools, request.keys)
        if reason is None:
            new = messages[len(seg.keys) :]
            closing = seg.renderer.turn_end_ids(seg.last_turn_ids)
            rendered = seg.images.render(new, _SOURCE, partial(seg.renderer.message_ids, new))
            start = seg.trajectory.num_tokens + len(closing)
            inserted, new_keys = closing + rendered.ids, request.keys[len(seg.keys) :]
            return Plan(
                seg, False, seg.trajectory.token_ids() + inserted, inserted, new, new_keys=new_keys,
                images=rendered, image_start=start, vision=seg.images.vision_with(rendered, start),
            )  # fmt: skip
        renderer = ChatRenderer(self.tokenizer, self.stop_ids, tools, self.cfg.chat_template_kwargs)
        images = self.images.episode(self.sample_id)
        rendered = images.render(messages, _SOURCE, partial(renderer.opening_ids, messages))
        trajectory = Trajectory(rendered.ids, messages)
        segment = Segment("chat", reason, trajectory, tools, renderer, images=images, keys=list(request.keys))
        return Plan(segment, True, list(rendered.ids), images=rendered, vision=images.vision_with(rendered, 0))

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

    def call_id_for(self, plan: Plan, number: int) -> str:
        """The id of tool call `number` of the turn `plan` generates, the same whether a stream asks for it before the
        turn is committed or `commit` does: random (`call_<24 hex>`) with `unique_call_ids`, else `call_<turn>_<i>`."""
        with _CALL_IDS_LOCK:  # the stream's thread and the commit's may ask at once
            while len(plan.call_ids) <= number:
                at = len(plan.call_ids)
                own = f"call_{secrets.token_hex(12)}" if self.unique_call_ids else call_id(plan.turn, at)
                plan.call_ids.append(own)
            return plan.call_ids[number]

    def _break_reason(self, seg: Segment | None, kind: str, tools, request) -> str | None:
        """None when the request continues `seg`, else why a new segment begins."""
        if seg is None:
            return "first request"
        if seg.kind != kind:
            return "endpoint changed"
        if kind == "chat":
            if (tools or None) != (seg.tools or None):
                return "tools changed"
            known = seg.keys
            return None if request[: len(known)] == known else "history rewritten"
        if isinstance(request, list):
            return None if request[: seg.trajectory.num_tokens] == seg.trajectory.token_ids() else "history rewritten"
        return None if request.startswith(seg.text) else "history rewritten"

    def commit(
        self, plan: Plan, gen: Generated, parse_tools: bool = True, settings: dict | None = None
    ) -> tuple[dict | str, list[str]]:
        """Record the request and its generation; the reply (assistant message or completion text) and any
        tool-call problems (the message then carries the raw text and no tool calls). `parse_tools` False (the
        request's tool_choice 'none'): the text is the content, unread for tool calls; `settings`: what the turn
        used, kept in the segment's `turn_settings`."""
        seg = plan.segment
        if plan.is_new:
            self.segments.append(seg)
        traj = seg.trajectory
        if plan.images is not None:
            seg.images.add(plan.images, plan.image_start)
        traj.add_inserted(plan.inserted_ids)
        traj.add_model_turn(gen.response_ids, gen.logprobs, gen.routed_experts, gen.prompt_routed_experts)
        self.num_requests += 1
        if settings is not None:
            seg.turn_settings.append(settings)
        seg.last_turn_ids, seg.finish_reason = gen.response_ids, gen.finish_reason
        text = self.tokenizer.decode(gen.response_ids, skip_special_tokens=True)
        if gen.stop_string:
            text = cut_response(text, gen.stop_string)
        elif self.stops is not None and gen.finish_reason == "stop":
            text = cut_response(text, self.stops.first(text))
        seg.last_turn_text = text
        if seg.kind == "completion":
            seg.text += plan.new_text + seg.last_turn_text
            return seg.last_turn_text, []
        parse = self.parse if parse_tools else parse_plain
        parsed = parse(seg.last_turn_text, traj.num_turns - 1)
        message = parsed.message if not parsed.errors else {"role": "assistant", "content": seg.last_turn_text}
        for number, call in enumerate(message.get("tool_calls", ())):  # every block read: its place among them
            call["id"] = self.call_id_for(plan, number)
        reply = normalize_message(message)
        traj.messages += plan.new_messages + [reply]
        seg.keys += plan.new_keys + [reply]
        return message, parsed.errors
