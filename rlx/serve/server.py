"""An OpenAI-compatible HTTP endpoint (starlette on uvicorn) whose every request lands in a sample's trajectory.

Routes (bodies as OpenAI's API takes them; see docs/serve.md for every field):
    /v1/chat/completions, /v1/completions   POST; `stream: true` answers server-sent events as tokens come (live.py)
    /v1/models, /v1/models/{id}             GET: the served model (another id: 404 naming the served one)
    /v1/responses                           POST: OpenAI's Responses API over the chat path (responses.py)
    /inference/v1/generate                  POST: vLLM's token-in/token-out route (generate.py; verifiers' trainer)
    /s/<sample_id>/v1/...                   the same, for the sample named in the path
A request belongs to the sample its path names, else the one its `X-Session-ID` header names, else 'default'
(ids may hold '/', raw or %2F-encoded); with n > 1, choice i > 0 belongs to sample `<id>~i`. `base_url(sample_id)`
is what an agent gives its OpenAI client. Where the path names the sample, an `X-Session-ID` header is the client's
own label for its conversation (verifiers sends its trace id on every request), not a second address: the path wins
and the label is kept in the sample's `client_session_ids` (the record's extra).

uvicorn runs its event loop in a thread of its own; a request's tokenizer and image work runs in starlette's
thread pool and its generation is awaited as a future of the engine stream (stream.py), so no handler blocks the
loop. One sample answers one request at a time: a second request for a sample that is still generating is HTTP
409 naming both (two conversations under one id would merge into one sample). Idle samples are closed
(`EndpointConfig.session_idle_s`, `max_sessions`) and kept as finished records. The whole context of a sample is
capped at `max_total_tokens` (and the model's context): past it, HTTP 400 'context_length_exceeded'.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import socket
import sys
import threading
import time
import traceback
from collections import Counter, OrderedDict
from urllib.parse import quote

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rlx.errors import UserError
from rlx.rollout.agent_config import AgentConfig
from rlx.rollout.config import SamplingParams
from rlx.rollout.constraints import Grammars
from rlx.rollout.stops import StopStrings
from rlx.serve.api import Limits, RequestError, read_chat, read_completion
from rlx.serve.config import EndpointConfig
from rlx.serve.generate import generate_reply, read_generate
from rlx.serve.live import LiveReply, LiveResponse
from rlx.serve.replies import Turn, chat_reply, completion_reply
from rlx.serve.request_images import ImagePolicy, RequestImages
from rlx.serve.responses import ResponseStore, response_object, to_chat
from rlx.serve.sessions import SampleSession
from rlx.serve.stream import EngineFailed, StreamWorker
from rlx.serve.turns import generate_turns, prepare_turns

DEFAULT_SAMPLE = "default"
MAX_UNNAMED = 1024
"""Most requests naming no sample answered at once (samples 'default', 'default@2', ...)."""
SESSION_HEADER = "x-session-id"


class AgentServer:
    """The HTTP server, its sessions (one per sample id) and the stream worker that generates for it."""

    def __init__(
        self, worker: StreamWorker, tokenizer, stop_ids: set[int], sampling: SamplingParams, cfg: AgentConfig,
        model_name: str = "rlx", port: int = 0, endpoint: EndpointConfig | None = None, strict: bool = False,
        known_image_refs=(),
    ):  # fmt: skip
        """`strict`: the run's sampling governs (rollout --agent); `known_image_refs`: image references clients may
        send besides data: URIs and files under `endpoint.image_root` (the prompts' own)."""
        self.worker, self.tokenizer, self.stop_ids = worker, tokenizer, set(stop_ids)
        self.sampling, self.cfg, self.model_name = sampling, cfg, model_name
        self.endpoint = endpoint or EndpointConfig()
        engine = worker.engine
        self.limits = Limits(sampling, model_name, strict, getattr(engine, "gives_top_logprobs", False),
                             getattr(engine, "takes_constraints", False), worker.vocab_size,
                             getattr(engine, "gives_prompt_logprobs", False), getattr(engine, "name", ""))  # fmt: skip
        self.created = int(time.time())
        """When the server was made (the `created` of /v1/models)."""
        self.grammars: Grammars | None = None
        """Compiles response_format grammars (made on the first request with one)."""
        policy = ImagePolicy.of(self.endpoint.image_root, self.endpoint.max_image_bytes, known_image_refs)
        self.images = RequestImages.of_engine(worker.engine, policy)
        """What the engine makes of image parts: shared by the samples (one processed copy of each image)."""
        self.sessions: OrderedDict[str, SampleSession] = OrderedDict()
        """Open sessions, the least recently used first."""
        self.responses = ResponseStore()
        """Responses kept for `previous_response_id` (/v1/responses)."""
        self.closed: list[SampleSession] = []
        """Sessions closed for idleness or over the cap (their `evicted` says which), in closing order."""
        self._sessions_lock = threading.Lock()
        self._num_calls: Counter[str] = Counter()
        """Requests per sample id as named by path or header, refused ones included (a refused request makes no
        session, so the sessions alone cannot tell an agent that never called from one whose every call failed)."""
        # a fast tokenizer's Rust core may refuse calls from two threads at once ("Already borrowed")
        self.tokenizer_lock = threading.Lock()
        self.renders_tools: bool | None = None
        """Whether the chat template shows tools to the model (found on the first request with tools)."""
        family = socket.AF_INET6 if ":" in self.endpoint.host else socket.AF_INET
        self._socket = socket.create_server((self.endpoint.host, port), family=family, backlog=self.endpoint.backlog)
        config = uvicorn.Config(
            _app(self), lifespan="off", log_level="warning", access_log=False, backlog=self.endpoint.backlog,
            timeout_graceful_shutdown=30, timeout_keep_alive=30,
        )  # fmt: skip
        self._uvicorn = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._socket.getsockname()[:2]
        return f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"

    def base_url(self, sample_id: str) -> str:
        """The OpenAI base URL whose requests all belong to `sample_id`."""
        return f"{self.url}/s/{quote(sample_id, safe='')}/v1"

    @property
    def num_requests(self) -> int:
        return sum(s.num_requests for s in self.all_sessions())

    def num_calls(self, sample_id: str) -> int:
        """How many requests named `sample_id` (answered or refused)."""
        with self._sessions_lock:
            return self._num_calls[sample_id]

    def all_sessions(self) -> list[SampleSession]:
        """Closed sessions then open ones."""
        with self._sessions_lock:
            return self.closed + list(self.sessions.values())

    def start(self) -> AgentServer:
        self._thread = threading.Thread(
            target=self._uvicorn.run, kwargs={"sockets": [self._socket]}, name="rlx-serve-http", daemon=True
        )
        self._thread.start()
        while not self._uvicorn.started and self._thread.is_alive():
            time.sleep(0.01)
        if not self._uvicorn.started:
            raise RuntimeError("the HTTP server did not start")
        return self

    def close(self) -> None:
        """Stop accepting, let requests in flight finish, close the socket."""
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join()
        self._socket.close()

    def __enter__(self) -> AgentServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def grammar_for(self, schema: dict):
        """A fresh grammar constraint for JSON following `schema` ({}: any JSON object)."""
        return self._grammars(lambda grammars: grammars.for_json(schema))

    def tool_grammar_for(self, tools: list[dict], parser: str):
        """A fresh grammar constraint for one call of one of `tools` in the block `parser` reads; a RequestError
        naming tool_choice where the parser reads no tool calls."""
        from rlx.chat.tool_calls import call_block

        try:
            block = call_block(parser)
        except UserError as e:
            raise RequestError(400, str(e), "invalid_request", "tool_choice") from None
        return self._grammars(lambda grammars: grammars.for_tool_call(tools, block))

    def _grammars(self, compile_one):
        """`compile_one(Grammars)` under the tokenizer lock, the Grammars of this server's tokenizer made once."""
        with self.tokenizer_lock:
            if self.grammars is None:
                self.grammars = Grammars(self.tokenizer, self.worker.vocab_size, self.stop_ids)
            return compile_one(self.grammars)

    def session(self, sample_id: str) -> SampleSession:
        with self._sessions_lock:
            self._evict(making=sample_id not in self.sessions)
            session = self.sessions.get(sample_id)
            if session is None:
                stops = StopStrings(self.tokenizer, self.sampling.stop) if self.sampling.stop else None
                session = SampleSession(sample_id, self.tokenizer, self.stop_ids, self.cfg, stops, self.images,
                                        unique_call_ids=not self.limits.strict)  # fmt: skip
                self.sessions[sample_id] = session
            self.sessions.move_to_end(sample_id)
            session.last_used = time.monotonic()
            return session

    def _evict(self, making: bool) -> None:
        """Close the sessions idle past `session_idle_s` and, when `making` another, the least recently used past
        `max_sessions`."""
        idle_s, cap, now = self.endpoint.session_idle_s, self.endpoint.max_sessions, time.monotonic()
        for sample_id, session in list(self.sessions.items()):
            if idle_s and now - session.last_used > idle_s:
                reason = f"idle for more than {idle_s:g} s"
            elif making and cap and len(self.sessions) >= cap:
                reason = f"closed as the least recently used of {cap} sessions (--max-sessions)"
            else:
                return
            if session.lock.locked():  # generating: it is in use
                continue
            session.evicted = reason
            del self.sessions[sample_id]
            if session.segments:
                self.closed.append(session)

    async def answer(self, request: Request, endpoint: str) -> Response:
        """The reply to a chat, completion or Responses request: JSON, or server-sent events when it asked to
        stream."""
        with self._sessions_lock:
            named = request.path_params.get("sample") or request.headers.get(SESSION_HEADER) or DEFAULT_SAMPLE
            self._num_calls[named[:512]] += 1
        try:
            body = await _read_body(request, self.endpoint.max_request_bytes)
            previous = None
            if endpoint == "responses":
                given, streams = body.get("previous_response_id"), body.get("stream") is True
                body, previous = to_chat(body, self.responses)
            sample, label = _sample_of(request, previous or DEFAULT_SAMPLE)
            if endpoint == "generate":
                call = read_generate(body, self.limits, self.stop_ids)
            else:
                call = (read_completion if endpoint == "completion" else read_chat)(body, self.limits)
            named = previous is not None or request.path_params.get("sample") or SESSION_HEADER in request.headers
            sessions = self._hold(self._choices(sample, call), label) if named else self._hold_unnamed(call.settings.n)
            sample = sessions[0].sample_id
            is_live = False
            try:
                if call.settings.stream or endpoint == "responses" and streams:  # sent as the tokens come (live.py)
                    prepared = await prepare_turns(self, sessions, call)
                    live = (
                        LiveReply(self, sessions, call, prepared)
                        if endpoint != "responses"
                        else LiveResponse(self, sessions, call, prepared, given, body.get("store") is not False, sample)
                    )
                    is_live = True  # the reply's task releases the sessions once their turns are recorded
                    headers = {"Cache-Control": "no-cache"}
                    return StreamingResponse(live.events(), media_type="text/event-stream", headers=headers)
                turns = await generate_turns(self, sessions, call)
            finally:
                if not is_live:
                    for session in sessions:
                        session.lock.release()
        except RequestError as e:
            return _error(e.status, str(e), e.code, e.param)
        except UserError as e:  # e.g. a template that cannot render the messages, an image that cannot be read
            return _error(400, str(e), "invalid_request")
        except EngineFailed as e:  # closing, or the engine failed on an earlier request: nothing more is generated
            return _error(503, str(e), "service_unavailable")
        except Exception as e:  # the template, the engine: reported to the client and logged; the server keeps serving
            print(f"rlx serve: a {endpoint} request failed:\n{''.join(traceback.format_exception(e))}", file=sys.stderr,
                  flush=True)  # fmt: skip
            return _error(500, f"the server failed on this request ({type(e).__name__}: {e})"[:300], "server_error")
        if endpoint == "generate":
            return JSONResponse(generate_reply(turns[0]))
        if endpoint == "responses":
            return self._response(turns[0], call, sample, given, store=body.get("store") is not False)
        return self._respond(turns, endpoint)

    def _response(self, turn, call, sample: str, previous: str | None, store: bool) -> Response:
        """A Responses API reply (not streamed): the `response` object, kept for `previous_response_id` unless
        `store` is false."""
        reply = response_object(turn, self.model_name, previous)
        if store:
            self.responses.put(reply["id"], sample, [*call.messages, turn.message])
        return JSONResponse(reply)

    def _choices(self, sample: str, call) -> list[SampleSession]:
        """The sessions of a request's choices: `sample`, then `<sample>~i` for choice i > 0."""
        return [self.session(name) for name in [sample] + [f"{sample}~{i}" for i in range(1, call.settings.n)]]

    def _hold_unnamed(self, n: int) -> list[SampleSession]:
        """The sessions of a request that names no sample, held: 'default' where it is free, else the first free of
        'default@2', 'default@3', ... (concurrent clients that send no X-Session-ID are answered side by side, as
        vLLM answers them; their trajectories are then split between those samples by arrival, not by conversation)."""
        for lane in range(1, MAX_UNNAMED + 1):
            sample = DEFAULT_SAMPLE if lane == 1 else f"{DEFAULT_SAMPLE}@{lane}"
            names = [sample] + [f"{sample}~{i}" for i in range(1, n)]
            sessions = [self.session(name) for name in names]
            if all(not s.lock.locked() for s in sessions):
                with contextlib.suppress(RequestError):  # taken between the look and the hold: the next lane
                    return self._hold(sessions)
        raise RequestError(429, f"{MAX_UNNAMED} requests without an X-Session-ID are being answered; wait for one",
                           "too_many_requests")  # fmt: skip

    @staticmethod
    def _hold(sessions: list[SampleSession], label: str | None = None) -> list[SampleSession]:
        """`sessions` with their locks taken, each keeping the client's `label` (its X-Session-ID, where the path named
        the sample); HTTP 409 when one is answering another request (none is then held)."""
        for held, session in enumerate(sessions):
            if not session.lock.acquire(blocking=False):
                for other in sessions[:held]:
                    other.lock.release()
                raise RequestError(
                    409,
                    f"sample {session.sample_id!r} is still answering its request {session.num_requests + 1} while "
                    f"request {session.num_requests + 2} came for it: two conversations under one sample id would "
                    f"merge into one trajectory; give each its own X-Session-ID header or /s/<id>/v1 base URL",
                    "session_busy",
                )
        if label is not None:
            for session in sessions:
                session.add_client_label(label)
        return sessions

    def _respond(self, turns: list[Turn], endpoint: str) -> Response:
        name = self.model_name
        return JSONResponse(chat_reply(turns, name) if endpoint == "chat" else completion_reply(turns, name))

    def health(self) -> Response:
        """vLLM's probe: 200 while requests are generated, 503 once the engine failed or the server is closing."""
        if self.worker.is_alive:
            return Response(status_code=200)
        failed = self.worker.failed
        return _error(503, str(failed) if failed else "the server is closing", "service_unavailable")

    def models(self, request: Request) -> Response:
        wanted = request.path_params.get("model_id")
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "rlx"}
        if wanted is None:
            return JSONResponse({"object": "list", "data": [card]})
        if wanted != self.model_name:
            message = f"model {wanted!r:.80} does not exist; this server serves {self.model_name!r}"
            return _error(404, message, "model_not_found", "model")
        return JSONResponse(card)


def _sample_of(request: Request, fallback: str = DEFAULT_SAMPLE) -> tuple[str, str | None]:
    """(the sample the path names, else the X-Session-ID header, else `fallback`; the header where the path named the
    sample: the client's own label, kept with the sample, else None)."""
    from_path, from_header = request.path_params.get("sample"), request.headers.get(SESSION_HEADER)
    sample = from_path or from_header or fallback
    label = from_header if from_path and from_header else None
    for name in (sample, label):
        if name is not None and (len(name) > 512 or not name.isprintable()):
            raise RequestError(400, "a sample id (or X-Session-ID) must be printable and at most 512 characters")
    return sample, label


async def _read_body(request: Request, limit: int) -> dict:
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise RequestError(413, f"the request body is over {limit} bytes (--max-request-mib)", "request_too_large")
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > limit:
            raise RequestError(413, f"the request body is over {limit} bytes (--max-request-mib)", "request_too_large")
    try:
        body = json.loads(data or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(400, f"the body is not JSON: {e}"[:200]) from None
    except RecursionError:
        raise RequestError(400, "the body's JSON is nested too deeply") from None
    if not isinstance(body, dict):
        raise RequestError(400, "the body must be a JSON object")
    return body


def _error(status: int, message: str, code: str, param: str | None = None) -> JSONResponse:
    kinds = {401: "authentication_error", 404: "not_found_error", 409: "conflict_error", 429: "rate_limit_error",
             500: "server_error", 503: "server_error"}  # fmt: skip
    body = {"error": {"message": message, "type": kinds.get(status, "invalid_request_error"), "code": code,
                      "param": param}}  # fmt: skip
    # OpenAI's clients retry a 409 unless told not to: a retry would only land in the busy sample later
    headers = {"x-should-retry": "false"} if status == 409 else None
    return JSONResponse(body, status_code=status, headers=headers)


def _app(server: AgentServer) -> Starlette:
    """The routes, each behind the API key check."""

    def guarded(handler):
        async def endpoint(request: Request) -> Response:
            key = server.endpoint.api_key
            if key:
                given = request.headers.get("authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                    return _error(401, "missing or wrong API key (Authorization: Bearer <key>)", "invalid_api_key")
            return await handler(request)

        return endpoint

    def answering(endpoint: str):
        async def handler(request: Request) -> Response:
            return await server.answer(request, endpoint)

        return handler

    async def models(request: Request) -> Response:
        return server.models(request)

    async def health(request: Request) -> Response:
        return server.health()

    routes = [Route("/health", health, methods=["GET"])]  # unguarded, as vLLM's: probes carry no key
    for prefix in ("", "/s/{sample:path}"):
        routes += [
            Route(f"{prefix}/v1/chat/completions", guarded(answering("chat")), methods=["POST"]),
            Route(f"{prefix}/v1/completions", guarded(answering("completion")), methods=["POST"]),
            Route(f"{prefix}/v1/models", guarded(models), methods=["GET"]),
            Route(f"{prefix}/v1/models/{{model_id:path}}", guarded(models), methods=["GET"]),
            Route(f"{prefix}/v1/responses", guarded(answering("responses")), methods=["POST"]),
            Route(f"{prefix}/inference/v1/generate", guarded(answering("generate")), methods=["POST"]),
        ]

    async def not_found(request: Request, exc) -> Response:
        status = getattr(exc, "status_code", 404)
        if status == 405:
            return _error(405, f"{request.url.path!r:.120} does not take {request.method}", "method_not_allowed")
        message = f"no route {request.url.path!r:.120}; use {{base_url}}/chat/completions or /completions"
        return _error(404, message, "not_found")

    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found})
