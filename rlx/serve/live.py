"""A streamed reply sent as the engine samples its tokens (chat and completions with `stream: true`).

The request is planned before the reply starts (a refused request is an HTTP error, not a stream). Its generation
then runs as a task of its own: the engine worker hands each choice's tokens so far to the event loop as they are
sampled (stream.py), the reply decodes them and sends what of the text is final (deltas.py), and once the turn is
generated it is recorded exactly as without `stream` (sessions.py), the sample's lock released, and the last chunks
sent (replies.py: the rest of the content, tool calls, finish_reason, logprobs, usage; then `data: [DONE]`). A
client that goes away mid-stream does not stop the turn: it is generated and recorded all the same.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time

from starlette.concurrency import run_in_threadpool

from rlx.serve.api import ChatCall
from rlx.serve.deltas import TOOL_CALL_OPEN, TextDeltas
from rlx.serve.replies import ID_PREFIX, chat_chunks, completion_chunks
from rlx.serve.responses import message_opening, numbered, output_events, response_object, start_events, text_delta
from rlx.serve.turns import run_turns


def _event(chunk: dict) -> str:
    return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"


class LiveReply:
    """One streamed request: its generation task and the server-sent events of its reply."""

    def __init__(self, server, sessions: list, call, prepared: list):
        """`sessions` are held (their locks taken) and released once the turns are recorded; `prepared`: the plans
        and token requests of turns.prepare_turns."""
        self.server, self.sessions, self.call = server, sessions, call
        self.is_chat = isinstance(call, ChatCall)
        reads_tools = self.is_chat and call.parse_tools
        stops = (*call.settings.stop, *server.sampling.stop, *((TOOL_CALL_OPEN,) if reads_tools else ()))
        self.deltas = [TextDeltas(stops, hold_whitespace=reads_tools) for _ in sessions]
        self.latest: dict[int, list[int]] = {}
        """Each choice's newest tokens not yet decoded (older ones are skipped: the newest include them)."""
        self.queue: asyncio.Queue = asyncio.Queue()
        kind = "chat.completion.chunk" if self.is_chat else "text_completion"
        self.rid = secrets.token_hex(12)
        """The reply's own id (Turn.id): its chunks carry it with their kind's prefix."""
        self.head = {"id": f"{ID_PREFIX[kind]}{self.rid}", "object": kind, "created": int(time.time()),
                     "model": server.model_name}  # fmt: skip
        self.job = asyncio.ensure_future(self._generate(prepared))

    async def _generate(self, prepared: list) -> None:
        try:
            turns = await run_turns(self.server, self.sessions, self.call, prepared, self._heard)
            self.queue.put_nowait(("done", turns))
        except Exception as e:  # noqa: BLE001 - reported in the stream; the server keeps serving
            self.queue.put_nowait(("error", e))
        finally:
            for session in self.sessions:
                session.lock.release()

    def _heard(self, index: int, ids: list[int]) -> None:
        self.latest[index] = ids
        self.queue.put_nowait(("tokens", index))

    def _decode(self, ids: list[int]) -> str:
        with self.server.tokenizer_lock:
            return self.server.tokenizer.decode(ids, skip_special_tokens=True)

    async def _piece(self, index: int) -> str:
        """What of choice `index`'s text may be sent now that it has new tokens ('' when nothing)."""
        ids = self.latest.pop(index, None)
        if ids is None or self.deltas[index].is_closed:
            return ""
        return self.deltas[index].feed(await run_in_threadpool(self._decode, ids))

    def _chunk(self, index: int, piece: str) -> dict:
        choice = {"index": index, "delta": {"content": piece}} if self.is_chat else {"index": index, "text": piece}
        return {**self.head, "choices": [{**choice, "finish_reason": None, "logprobs": None}]}

    async def events(self):
        """The reply's server-sent events, ending with `data: [DONE]`."""
        if self.is_chat:
            for index in range(len(self.sessions)):
                role = {"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                        "logprobs": None}  # fmt: skip
                yield _event({**self.head, "choices": [role]})
        while True:
            item = await self.queue.get()
            if item[0] == "tokens":
                piece = await self._piece(item[1])
                if piece:
                    yield _event(self._chunk(item[1], piece))
                continue
            if item[0] == "error":
                error = {"message": f"the server failed on this request ({type(item[1]).__name__})",
                         "type": "server_error", "code": "server_error", "param": None}  # fmt: skip
                yield _event({"error": error})
                break
            turns = item[1]
            for turn in turns:  # the chunks of one reply share its id
                turn.id, turn.created = self.rid, self.head["created"]
            last = chat_chunks if self.is_chat else completion_chunks
            for chunk in last(turns, self.server.model_name, [d.sent for d in self.deltas]):
                yield _event(chunk)
            break
        yield "data: [DONE]\n\n"


class LiveResponse(LiveReply):
    """A streamed Responses API reply (/v1/responses with `stream: true`): the message's text as it is sampled, then
    the function calls, the done events and the finished response (responses.py builds the events)."""

    def __init__(self, server, sessions: list, call, prepared: list, previous: str | None, store: bool, sample: str):
        super().__init__(server, sessions, call, prepared)
        self.previous, self.store, self.sample = previous, store, sample
        self.sequence = 0

    def _sse(self, events: list[tuple[str, dict]]) -> str:
        out = numbered(events, self.sequence)
        self.sequence += len(out)
        return "".join(f"event: {e['type']}\ndata: {json.dumps(e, ensure_ascii=False)}\n\n" for e in out)

    async def events(self):
        rid, created = self.rid, self.head["created"]
        item_id = f"msg_{rid}"
        skeleton = {"id": f"resp_{rid}", "object": "response", "created_at": created, "model": self.server.model_name,
                    "status": "in_progress", "incomplete_details": None, "output": [],
                    "previous_response_id": self.previous, "error": None, "usage": None}  # fmt: skip
        yield self._sse(start_events(skeleton))
        opened = False
        while True:
            kind, value = await self.queue.get()
            if kind == "tokens":
                piece = await self._piece(value)
                if piece:
                    yield self._sse([*([] if opened else message_opening(0, item_id)), text_delta(0, item_id, piece)])
                    opened = True
                continue
            if kind == "error":
                message = f"the server failed on this request ({type(value).__name__})"
                yield self._sse([("error", {"code": "server_error", "message": message, "param": None})])
                return
            yield self._sse(output_events(self._finished(value[0], opened), opened, self.deltas[0].sent))
            return

    def _finished(self, turn, opened: bool) -> dict:
        """The response object of the generated turn (kept for previous_response_id unless store is false); a
        message whose text was streamed stays its first output item."""
        turn.id, turn.created = self.rid, self.head["created"]
        reply = response_object(turn, self.server.model_name, self.previous)
        if opened and reply["output"][0]["type"] != "message":
            text = {"type": "output_text", "text": self.deltas[0].sent, "annotations": []}
            reply["output"].insert(0, {"type": "message", "id": f"msg_{turn.id}", "role": "assistant",
                                       "status": "completed", "content": [text]})  # fmt: skip
        if self.store:
            self.server.responses.put(reply["id"], self.sample, [*self.call.messages, turn.message])
        return reply
