"""One request of a sample, from its typed call to its recorded turn: plan, score the prompt (where asked), generate,
cut at stops, commit.

The tokenizer and image work runs in starlette's thread pool (under the server's tokenizer lock: a fast
tokenizer's core takes one thread at a time); the generation is a future of the engine stream awaited on the
event loop, so many samples generate together while the loop keeps answering.
"""

from __future__ import annotations

import asyncio
import contextlib

from starlette.concurrency import run_in_threadpool

from rlx.errors import UserError
from rlx.rollout.requests import Generated, PromptLogprobs, TokenRequest
from rlx.rollout.stops import StopStrings
from rlx.serve.api import ChatCall, CompletionCall, RequestError, refuse
from rlx.serve.replies import PromptTokens, Span, Turn
from rlx.serve.sessions import Plan, SampleSession


def template_renders_tools(server, tools: list[dict]) -> bool:
    """Whether the model's chat template shows `tools` to the model at all (asked once per server; a template that
    cannot render a probe is not judged here: the request's own render reports it)."""
    if server.renders_tools is None:
        probe, kwargs = [{"role": "user", "content": "x"}], server.cfg.chat_template_kwargs
        render = server.tokenizer.apply_chat_template
        try:
            with server.tokenizer_lock:
                with_tools = render(probe, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs)
                without = render(probe, tokenize=False, add_generation_prompt=True, **kwargs)
        except Exception:  # noqa: BLE001 - judged by the request's render
            return True
        server.renders_tools = with_tools != without
    return server.renders_tools


def _plan(server, session: SampleSession, call: ChatCall | CompletionCall) -> Plan:
    if isinstance(call, ChatCall) and call.tools and not template_renders_tools(server, call.tools):
        raise RequestError(
            400, "'tools': this model's chat template does not render tools, so the model would never see them",
            "unsupported_parameter", "tools",
        )  # fmt: skip
    try:
        if isinstance(call, ChatCall):
            read = session.read_messages(call.messages)  # images are loaded here, not under the tokenizer lock
            with server.tokenizer_lock:
                return session.plan_chat(read, call.tools)
        with server.tokenizer_lock:
            return session.plan_completion(call.prompt)
    except (KeyError, TypeError, ValueError) as e:
        raise RequestError(400, f"a message could not be read: {type(e).__name__}: {e}"[:300]) from None


def _token_request(server, session: SampleSession, plan: Plan, call, choice: int = 0) -> TokenRequest:
    context_ids, settings = plan.context_ids, call.settings
    max_context = min(server.cfg.max_total_tokens, server.worker.max_context)
    room = max_context - len(context_ids)
    param = "messages" if isinstance(call, ChatCall) else "prompt"
    if room < 1:
        session.hit_token_limit = True
        raise RequestError(
            400, f"sample {session.sample_id!r}: the context is {len(context_ids)} tokens, leaving no room under the "
            f"limit of {_limit_named(server, max_context)}", "context_length_exceeded", param,
        )  # fmt: skip
    if settings.max_tokens_given and settings.max_tokens > room and not server.limits.strict:
        raise RequestError(  # vLLM's answer; under `rlx rollout --agent` the turn stops with 'length' instead
            400, f"sample {session.sample_id!r}: {len(context_ids)} tokens of context + {settings.max_tokens} asked "
            f"(max_tokens) exceed the limit of {_limit_named(server, max_context)}; ask at most {room}",
            "context_length_exceeded", param,
        )  # fmt: skip
    # a client's own seed makes the draws its alone (the same request and seed, the same reply, on any sample);
    # otherwise each sample's turn draws from its own stream, as a rollout's samples do
    own_seed = settings.seed is not None and not server.limits.strict
    key = f"seed/{choice}" if own_seed else f"{session.sample_id}/{session.num_requests}"
    own = {"temperature": settings.temperature, "top_p": settings.top_p, "top_k": settings.top_k}
    return TokenRequest(key, context_ids, min(settings.max_tokens, room), vision=plan.vision, seed=settings.seed,
                        num_top_logprobs=settings.top_logprobs, num_prompt_routes=len(plan.inserted_ids),
                        **own)  # fmt: skip


def _limit_named(server, max_context: int) -> str:
    """The context limit and the setting that sets it (the server's --max-total-tokens, or the model's context)."""
    if max_context == server.cfg.max_total_tokens:
        return f"{max_context} tokens (--max-total-tokens)"
    return f"{max_context} tokens (the model's context length)"


def _commit(server, session: SampleSession, plan: Plan, gen: Generated, call) -> Turn:
    settings = call.settings
    with server.tokenizer_lock:
        if settings.stop:
            gen = StopStrings(server.tokenizer, settings.stop).cut(gen)
        parse = call.parse_tools if isinstance(call, ChatCall) else True
        reply, _ = session.commit(plan, gen, parse_tools=parse, settings=settings.recorded)
        span = decoded_span(server.tokenizer, gen, 0, len(gen.response_ids), settings.stream or settings.logprobs)
        echoed, stop_reason = echo_text(server.tokenizer, call), _stop_reason(server, session, gen)
    turn = Turn(settings, plan.context_ids, gen.response_ids, gen.logprobs, gen.finish_reason,
                token_texts=span.texts, top_logprobs=span.top, stop_reason=stop_reason, prompt=plan.prompt)  # fmt: skip
    if isinstance(call, ChatCall):
        turn.message = reply
    else:
        turn.text, turn.echo = echoed + reply, echoed
    return turn


def echo_text(tokenizer, call) -> str:
    """The prompt's text a completion with `echo` begins with ('' without echo); under the server's tokenizer lock."""
    if not (isinstance(call, CompletionCall) and call.echo):
        return ""
    return call.prompt if isinstance(call.prompt, str) else tokenizer.decode(call.prompt)


def _stop_reason(server, session: SampleSession, gen: Generated) -> int | str | None:
    """vLLM's stop_reason: the stop string that ended the turn, or the stop token that did unless it is the
    tokenizer's EOS (vLLM stops there as its model's end: None, as for a turn cut at max_tokens)."""
    if gen.finish_reason != "stop" or not gen.response_ids:
        return None
    if gen.stop_string:
        return gen.stop_string
    if session.stops is not None:  # the server's --stop, which the engine stopped at
        found = session.stops.first(server.tokenizer.decode(gen.response_ids, skip_special_tokens=True))
        if found:
            return found
    last = gen.response_ids[-1]
    return last if last in server.stop_ids and last != server.tokenizer.eos_token_id else None


def decoded_span(tokenizer, gen: Generated, start: int, end: int, with_texts: bool) -> Span:
    """The tokens [start, end) of `gen` with their logprobs and alternatives, each token decoded alone (as OpenAI's
    logprobs show them; `with_texts` false: no texts); under the server's tokenizer lock."""
    ids = gen.response_ids[start:end]
    texts = [tokenizer.decode([t]) for t in ids] if with_texts else []
    top = [[(tokenizer.decode([t]), lp) for t, lp in pairs] for pairs in (gen.top_logprobs or [])[start:end]]
    return Span(ids, gen.logprobs[start:end], texts, top)


async def prepare_turns(server, sessions: list[SampleSession], call) -> list[tuple[Plan, TokenRequest]]:
    """Plan `call` in each of `sessions` (one per choice) and the token request of each (a RequestError for one
    the server refuses: nothing is generated or recorded then)."""
    plans = [await run_in_threadpool(_plan, server, session, call) for session in sessions]
    prepared = [
        (plan, _token_request(server, session, plan, call, choice))
        for choice, (session, plan) in enumerate(zip(sessions, plans))
    ]
    if call.settings.json_schema is not None:  # response_format: each choice samples within its own grammar
        for _, request in prepared:
            request.constraint = await _compiled("response_format", server.grammar_for, call.settings.json_schema)
    if call.settings.required_tools is not None:  # tool_choice 'required' or a named function
        for (_, request), session in zip(prepared, sessions):
            request.constraint = await _compiled("tool_choice", server.tool_grammar_for, call.settings.required_tools,
                                                 session.parser_name)  # fmt: skip
    if call.settings.prompt_top is not None:  # prompt_logprobs, echo with logprobs: before a stream's first chunk
        await _score_prompts(server, prepared, call.settings.prompt_top)
    return prepared


async def _score_prompts(server, prepared: list[tuple[Plan, TokenRequest]], num_top: int) -> None:
    """Give each plan its context's tokens scored by the served model (teacher-forced, on the engine's worker between
    its steps), each distinct context once."""
    scored: dict[tuple[int, ...], PromptTokens] = {}
    for plan, request in prepared:
        if plan.vision is not None:
            raise refuse("prompt_logprobs", "the prompt's own logprobs are not computed for prompts with images")
        key = tuple(plan.context_ids)
        if key not in scored:
            got = await asyncio.wrap_future(server.worker.score_prompt(request, num_top))
            scored[key] = await run_in_threadpool(_prompt_tokens, server, plan.context_ids, got)
        plan.prompt = scored[key]


def _prompt_tokens(server, ids: list[int], scored: PromptLogprobs) -> PromptTokens:
    """The scored prompt with its tokens decoded alone (under the server's tokenizer lock); -inf clamped to -9999.0,
    as vLLM clamps it (JSON has no infinity)."""
    with server.tokenizer_lock:
        texts = [server.tokenizer.decode([t]) for t in ids]
        top = [[(t, server.tokenizer.decode([t]), max(lp, -9999.0)) for t, lp in pairs] for pairs in scored.top]
    logprobs = [max(lp, -9999.0) for lp in scored.logprobs]
    return PromptTokens(ids, texts, [None, *logprobs], [None, *scored.ranks], [[], *top])


async def _compiled(param: str, compile_one, *args):
    """A grammar compiled off the event loop; one that cannot be is HTTP 400 naming the field that asked for it."""
    try:
        return await run_in_threadpool(compile_one, *args)
    except UserError as e:
        raise RequestError(400, str(e), "invalid_request", param) from None


async def run_turns(
    server, sessions: list[SampleSession], call, prepared: list[tuple[Plan, TokenRequest]], on_tokens=None
) -> list[Turn]:
    """Generate the prepared requests together on the engine stream and record each in its session; the turns to
    reply with, in choice order. `on_tokens(index, sampled)`: what choice `index` sampled so far (a Generated of
    its tokens, logprobs and alternatives), each time there are more tokens (called on the event loop; streamed
    replies)."""
    loop = asyncio.get_running_loop()

    def listener(index: int):
        def heard(sampled: Generated) -> None:  # on the engine worker's thread
            with contextlib.suppress(RuntimeError):  # a closed loop: the server is shutting down
                loop.call_soon_threadsafe(on_tokens, index, sampled)

        return heard if on_tokens is not None else None

    futures = [server.worker.submit(request, listener(i)) for i, (_, request) in enumerate(prepared)]
    gens = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
    return [
        await run_in_threadpool(_commit, server, session, plan, gen, call)
        for session, (plan, _), gen in zip(sessions, prepared, gens)
    ]


async def generate_turns(server, sessions: list[SampleSession], call: ChatCall | CompletionCall) -> list[Turn]:
    """Plan `call` in each of `sessions` (one per choice), generate them together on the engine stream, record
    each in its session; the turns to reply with, in choice order."""
    return await run_turns(server, sessions, call, await prepare_turns(server, sessions, call))
