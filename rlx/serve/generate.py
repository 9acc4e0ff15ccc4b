"""vLLM's token-in/token-out route, `POST /inference/v1/generate`, as RL agent frameworks call it.

verifiers' training client (0.4, through the `renderers` package) renders the conversation to token ids itself and
sends `{"model", "token_ids": [...], "sampling_params": {...}}`; the reply's first choice carries the sampled
`token_ids`, their `logprobs` as `{"content": [{"token": "token_id:<id>", "logprob": x}, ...]}`, the `finish_reason`
and vLLM's `stop_reason`, and `prompt_token_ids` echoes the context. The request is a /v1/completions call whose
prompt is those token ids (the same sample, segment and record rules: sessions.py), so the client's own trajectory
and rlx's record hold the same tokens.

sampling_params: temperature, top_p, top_k, max_tokens, seed and stop are honoured as on /v1/completions;
`stop_token_ids` must be among the tokens the server stops at (the model's end tokens); logprobs (the sampled
tokens' own), skip_special_tokens and spaces_between_special_tokens change no token; anything else is refused by
name unless it has its neutral value (n 1, penalties 0 or 1, min_tokens 0, ...).
"""

from __future__ import annotations

from rlx.serve.api import CompletionCall, Limits, RequestError, read_completion, refuse
from rlx.serve.replies import Turn

_PASSED = ("temperature", "top_p", "top_k", "max_tokens", "seed", "stop")
"""sampling_params read as the /v1/completions fields of the same names."""
_UNUSED = ("logprobs", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
           "detokenize")  # fmt: skip
"""sampling_params that change no sampled token (logprobs are always returned)."""
_NEUTRAL = {"n": (1,), "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
            "min_tokens": (0,), "min_p": (0, 0.0), "ignore_eos": (False,), "logit_bias": ({},)}  # fmt: skip
"""sampling_params honoured only at their neutral value."""
_TOP = ("model", "token_ids", "sampling_params", "cache_salt", "priority", "return_token_ids", "request_id")


def read_generate(body: dict, limits: Limits, stop_ids: set[int]) -> CompletionCall:
    """A /inference/v1/generate body as a completion call over its token ids (RequestError naming a field the
    server cannot honour)."""
    for name in body:
        if name not in _TOP:
            raise refuse(name, "not a field this route takes (multimodal features are not served here)")
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise RequestError(400, "'sampling_params' must be an object", param="sampling_params")
    for name, value in params.items():
        where = f"sampling_params.{name}"
        if name in _NEUTRAL and (value is not None and value not in _NEUTRAL[name]):
            raise refuse(where, f"only {_NEUTRAL[name][0]!r} is supported here, got {value!r:.80}")
        if name not in (*_PASSED, *_UNUSED, *_NEUTRAL, "stop_token_ids"):
            raise refuse(where, "not a sampling parameter this server honours")
    extra = [t for t in params.get("stop_token_ids") or [] if t not in stop_ids]
    if extra:
        raise refuse("sampling_params.stop_token_ids", f"this server stops at {sorted(stop_ids)} only, got {extra}")
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not ids:
        raise RequestError(400, "'token_ids' must be a non-empty list of token ids", param="token_ids")
    completion = {k: params[k] for k in _PASSED if params.get(k) is not None}
    return read_completion({**completion, "model": body.get("model"), "prompt": ids, "logprobs": 0}, limits)


def generate_reply(turn: Turn) -> dict:
    """The route's reply: the sampled token ids with their logprobs, the finish reason, the prompt's token ids."""
    logprobs = [{"token": f"token_id:{t}", "logprob": lp} for t, lp in zip(turn.response_ids, turn.logprobs)]
    choice = {"index": 0, "token_ids": turn.response_ids, "logprobs": {"content": logprobs},
              "finish_reason": turn.finish_reason, "stop_reason": turn.stop_reason}  # fmt: skip
    usage = {"prompt_tokens": len(turn.prompt_ids), "completion_tokens": len(turn.response_ids),
             "total_tokens": len(turn.prompt_ids) + len(turn.response_ids)}  # fmt: skip
    return {"request_id": turn.id, "choices": [choice], "prompt_token_ids": turn.prompt_ids, "usage": usage}
