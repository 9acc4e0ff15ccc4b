"""An OpenAI-compatible HTTP endpoint on localhost whose every request lands in a sample's trajectory.

Routes (POST bodies as the OpenAI API takes them; non-streaming, one choice):
    /s/<sample_id>/v1/chat/completions   chat, with `tools` and `tool_calls` in replies
    /s/<sample_id>/v1/completions        text (or token-id) prompts
    /s/<sample_id>/v1/models             GET: the served model
    /v1/...                              the same for the sample 'default'
`base_url(sample_id)` is what an agent gives its OpenAI client. Handler threads plan the request in
the sample's session (sessions.py), wait for the batching backend, and record the result; requests of
one sample are handled one at a time, in arrival order, and an agent's turn count is its own (no
max_turns here). Sampling
settings are the server's (the trainer must know the temperature); a request's `max_tokens` may
only lower the per-turn limit. The whole context of a sample is capped at `max_total_tokens`: a
request past it gets HTTP 400 with code 'context_length_exceeded', as OpenAI answers. Chat messages may hold
images on a vision-language model served by the hf or native engine (request_images.py: `image_url` parts with a
data: URI, a local path or a file:// URL, or rlx's `image` parts); an image that cannot be used (unreadable, an
http(s) URL, a text-only model or an engine without images) is HTTP 400 naming it, and the server keeps serving.
"""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import quote, unquote, urlsplit

from rlx.errors import UserError
from rlx.rollout.agent_config import AgentConfig
from rlx.rollout.config import SamplingParams
from rlx.rollout.requests import TokenRequest
from rlx.rollout.stops import StopStrings
from rlx.serve.request_images import RequestImages
from rlx.serve.sessions import SampleSession
from rlx.serve.stream import StreamBackend

_ROUTE = re.compile(r"^(?:/s/(?P<sample>[^/]+))?/v1/(?P<endpoint>chat/completions|completions|models)/?$")
DEFAULT_SAMPLE = "default"


class RequestError(Exception):
    """A request the server refuses: HTTP status, OpenAI error code, one-line message."""

    def __init__(self, status: int, message: str, code: str = "invalid_request"):
        super().__init__(message)
        self.status, self.code = status, code


def _positive_int(body: dict, key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RequestError(400, f"'{key}' must be a positive integer, got {value!r}")
    return value


def _check_common(body: dict) -> None:
    if body.get("stream"):
        raise RequestError(400, "streaming is not supported; send stream=false")
    if body.get("n") not in (None, 1):
        raise RequestError(400, f"'n' must be 1 (one choice per request), got {body.get('n')!r}")


class AgentServer:
    """The HTTP server, its sessions (one per sample id) and the backend that generates for it."""

    def __init__(
        self,
        backend: StreamBackend,
        tokenizer,
        stop_ids: set[int],
        sampling: SamplingParams,
        cfg: AgentConfig,
        model_name: str = "rlx",
        port: int = 0,
    ):
        self.backend, self.tokenizer, self.stop_ids = backend, tokenizer, set(stop_ids)
        self.sampling, self.cfg, self.model_name = sampling, cfg, model_name
        self.images = RequestImages.of_engine(backend.engine)
        """What the engine makes of image parts: shared by the samples (one processed copy of each image)."""
        self.sessions: dict[str, SampleSession] = {}
        self._sessions_lock = threading.Lock()
        # a fast tokenizer's Rust core may refuse calls from two threads at once ("Already borrowed")
        self._tokenizer_lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), _Handler)
        self._httpd.daemon_threads = True
        self._httpd.app = self
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def base_url(self, sample_id: str) -> str:
        """The OpenAI base URL whose requests all belong to `sample_id`."""
        return f"{self.url}/s/{quote(sample_id, safe='')}/v1"

    def start(self) -> AgentServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="rlx-serve-http", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> AgentServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def session(self, sample_id: str) -> SampleSession:
        with self._sessions_lock:
            if sample_id not in self.sessions:
                stops = StopStrings(self.tokenizer, self.sampling.stop) if self.sampling.stop else None
                self.sessions[sample_id] = SampleSession(
                    sample_id, self.tokenizer, self.stop_ids, self.cfg, stops, self.images
                )
            return self.sessions[sample_id]

    def handle(self, method: str, path: str, body: bytes) -> tuple[int, dict]:
        """(HTTP status, JSON reply) for one request."""
        route = _ROUTE.match(urlsplit(path).path)
        if route is None:
            return 404, _error(f"no route {path!r}; use {{base_url}}/chat/completions or /completions", "not_found")
        endpoint, sample = route["endpoint"], unquote(route["sample"] or DEFAULT_SAMPLE)
        if endpoint == "models":
            return 200, {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "rlx"}]}
        if method != "POST":
            return 405, _error(f"{endpoint} takes POST", "method_not_allowed")
        try:
            try:
                request = json.loads(body or b"{}")
            except json.JSONDecodeError as e:
                raise RequestError(400, f"the body is not JSON: {e}") from None
            if not isinstance(request, dict):
                raise RequestError(400, "the body must be a JSON object")
            _check_common(request)
            if endpoint == "chat/completions":
                return 200, self._chat(self.session(sample), request)
            return 200, self._completion(self.session(sample), request)
        except RequestError as e:
            return e.status, _error(str(e), e.code)
        except UserError as e:  # e.g. a template that cannot render the messages, or no chat template
            return 400, _error(str(e), "invalid_request")
        except Exception as e:  # the template, the engine: reported to the client, the server keeps serving
            return 500, _error(f"{type(e).__name__}: {e}", "server_error")

    def _generate(self, session: SampleSession, context_ids: list[int], request: dict, vision=None):
        room = self.cfg.max_total_tokens - len(context_ids)
        if room < 1:
            session.hit_token_limit = True
            raise RequestError(
                400,
                f"sample {session.sample_id!r}: the context is {len(context_ids)} tokens, at the limit "
                f"max_total_tokens = {self.cfg.max_total_tokens}",
                "context_length_exceeded",
            )
        asked = _positive_int(request, "max_completion_tokens") or _positive_int(request, "max_tokens")
        limit = min(self.sampling.max_new_tokens, asked or self.sampling.max_new_tokens, room)
        key = f"{session.sample_id}/{session.num_requests}"
        greedy = self.sampling.temperature == 0
        return self.backend.generate(TokenRequest(key, context_ids, limit, greedy, vision=vision))

    def _chat(self, session: SampleSession, request: dict) -> dict:
        messages, tools = request.get("messages"), request.get("tools") or None
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "'messages' must be a non-empty list")
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise RequestError(400, "every message must be an object with a 'role' string")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise RequestError(400, "'tools' must be a list of function schemas")
        with session.lock:
            try:
                read = session.read_messages(messages)  # images are loaded here, not under the tokenizer lock
                with self._tokenizer_lock:
                    plan = session.plan_chat(read, tools)
            except (KeyError, TypeError, ValueError) as e:
                raise RequestError(400, f"a message could not be read: {type(e).__name__}: {e}") from None
            gen = self._generate(session, plan.context_ids, request, plan.vision)
            with self._tokenizer_lock:
                message, _ = session.commit(plan, gen)
        reason = "length" if gen.finish_reason == "length" else "tool_calls" if message.get("tool_calls") else "stop"
        choice = {"index": 0, "message": message, "finish_reason": reason, "logprobs": None}
        return self._reply("chat.completion", choice, len(plan.context_ids), len(gen.response_ids))

    def _completion(self, session: SampleSession, request: dict) -> dict:
        prompt = request.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        is_ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        if not (isinstance(prompt, str) and prompt) and not (is_ids and prompt):
            raise RequestError(400, "'prompt' must be a non-empty string or a list of token ids")
        with session.lock:
            with self._tokenizer_lock:
                plan = session.plan_completion(prompt)
            gen = self._generate(session, plan.context_ids, request)
            with self._tokenizer_lock:
                text, _ = session.commit(plan, gen)
        choice = {"index": 0, "text": text, "finish_reason": gen.finish_reason, "logprobs": None}
        return self._reply("text_completion", choice, len(plan.context_ids), len(gen.response_ids))

    def _reply(self, kind: str, choice: dict, prompt_tokens: int, completion_tokens: int) -> dict:
        return {
            "id": f"rlx-{time.monotonic_ns()}",
            "object": kind,
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }


def _error(message: str, code: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "code": code, "param": None}}


class _Handler(BaseHTTPRequestHandler):
    """HTTP/1.1 with keep-alive (OpenAI clients reuse connections); JSON in, JSON out."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self._respond(*self.server.app.handle("GET", self.path, b""))

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        self._respond(*self.server.app.handle("POST", self.path, body))

    def _respond(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class's name
        """Quiet: one line per request would drown the rollout's own output."""
