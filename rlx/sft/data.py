"""Demonstrations for supervised fine-tuning: JSONL lines read and checked, then tokenised the way multi-turn rollouts
build a trajectory, with a mask on the tokens the model itself would write.

A line is `{"messages": [...], "tools": [...]}` (OpenAI chat format: roles system, user, assistant, tool; assistant
`tool_calls` as `{"type": "function", "function": {"name", "arguments"}}`, arguments a JSON object or its string;
`tools` optional) or `{"prompt": ..., "response": ...}` (prompt text or messages, response text). With a chat
template the tokens are, in order (rlx/chat/trajectory.py's ChatRenderer):

    opening    the messages before the first assistant turn + its generation prompt     masked (the prompt)
    turn k     the assistant message as the template writes it, through its end-of-turn  trained
    inserted   the rest of the turn's closing (the newline after <|im_end|>), the next     masked
               messages (tool results, user turns) + the next generation prompt

so a model fine-tuned here reads, at every assistant turn, exactly the context a rollout gives it. Messages after
the last assistant turn add nothing. Without a chat template only `{"prompt": text, "response": text}` lines work:
the prompt as `rlx rollout` encodes it, then the response and the EOS token (trained).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from rlx.chat.trajectory import ChatRenderer
from rlx.errors import UserError
from rlx.rollout.prompts import has_chat_template
from rlx.utils.io import read_jsonl

ROLES = ("system", "user", "assistant", "tool")


@dataclass
class Demonstration:
    """One checked line: a conversation with at least one assistant turn, or a text prompt and its response."""

    where: str
    """FILE:LINE, for errors."""
    messages: list[dict] | None = None
    """The conversation (chat lines, and prompt/response lines under a chat template)."""
    tools: list[dict] | None = None
    """OpenAI function schemas handed to the chat template."""
    prompt_text: str | None = None
    """A text prompt/response line (used when the tokenizer has no chat template)."""
    response_text: str | None = None


@dataclass
class SFTSample:
    """A tokenised demonstration in the rollout record's shape: prompt, response, and which response tokens train."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    """1 on the assistant's tokens (trained), 0 on inserted ones."""
    where: str = ""
    rollout_logprobs: list[float] = field(default_factory=list)
    """Zeros (batch collation reads them)."""

    def __post_init__(self) -> None:
        self.rollout_logprobs = [0.0] * len(self.response_ids)

    @property
    def trained_mask(self) -> list[int]:
        return self.loss_mask

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


def read_demonstrations(path: str) -> list[Demonstration]:
    """Every line of `path` checked (UserError naming FILE:LINE and what is wrong); at least one line."""
    demos = [_demonstration(obj, f"{path}:{number}") for number, obj in read_jsonl(path)]
    if not demos:
        raise UserError(f"{path}: no demonstrations (the file is empty)")
    return demos


def _demonstration(obj: dict, where: str) -> Demonstration:
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            raise UserError(f"{where}: 'messages' must be a non-empty list of chat messages")
        messages = [_message(m, where, i) for i, m in enumerate(messages)]
        roles = [m["role"] for m in messages]
        if "assistant" not in roles:
            raise UserError(f"{where}: no assistant message (nothing to learn from)")
        if roles[0] == "assistant":
            raise UserError(f"{where}: the first message is the assistant's; it needs a prompt before it")
        return Demonstration(where, messages=messages, tools=_tools(obj.get("tools"), where))
    if "prompt" in obj and "response" in obj:
        prompt, response = obj["prompt"], obj["response"]
        if not isinstance(response, str):
            raise UserError(f"{where}: 'response' must be a string, got {type(response).__name__}")
        if isinstance(prompt, str):
            opening = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, list) and prompt:
            opening = [_message(m, where, i) for i, m in enumerate(prompt)]
        else:
            raise UserError(f"{where}: 'prompt' must be a string or a non-empty list of chat messages")
        messages = [*opening, {"role": "assistant", "content": response}]
        text = prompt if isinstance(prompt, str) else None
        return Demonstration(where, messages, _tools(obj.get("tools"), where), text, response)
    raise UserError(f"{where}: expected a 'messages' list, or 'prompt' and 'response' (got keys {sorted(obj)})")


def _message(message, where: str, index: int) -> dict:
    """A checked copy of one chat message (assistant tool calls in OpenAI form, arguments as a JSON string)."""
    at = f"{where}: message {index}"
    if not isinstance(message, dict):
        raise UserError(f"{at}: expected an object with 'role' and 'content'")
    role = message.get("role")
    if role not in ROLES:
        raise UserError(f"{at}: role {role!r} is not one of {', '.join(ROLES)}")
    content = message.get("content")
    calls = message.get("tool_calls") or []
    if content is None and role == "assistant" and calls:
        content = ""
    if not isinstance(content, str):
        raise UserError(f"{at}: 'content' must be a string (image parts are not supported in demonstrations)")
    out = {**message, "content": content}
    if calls:
        if role != "assistant" or not isinstance(calls, list):
            raise UserError(f"{at}: 'tool_calls' must be a list, on an assistant message")
        out["tool_calls"] = [_tool_call(call, f"{at}, tool call {i}") for i, call in enumerate(calls)]
    return out


def _tool_call(call, at: str) -> dict:
    """{"id"?, "type": "function", "function": {"name", "arguments": JSON string}}: arguments as the rollouts' tool
    call parser hands them to the template (json.dumps of the object)."""
    function = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise UserError(f"{at}: expected {{'function': {{'name': ..., 'arguments': {{...}}}}}}")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise UserError(f"{at}: 'arguments' is a string but not JSON") from None
    if not isinstance(arguments, dict):
        raise UserError(f"{at}: 'arguments' must be a JSON object")
    out = {"type": "function", "function": {"name": function["name"], "arguments": json.dumps(arguments)}}
    if "id" in call:
        out["id"] = call["id"]
    return out


def _tools(tools, where: str) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise UserError(f"{where}: 'tools' must be a list of function schemas (objects)")
    return tools


@dataclass
class Tokenized:
    """The samples that fit, and how many demonstrations were skipped for length."""

    samples: list[SFTSample]
    num_skipped: int = 0


def tokenize_demonstrations(
    demos: list[Demonstration], tokenizer, stop_ids: set[int], max_length: int, on_long: str, what: str,
    template_kwargs: dict | None = None,
) -> Tokenized:  # fmt: skip
    """Each demonstration's tokens and mask (see the module docstring); one longer than `max_length` tokens is an
    error naming it (`on_long` 'error') or left out and counted ('skip'); `what` names the setting in errors;
    `template_kwargs`: extra variables for the chat template."""
    chat = has_chat_template(tokenizer)
    samples, skipped, renderers = [], 0, {}
    for demo in demos:
        if chat:  # one renderer per tool list: its anchors and closing tokens are rendered once
            key = json.dumps(demo.tools, sort_keys=True)
            if key not in renderers:
                renderers[key] = ChatRenderer(tokenizer, stop_ids, demo.tools, template_kwargs)
            sample = _chat_sample(demo, renderers[key])
        elif demo.prompt_text is not None:
            sample = _text_sample(demo, tokenizer, stop_ids)
        else:
            raise UserError(
                f"{demo.where}: chat messages need a tokenizer with a chat template (this one has none); give "
                f"{{'prompt': text, 'response': text}} lines, or set chat_template in tokenizer_config.json"
            )
        if sample.num_tokens > max_length:
            if on_long == "error":
                raise UserError(
                    f"{demo.where}: {sample.num_tokens} tokens, longer than {what} {max_length} (raise it, or "
                    f"skip such demonstrations: on_long_sample = 'skip', --on-long-sample skip)"
                )
            skipped += 1
            continue
        samples.append(sample)
    if not samples:
        raise UserError(f"{demos[0].where.rsplit(':', 1)[0]}: every demonstration is longer than {what} {max_length}")
    return Tokenized(samples, skipped)


def _text_sample(demo: Demonstration, tokenizer, stop_ids: set[int]) -> SFTSample:
    """No chat template: the prompt as `rlx rollout` encodes text, then the response and EOS, all trained."""
    prompt = list(tokenizer(demo.prompt_text)["input_ids"])
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id in stop_ids or not stop_ids else min(stop_ids)
    if eos is None:
        raise UserError(f"{demo.where}: the tokenizer has no EOS token to end the response with")
    response = list(tokenizer(demo.response_text, add_special_tokens=False)["input_ids"]) + [eos]
    if not prompt:
        raise UserError(f"{demo.where}: the prompt encodes to no tokens")
    return SFTSample(prompt, response, [1] * len(response), demo.where)


def _chat_sample(demo: Demonstration, renderer: ChatRenderer) -> SFTSample:
    messages = demo.messages
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    prompt = renderer.opening_ids(messages[: turns[0]])
    response, mask = [], []
    for k, i in enumerate(turns):
        if k > 0:  # what the environment said since the last turn, and the generation prompt (as a rollout adds)
            inserted = renderer.message_ids(messages[turns[k - 1] + 1 : i])
            response += inserted
            mask += [0] * len(inserted)
        trained, closing_rest = _assistant_turn(renderer, messages, i, demo.where)
        response += trained
        mask += [1] * len(trained)
        if k < len(turns) - 1:  # the end of the turn the model does not write (nothing after the last turn)
            response += closing_rest
            mask += [0] * len(closing_rest)
    return SFTSample(prompt, response, mask, demo.where)


def _assistant_turn(renderer: ChatRenderer, messages: list[dict], i: int, where: str) -> tuple[list[int], list[int]]:
    """(the tokens the model writes for assistant message i, through its end-of-turn token; the rest of the
    template's closing after it, which a rollout inserts): the template's text after the generation prompt."""
    before = renderer.render_text(messages[:i], add_generation_prompt=True)
    after = renderer.render_text(messages[: i + 1], add_generation_prompt=False)
    if not after.startswith(before):
        raise UserError(f"{where}: the chat template does not write message {i} after its generation prompt")
    written = after[len(before) :]
    dropped = [c["function"]["name"] for c in messages[i].get("tool_calls", []) if c["function"]["name"] not in written]
    if dropped:  # it would train the model to answer a question by saying nothing
        raise UserError(
            f"{where}: message {i}: the chat template does not write tool calls (no {dropped[0]!r} in what it "
            f"renders); for such a model put the call as text in the message's 'content', in the form the rollouts' "
            f"tool-call parser reads (<tool_call>{{...}}</tool_call>), without 'tool_calls'"
        )
    ids = renderer.encode(written)
    closing = renderer.closing_ids
    ends_with_closing = bool(closing) and ids[len(ids) - len(closing) :] == closing
    if ends_with_closing and closing[0] in renderer.stop_ids:  # the model stops at the end-of-turn token
        cut = len(ids) - len(closing) + 1
        return ids[:cut], ids[cut:]
    return ids, []
