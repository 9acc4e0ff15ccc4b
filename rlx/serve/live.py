"""A streamed reply sent as the engine samples its tokens (chat and completions with `stream: true`).

The request is planned before the reply starts (a refused request is an HTTP error, not a stream). Its generation
then runs as a task of its own: the engine worker hands each choice's tokens so far, with their logprobs, to the
event loop as they are sampled (stream.py); the reply decodes them, sends what of the text is final (deltas.py) and
each tool call's name and arguments as they come (tool_stream.py, with the id its record gives the call), each with
the logprobs and ids of the tokens that wrote it, and once the turn is generated it is recorded exactly as without
`stream` (sessions.py), the sample's lock released, and the last chunks sent (replies.StreamedReply: the rest of the
content, what of the tool calls was not sent, the finish_reason with the remaining tokens, usage; then
`data: [DONE]`). A completion with `echo` sends the prompt's text at the start of each choice's first chunk (with
logprobs, the prompt's tokens' logprobs first in it, scored before the stream starts: turns.prepare_turns). A
client that goes away mid-stream does not stop the turn: it is generated and recorded all the same. A failure
mid-stream is one `data: {"error": ...}` event before `[DONE]`, as vLLM sends it (its traceback on the server's
stderr).
"""

from __future__ import annotations

import asyncio
import json
import sys
import traceback

from starlette.concurrency import run_in_threadpool

from rlx.rollout.requests import Generated
from rlx.serve.api import ChatCall
from rlx.serve.deltas import TOOL_CALL_OPEN, TextDeltas, covered, held_back, token_pieces
from rlx.serve.replies import Span, StreamedReply, Turn
from rlx.serve.responses import (
    arguments_delta,
    call_opening,
    message_opening,
    numbered,
    output_events,
    response_object,
    start_events,
    text_delta,
)
from rlx.serve.stream import EngineFailed
from rlx.serve.tool_stream import STREAMED_PARSERS, CallDelta, CallStream
from rlx.serve.turns import decoded_span, echo_text, run_turns


def _event(chunk: dict) -> str:
    return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"


def _error(e: BaseException) -> dict:
    """What a client hears of a failure mid-stream: the engine's (503 before a stream) or this request's (500)."""
    if isinstance(e, EngineFailed):
        return {"message": str(e), "type": "server_error", "code": "service_unavailable", "param": None}
    message = f"the server failed on this request ({type(e).__name__}: {e})"[:300]
    return {"message": message, "type": "server_error", "code": "server_error", "param": None}


class LiveReply:
    """One streamed request: its generation task and the server-sent events of its reply."""

    def __init__(self, server, sessions: list, call, prepared: list):
        """`sessions` are held (their locks taken) and released once the turns are recorded; `prepared`: the plans
        and token requests of turns.prepare_turns."""
        self.server, self.sessions, self.call = server, sessions, call
        self.plans = [plan for plan, _ in prepared]
        self.is_chat = isinstance(call, ChatCall)
        reads_tools = self.is_chat and call.parse_tools
        self.stops = tuple(s for s in (*call.settings.stop, *server.sampling.stop) if s)
        markers = (*self.stops, *((TOOL_CALL_OPEN,) if reads_tools else ()))
        self.deltas = [TextDeltas(markers, hold_whitespace=reads_tools) for _ in sessions]
        self.calls = [
            CallStream() if reads_tools and session.parser_name in STREAMED_PARSERS else None for session in sessions
        ]
        """Each choice's tool calls read as they are sampled (None where its parser's calls are sent once generated)."""
        settings = call.settings
        self.wants_tokens = settings.logprobs or settings.return_token_ids or settings.continuous_usage
        """Whether chunks carry their tokens (logprobs, ids, usage so far): else which tokens wrote a piece is moot."""
        self.latest: dict[int, Generated] = {}
        """What each choice sampled so far, not yet decoded (older updates are skipped: the newest include them)."""
        self.queue: asyncio.Queue = asyncio.Queue()
        self.chunks = StreamedReply(settings, [plan.context_ids for plan, _ in prepared], server.model_name,
                                    self.is_chat, [plan.prompt for plan, _ in prepared])  # fmt: skip
        self.rid, self.head = self.chunks.rid, self.chunks.head
        self.job = asyncio.ensure_future(self._generate(prepared))

    async def _generate(self, prepared: list) -> None:
        try:
            turns = await run_turns(self.server, self.sessions, self.call, prepared, self._heard)
            self.queue.put_nowait(("done", turns))
        except Exception as e:  # noqa: BLE001 - reported in the stream; the server keeps serving
            if not isinstance(e, EngineFailed):  # the worker logged the engine's own failure
                print(f"rlx serve: a streamed request failed:\n{''.join(traceback.format_exception(e))}",
                      file=sys.stderr, flush=True)  # fmt: skip
            self.queue.put_nowait(("error", e))
        finally:
            for session in self.sessions:
                session.lock.release()

    def _heard(self, index: int, sampled: Generated) -> None:
        self.latest[index] = sampled
        self.queue.put_nowait(("tokens", index))

    def _decode(self, ids: list[int]) -> str:
        with self.server.tokenizer_lock:
            return self.server.tokenizer.decode(ids, skip_special_tokens=True)

    def _echo(self) -> str:
        with self.server.tokenizer_lock:
            return echo_text(self.server.tokenizer, self.call)

    async def _next(self, index: int) -> list[dict]:
        """The chunks choice `index`'s new tokens let send (none while nothing more is final)."""
        sampled, calls = self.latest.pop(index, None), self.calls[index]
        if sampled is None or (self.deltas[index].is_closed and (calls is None or calls.is_stopped)):
            return []
        return await run_in_threadpool(self._advance, index, sampled)

    def _advance(self, index: int, sampled: Generated) -> list[dict]:
        """The chunks of what choice `index`'s text so far lets send: a piece of its content, its tool calls' deltas;
        each with the tokens that wrote it (where the reply carries tokens)."""
        ids = sampled.response_ids
        text = self._decode(ids)
        found: list[tuple[str | CallDelta, int]] = []  # what to send, and how much of the text it was read from
        piece = self.deltas[index].feed(text)
        if piece:
            found.append((piece, len(self.deltas[index].sent)))
        if self.calls[index] is not None:
            found += [(delta, delta.end) for delta in self.calls[index].feed(held_back(text, self.stops)[0])]
        chunks = []
        for what, read in found:
            span, start = None, self.chunks.num_tokens[index]
            if self.wants_tokens:
                end = len(ids) if read == len(text) else covered(self._decode, ids, start, text[:read])
                with self.server.tokenizer_lock:
                    span = decoded_span(self.server.tokenizer, sampled, start, end, self.call.settings.logprobs)
            chunks.append(self._chunk(index, what, span))
        return chunks

    def _chunk(self, index: int, what: str | CallDelta, span: Span | None) -> dict:
        """The chunk of choice `index` that sends a piece of its text or a tool call's delta."""
        if isinstance(what, str):
            return self.chunks.text(index, what, span)
        if what.name is not None:  # the id the turn's record gives the call too
            call_id = self.sessions[index].call_id_for(self.plans[index], what.number)
            return self.chunks.call_named(index, what.number, call_id, what.name, span)
        return self.chunks.call_arguments(index, what.number, what.arguments, span)

    def _rest(self, index: int, turn: Turn) -> list[tuple[str, int, int]]:
        """The pieces of choice `index`'s finished content still to send, each with its tokens [start, end): a
        piece per token where nothing was sent (and the tokens' texts make the content), else the rest whole."""
        content = (turn.message.get("content") or "") if self.is_chat else turn.text[len(turn.echo) :]
        sent, start = self.deltas[index].sent, self.chunks.num_tokens[index]
        rest = content[len(sent) :] if content.startswith(sent) else ""
        if not rest:
            return []
        if self.chunks.calls[index]:  # tool calls were streamed with the tokens so far: the rest's go with the finish
            return [(rest, start, start)]
        pieces = token_pieces(content, turn.token_texts) if not sent and not start else None
        if pieces is not None:
            return pieces
        end = covered(self._decode, turn.response_ids, start, content) if self.wants_tokens else start
        return [(rest, start, end)]

    async def events(self):
        """The reply's server-sent events, ending with `data: [DONE]`."""
        if self.is_chat:
            for index in range(len(self.sessions)):
                yield _event(self.chunks.role(index))
        elif self.call.echo:  # each choice's first chunk begins with the prompt (vLLM's)
            self.chunks.echo = [await run_in_threadpool(self._echo)] * len(self.sessions)
        while True:
            kind, value = await self.queue.get()
            if kind == "tokens":
                for chunk in await self._next(value):
                    yield _event(chunk)
                continue
            if kind == "error":
                yield _event({"error": _error(value)})
                break
            for index, turn in enumerate(value):
                pieces = await run_in_threadpool(self._rest, index, turn)
                for chunk in self.chunks.finished(index, turn, pieces):
                    yield _event(chunk)
            for chunk in self.chunks.usage(value):
                yield _event(chunk)
            break
        yield "data: [DONE]\n\n"


class LiveResponse(LiveReply):
    """A streamed Responses API reply (/v1/responses with `stream: true`): the message's text and the function calls
    as they are sampled (the chat stream's reading: `_next`, each item added at the next output index as it first
    has something to send), then the rest, the done events and the finished response (responses.py builds the
    events). Its output lists the items in the order they were added, then those the finished turn adds; a call
    streamed that the finished turn does not read (cut before `</tool_call>`) stays in it as 'incomplete'."""

    def __init__(self, server, sessions: list, call, prepared: list, previous: str | None, store: bool, sample: str):
        super().__init__(server, sessions, call, prepared)
        self.previous, self.store, self.sample = previous, store, sample
        self.sequence = 0
        self.streamed: dict[str, str] = {}
        """Each output item added so far (its id, in the order added) -> its text or arguments sent so far."""
        self.added_calls: dict[int, dict] = {}
        """Each streamed call's item as added (by the call's number in the reply)."""

    def _sse(self, events: list[tuple[str, dict]]) -> str:
        out = numbered(events, self.sequence)
        self.sequence += len(out)
        return "".join(f"event: {e['type']}\ndata: {json.dumps(e, ensure_ascii=False)}\n\n" for e in out)

    async def events(self):
        rid, created = self.rid, self.head["created"]
        skeleton = {"id": f"resp_{rid}", "object": "response", "created_at": created, "model": self.server.model_name,
                    "status": "in_progress", "incomplete_details": None, "output": [],
                    "previous_response_id": self.previous, "error": None, "usage": None}  # fmt: skip
        yield self._sse(start_events(skeleton))
        while True:
            kind, value = await self.queue.get()
            if kind == "tokens":
                events = [event for events in await self._next(value) for event in events]
                if events:
                    yield self._sse(events)
                continue
            if kind == "error":
                error = _error(value)
                yield self._sse([("error", {"code": error["code"], "message": error["message"], "param": None})])
                return
            yield self._sse(output_events(self._finished(value[0]), self.streamed))
            return

    def _chunk(self, index: int, what: str | CallDelta, span: Span | None) -> list[tuple[str, dict]]:
        """The events that send a piece of the message's text or a function call's delta (its item once named)."""
        if isinstance(what, str):
            item_id = f"msg_{self.rid}"
            opening = [] if item_id in self.streamed else message_opening(len(self.streamed), item_id)
            self.streamed[item_id] = self.streamed.get(item_id, "") + what
            return [*opening, text_delta(list(self.streamed).index(item_id), item_id, what)]
        if what.name is not None:  # the id the turn's record gives the call too
            call_id = self.sessions[index].call_id_for(self.plans[index], what.number)
            item = {"type": "function_call", "id": f"fc_{call_id}", "call_id": call_id, "name": what.name,
                    "arguments": "", "status": "in_progress"}  # fmt: skip
            self.added_calls[what.number], self.streamed[item["id"]] = item, ""
            return [call_opening(len(self.streamed) - 1, item)]
        item_id = self.added_calls[what.number]["id"]
        self.streamed[item_id] += what.arguments
        return [arguments_delta(list(self.streamed).index(item_id), item_id, what.arguments)]

    def _finished(self, turn) -> dict:
        """The response object of the generated turn (kept for previous_response_id unless store is false), its
        output in the order the stream added the items."""
        turn.id, turn.created = self.rid, self.head["created"]
        reply = response_object(turn, self.server.model_name, self.previous)
        by_id = {item["id"]: item for item in reply["output"]}
        for item_id, sent in self.streamed.items():  # an item sent that the finished turn does not hold
            if item_id == f"msg_{turn.id}" and item_id not in by_id:
                text = {"type": "output_text", "text": sent, "annotations": []}
                by_id[item_id] = {"type": "message", "id": item_id, "role": "assistant", "status": "completed",
                                  "content": [text]}  # fmt: skip
            elif item_id not in by_id:
                added = next(item for item in self.added_calls.values() if item["id"] == item_id)
                by_id[item_id] = {**added, "arguments": sent, "status": "incomplete"}
        rest = [item for item in reply["output"] if item["id"] not in self.streamed]
        reply["output"] = [*(by_id[item_id] for item_id in self.streamed), *rest]
        if self.store:
            self.server.responses.put(reply["id"], self.sample, [*self.call.messages, turn.message])
        return reply
