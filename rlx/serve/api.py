"""Requests to the endpoint read into typed requests: every field OpenAI's API defines is honoured or refused.

`read_chat` and `read_completion` take a request body (a JSON object) and give a `ChatCall` or `CompletionCall`;
a field the server cannot honour is a `RequestError` (HTTP 400) naming it, so a client never gets a reply that
silently ignored what it asked for. How each field is treated is in docs/serve.md; in short:

- honoured: messages/prompt, model (must be the served name: 404 otherwise), max_tokens/max_completion_tokens (at
  most the server's --max-new-tokens), seed, stop, stream (+ stream_options include_usage and vLLM's
  continuous_usage_stats), tools, tool_choice
  'none'/'auto' (tool calls are read only where tools are offered and tool_choice is not 'none'), logprobs and
  top_logprobs (chat: at most MAX_TOP_LOGPROBS; completions: logprobs = how many alternatives, at most
  MAX_COMPLETION_LOGPROBS; engines hf and native), echo (streamed too; with logprobs, the prompt's tokens are listed
  first, the first one's logprob null, as vLLM lists them: engines hf and native), vLLM's extensions return_token_ids
  and prompt_logprobs (each prompt token's logprob, rank and at most MAX_PROMPT_LOGPROBS alternatives, scored by the
  served model teacher-forced; not in a stream; engines hf and native), and metadata that changes no token (user,
  metadata, store, service_tier, ...: recorded with the turn);
- temperature (0: greedy), top_p and top_k: the request's own where it sends them (the server's flags otherwise);
- n > 1 in `rlx serve`: choice i > 0 is recorded as its own sample, `<sample_id>~i` (at most MAX_CHOICES);
- response_format json_object / json_schema: sampled within the JSON grammar (rlx.rollout.constraints: llguidance,
  the extra rlx[grammar]; engines hf and native);
- tool_choice 'required' or a named function: the turn is sampled within a grammar of one call of the offered (or
  named) tools in the block the tool parser reads (Grammars.for_tool_call in rlx.rollout.constraints; llguidance,
  engines hf and native), its logprobs those of the masked distribution;
- refused: penalties, logit_bias, audio, predictions, reasoning effort, web search, the deprecated functions, and
  any field OpenAI does not define.

Under `rlx rollout --agent` (`strict`), the run's sampling governs: a request asking for another temperature, top_p,
top_k, seed, stop strings, n > 1, a response_format other than text or a required tool call is refused too, as
training needs every turn sampled from the policy as the run says (a grammar changes the distribution sampled from).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rlx.rollout.config import SamplingParams

MAX_CHOICES = 16
"""Most choices (n) one request may ask for."""
MAX_TOP_LOGPROBS = 20
"""Most alternatives per position a chat request may ask for (top_logprobs), as OpenAI's API allows."""
MAX_COMPLETION_LOGPROBS = 5
"""Most alternatives per position a completions request may ask for (logprobs), as OpenAI's API allows."""
MAX_PROMPT_LOGPROBS = 20
"""Most alternatives per prompt token a request may ask for (vLLM's prompt_logprobs; vLLM's default max_logprobs)."""


class RequestError(Exception):
    """A request the server refuses: HTTP status, OpenAI error code, one-line message, the field it is about."""

    def __init__(self, status: int, message: str, code: str = "invalid_request", param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


def refuse(name: str, why: str) -> RequestError:
    return RequestError(400, f"'{name}': {why}", "unsupported_parameter", name)


@dataclass(frozen=True)
class Limits:
    """What the server honours: its sampling, the served name, and whether the run's sampling governs (agents)."""

    sampling: SamplingParams
    model_name: str
    strict: bool = False
    has_top_logprobs: bool = True
    """Whether the engine reports the most likely alternatives of each token (top_logprobs)."""
    has_grammars: bool = True
    """Whether the engine samples within a grammar (response_format json_*); the library is checked per request."""
    vocab_size: int = 0
    """The model's vocabulary: token ids a client sends must be below it (0: not checked)."""
    has_prompt_logprobs: bool = False
    """Whether the engine scores a prompt's own tokens (vLLM's prompt_logprobs, completions' echo with logprobs)."""
    engine: str = ""
    """The engine's name, for refusals of what it cannot do."""


@dataclass
class Settings:
    """What one request asks of the generation (both endpoints)."""

    max_tokens: int
    max_tokens_given: bool = False
    """Whether the client sent max_tokens (or max_completion_tokens): a context too full for them is then 400, as
    vLLM answers, where the server's default is cut to the room left."""
    n: int = 1
    """Choices: choice i > 0 is recorded as sample `<sample_id>~i` (server.py)."""
    seed: int | None = None
    temperature: float | None = None
    """The request's own sampling (None: the server's): TokenRequest's per-request fields."""
    top_p: float | None = None
    top_k: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    """stream_options.include_usage: a last chunk with the request's usage."""
    continuous_usage: bool = False
    """stream_options.continuous_usage_stats (vLLM's): every chunk has its choice's usage so far."""
    logprobs: bool = False
    top_logprobs: int = 0
    """Alternatives per position to report with the logprobs (chat top_logprobs, completions logprobs = k)."""
    return_token_ids: bool = False
    prompt_logprobs: int | None = None
    """vLLM's prompt_logprobs: the reply lists each prompt token's logprob with this many alternatives (None: not
    asked; a completion with echo and logprobs asks for it as vLLM does, with its logprobs' count)."""
    echo_logprobs: bool = False
    """Completions with echo and logprobs: the choice's logprobs list the prompt's tokens before the sampled ones."""
    json_schema: dict | None = None
    """response_format json_schema's schema ({} for json_object: any JSON object); None: free text."""
    required_tools: list[dict] | None = None
    """tool_choice 'required' (every offered tool) or a named function (that one): the turn samples one call of
    these within the tool-call grammar; None: the model chooses."""
    is_named_tool: bool = False
    """tool_choice named a function: the reply's finish_reason is then 'stop', as OpenAI's and vLLM's."""
    recorded: dict = field(default_factory=dict)
    """What the turn used, as the record keeps it (sampling and the request's metadata)."""

    @property
    def prompt_top(self) -> int | None:
        """Alternatives to compute per prompt token (the most either list shows), None where no prompt is scored."""
        if self.prompt_logprobs is None and not self.echo_logprobs:
            return None
        return max(self.prompt_logprobs or 0, self.top_logprobs if self.echo_logprobs else 0)


@dataclass
class ChatCall:
    messages: list[dict]
    tools: list[dict] | None
    settings: Settings
    parse_tools: bool = True
    """tool_choice 'none' or no tools: the reply's text is not read for tool calls."""


@dataclass
class CompletionCall:
    prompt: str | list[int]
    settings: Settings
    echo: bool = False


METADATA_FIELDS = ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
             "prompt_cache_retention")  # fmt: skip
"""Fields that change no token: accepted and recorded with the turn."""
_OFF = {
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "parallel_tool_calls": (None, True),
    "modalities": (None, ["text"]),
    "best_of": (None, 1),
    "suffix": (None, ""),
}
"""Fields honoured only at their neutral value (any other is refused by name)."""
_COMMON = {
    "model", "max_tokens", "seed", "stop", "stream", "stream_options", "temperature", "top_p", "top_k", "logprobs",
    "return_token_ids", "prompt_logprobs", "n", "frequency_penalty", "presence_penalty", "logit_bias", *METADATA_FIELDS,
}  # fmt: skip
CHAT_FIELDS = _COMMON | {
    "messages", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls", "top_logprobs",
    "response_format", "audio", "prediction", "reasoning_effort", "verbosity", "web_search_options", "functions",
    "function_call", "modalities",
}  # fmt: skip
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "best_of"}


def _check_known(body: dict, known: set[str]) -> None:
    for name in body:
        if name not in known:
            raise refuse(
                name, "not a field this endpoint knows (OpenAI's API, or vLLM's return_token_ids and prompt_logprobs)"
            )
    for name, allowed in _OFF.items():
        value = body.get(name)
        if name in body and not any(value == a and type(value) is type(a) or value is a for a in allowed):
            shown = " or ".join(repr(a) for a in allowed if a is not None) or "leaving it out"
            raise refuse(name, f"only {shown} is supported here, got {value!r:.80}")


def _int(body: dict, name: str, low: int = 0) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise RequestError(400, f"'{name}' must be an integer >= {low}, got {value!r:.80}", param=name)
    return value


def _bool(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise RequestError(400, f"'{name}' must be true or false, got {value!r:.80}", param=name)
    return bool(value)


SAMPLING_FIELDS = {  # name: (what a value must be, whether it is, the run's flag)
    "temperature": ("a number >= 0", lambda v: math.isfinite(v) and v >= 0, "--temperature"),
    "top_p": ("a number in (0, 1]", lambda v: 0 < v <= 1, "--top-p"),
    "top_k": ("an integer >= -1 (0 or -1: off)", lambda v: isinstance(v, int) and v >= -1, "--top-k"),
}


def _sampling_asked(body: dict, limits: Limits) -> dict:
    """The request's own temperature / top_p / top_k (those it sends); under `strict` only the run's values pass."""
    asked = {}
    for name, (kind, valid, flag) in SAMPLING_FIELDS.items():
        value, started = body.get(name), getattr(limits.sampling, name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not valid(value):
            raise RequestError(400, f"'{name}' must be {kind}, got {value!r:.80}", param=name)
        same = value == started or (name == "top_k" and value in (0, -1) and started in (0, -1))
        if limits.strict and not same:
            raise refuse(name, f"this rollout samples with the run's {name} = {started} ({flag}), got {value}")
        asked[name] = value
    return asked


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        message = f"'stop' must be a string or up to 4 non-empty strings, got {value!r:.80}"
        raise RequestError(400, message, param="stop")
    return tuple(stops)


def _settings(body: dict, limits: Limits, max_key: str) -> Settings:
    own = _sampling_asked(body, limits)
    model = body.get("model")
    if model is not None and model != limits.model_name:
        raise RequestError(404, f"model {model!r:.80} does not exist; this server serves {limits.model_name!r}",
                           "model_not_found", "model")  # fmt: skip
    limit = limits.sampling.max_new_tokens
    asked = [(k, _int(body, k, 1)) for k in (max_key, "max_tokens") if body.get(k) is not None]
    if len({v for _, v in asked}) > 1:
        raise RequestError(400, f"'{max_key}' and 'max_tokens' differ; send one", param=max_key)
    for key, value in asked:
        if value > limit:
            raise refuse(key, f"at most {limit} (this server's --max-new-tokens), got {value}")
    seed, stop = _int(body, "seed"), _stop(body)
    if limits.strict:
        if seed is not None and seed != limits.sampling.seed:
            raise refuse("seed", f"this rollout samples with the run's seed ({limits.sampling.seed}); leave it out")
        if stop and stop != tuple(limits.sampling.stop):
            raise refuse("stop", "this rollout stops as the run's --stop says; leave it out")
    n = _int(body, "n", 1) or 1
    if n > 1 and limits.strict:
        raise refuse("n", "this rollout samples the run's n per prompt itself; ask one choice per request")
    if n > MAX_CHOICES:
        raise refuse("n", f"at most {MAX_CHOICES} choices per request, got {n}")
    stream = _bool(body, "stream")
    include_usage, continuous_usage = _stream_options(body, stream)
    settings = Settings(
        max_tokens=asked[0][1] if asked else limit, max_tokens_given=bool(asked), n=n, seed=seed, stop=stop,
        stream=stream, **own, include_usage=include_usage, continuous_usage=continuous_usage,
        return_token_ids=_bool(body, "return_token_ids"),
    )  # fmt: skip
    settings.recorded = {
        "max_tokens": settings.max_tokens,
        **{k: getattr(limits.sampling, k) for k in SAMPLING_FIELDS},
        **own,
        "seed": limits.sampling.seed if seed is None else seed,
        **({"stop": list(stop)} if stop else {}),
        **({"n": n} if n > 1 else {}),
        **{k: body[k] for k in METADATA_FIELDS if body.get(k) is not None},
    }
    return settings


STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")
"""The stream_options honoured (vLLM's StreamOptions); any other is refused by name."""


def _stream_options(body: dict, stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) of stream_options, which only a streamed request may send (as vLLM
    answers; `{}` and null pass)."""
    options = body.get("stream_options")
    if options is None or options == {}:
        return False, False
    if not stream:
        raise refuse("stream_options", "only with stream: true")
    if not isinstance(options, dict):
        raise RequestError(400, f"'stream_options' must be an object, got {options!r:.80}", param="stream_options")
    for key, value in options.items():
        name = f"stream_options.{key}"
        if key not in STREAM_OPTIONS:
            raise refuse(name, f"not an option this server honours ({', '.join(STREAM_OPTIONS)} are)")
        if value is not None and not isinstance(value, bool):
            raise RequestError(400, f"'{name}' must be true or false, got {value!r:.80}", param=name)
    include, continuous = bool(options.get("include_usage")), bool(options.get("continuous_usage_stats"))
    if continuous and not include:  # vLLM then sends no usage at all: asked for, it would be ignored
        raise refuse("stream_options.continuous_usage_stats", "needs include_usage: true")
    return include, continuous


def _top(limits: Limits, name: str, count: int, most: int) -> int:
    if count > most:
        raise refuse(name, f"at most {most} alternatives per token, got {count}")
    if count and not limits.has_top_logprobs:
        raise refuse(name, "this server's engine does not report alternatives (engines hf and native do); ask 0")
    return count


def _prompt_logprobs(body: dict, limits: Limits, stream: bool) -> int | None:
    """vLLM's prompt_logprobs: how many alternatives to list per prompt token (None: not asked)."""
    count = _int(body, "prompt_logprobs")
    if count is None:
        return None
    if count > MAX_PROMPT_LOGPROBS:
        raise refuse("prompt_logprobs", f"at most {MAX_PROMPT_LOGPROBS} alternatives per token, got {count}")
    if stream:  # a chunk has no place for them: vLLM refuses them in a stream too
        raise refuse("prompt_logprobs", "not with stream: true (a streamed reply does not carry them, as on vLLM)")
    _check_prompt_logprobs("prompt_logprobs", limits)
    return count


def _check_prompt_logprobs(name: str, limits: Limits) -> None:
    if not limits.has_prompt_logprobs:
        why = "does not compute the logprobs of the prompt's own tokens (engines hf and native do)"
        raise refuse(name, f"this server's engine ({limits.engine or 'unknown'}) {why}")


def _json_schema(response_format, limits: Limits) -> dict | None:
    """The schema a response_format asks the reply to follow ({}: any JSON object), None for text."""
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if response_format is None or response_format == {"type": "text"}:
        return None
    if kind not in ("json_object", "json_schema"):
        raise refuse("response_format", f"'text', 'json_object' or 'json_schema' are supported, got {kind!r:.80}")
    _check_grammars("response_format", limits, "ask for text and validate the reply instead")
    if kind == "json_object":
        return {}
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise RequestError(400, "'response_format.json_schema.schema' must be a JSON schema object",
                           param="response_format")  # fmt: skip
    return schema


def _check_grammars(name: str, limits: Limits, instead: str) -> None:
    """Refuse `name` where this server cannot sample within a grammar, or must not (an RL run's agents)."""
    from rlx.rollout.constraints import EXTRA, grammar_library_available  # torch: not at the module's import

    if limits.strict:
        why = "a grammar changes the distribution sampled from, so its turns are not the policy's samples this run "
        raise refuse(name, f"{why}trains on; {instead}")
    if not limits.has_grammars:
        raise refuse(name, "this server's engine does not sample within a grammar (hf and native do)")
    if not grammar_library_available():
        raise refuse(name, f"constrained sampling needs llguidance: {EXTRA}")


def _required_tools(choice, tools: list[dict] | None, limits: Limits) -> list[dict] | None:
    """The tools a tool_choice makes the turn call one of ('required': any offered; a named function: that one),
    None for 'none'/'auto'/unset."""
    if choice in (None, "none", "auto"):
        return None
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if choice != "required" and not (isinstance(choice, dict) and choice.get("type") == "function" and named):
        raise refuse("tool_choice", f"'none', 'auto', 'required' or a named function, got {choice!r:.80}")
    if not tools:
        raise refuse("tool_choice", "a required tool call needs 'tools'")
    _check_grammars("tool_choice", limits, "use 'auto' (the model then decides whether to call)")
    if named is None:
        return tools
    chosen = [t for t in tools if (t.get("function") or {}).get("name") == named]
    if not chosen:
        raise refuse("tool_choice", f"names the function {named!r:.80}, which 'tools' does not offer")
    return chosen


def read_chat(body: dict, limits: Limits) -> ChatCall:
    """A chat-completions body as a typed call (RequestError naming the field it cannot honour)."""
    _check_known(body, CHAT_FIELDS)
    settings = _settings(body, limits, "max_completion_tokens")
    settings.logprobs = _bool(body, "logprobs")
    settings.top_logprobs = _top(limits, "top_logprobs", _int(body, "top_logprobs") or 0, MAX_TOP_LOGPROBS)
    settings.prompt_logprobs = _prompt_logprobs(body, limits, settings.stream)
    if settings.top_logprobs and not settings.logprobs:
        raise refuse("top_logprobs", "needs logprobs: true")
    messages, tools = body.get("messages"), body.get("tools") or None
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "'messages' must be a non-empty list", param="messages")
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise RequestError(400, "every message must be an object with a 'role' string", param="messages")
    for i, message in enumerate(messages):  # as OpenAI's API: only an assistant turn with tool calls may lack content
        if message.get("content") is None and not (message["role"] == "assistant" and message.get("tool_calls")):
            raise RequestError(400, f"messages[{i}] ({message['role']!r:.40}) has no 'content'",
                               param=f"messages[{i}].content")  # fmt: skip
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise RequestError(400, "'tools' must be a list of function schemas", param="tools")
    choice = body.get("tool_choice")
    settings.required_tools = _required_tools(choice, tools, limits)
    settings.is_named_tool = isinstance(choice, dict)
    settings.json_schema = _json_schema(body.get("response_format"), limits)
    if settings.json_schema is not None:
        settings.recorded["response_format"] = body["response_format"]
        if settings.required_tools is not None:
            raise refuse("tool_choice", "a required tool call and a response_format cannot both constrain one turn")
    if choice not in (None, "auto"):
        settings.recorded["tool_choice"] = choice
    # no tools offered, no tool calls read (vLLM's default tool_choice 'none' then): a reply never names a function
    # the client did not offer, and the text the model wrote stays its content
    return ChatCall(messages, tools, settings, parse_tools=choice != "none" and tools is not None)


def read_completion(body: dict, limits: Limits) -> CompletionCall:
    """A completions body as a typed call (RequestError naming the field it cannot honour)."""
    _check_known(body, COMPLETION_FIELDS)
    settings = _settings(body, limits, "max_tokens")
    logprobs = _int(body, "logprobs")
    settings.logprobs = logprobs is not None
    settings.top_logprobs = _top(limits, "logprobs", logprobs or 0, MAX_COMPLETION_LOGPROBS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    is_ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not (is_ids and prompt):
        raise RequestError(400, "'prompt' must be a non-empty string or a list of token ids (one prompt)",
                           param="prompt")  # fmt: skip
    if is_ids:
        _check_ids(prompt, limits, "prompt")
    settings.prompt_logprobs = _prompt_logprobs(body, limits, settings.stream)
    echo = _bool(body, "echo")
    if echo and settings.logprobs:  # vLLM's reply then lists the prompt tokens' logprobs before the sampled ones'
        _check_prompt_logprobs("echo", limits)
        settings.echo_logprobs = True
        if settings.prompt_logprobs is None and not settings.stream:  # vLLM's choice then has them as prompt_logprobs
            settings.prompt_logprobs = settings.top_logprobs
    return CompletionCall(prompt, settings, echo)


def out_of_vocabulary(ids: list[int], vocab_size: int) -> int | None:
    """The index of the first id outside [0, vocab_size) (vocab_size 0: unknown, only negatives count), else None."""
    return next((i for i, t in enumerate(ids) if t < 0 or (vocab_size and t >= vocab_size)), None)


def _check_ids(ids: list[int], limits: Limits, param: str) -> None:
    """Token ids a client sent, each in [0, vocab_size) (RequestError naming the first that is not)."""
    i = out_of_vocabulary(ids, limits.vocab_size)
    if i is not None:
        bound = f"[0, {limits.vocab_size})" if limits.vocab_size else ">= 0"
        raise RequestError(400, f"'{param}'[{i}]: token id {ids[i]} is out of vocabulary (ids must be in {bound})",
                           param=param)  # fmt: skip
