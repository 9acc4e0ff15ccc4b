"""bench/agent_clients.py's check of one sample: its `rlx serve` record against the exchanges the proxy saw.

`check_sample` answers 'yes', '-' (no request answered, no record) or 'no: <the first difference>'. A record's
trajectories are its earlier `segments` and itself; each holds as many sampled turns (runs of loss mask 1) as the
answered requests it covers, in order. Per trajectory: its prompt tokens are the chat template over the first
request's messages and tools; each turn's tokens (less a final <|im_end|>) decode to the reply the client got, read
as rlx's parser reads a reply when the request offered tools; the tokens before a later turn end the template
over that turn's request; one rollout logprob per response token.
"""

from __future__ import annotations

import json

from rlx.chat.tool_calls import parse_qwen
from rlx.serve.responses import ResponseStore, to_chat


def load_tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content)  # text parts alone (no images in this bench)


def _sent(route: str, body: dict) -> tuple[list[dict], list[dict] | None]:
    """The messages and tools a request sent, as chat messages with string content."""
    chat = to_chat(body, ResponseStore())[0] if route.startswith("responses") else body
    messages = []
    for message in chat["messages"]:
        kept = {"role": message["role"], "content": _text(message.get("content"))}
        kept |= {k: message[k] for k in ("tool_calls", "tool_call_id", "name") if message.get(k) is not None}
        messages.append(kept)
    return messages, chat.get("tools") or None


def _calls(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"] or "{}")) for c in calls]


def _streamed(raw: bytes) -> dict:
    """The message a chat stream adds up to: its content and tool calls."""
    content, calls = "", {}
    for line in raw.decode().splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[6:]).get("choices") or []:
            delta = choice.get("delta") or {}
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                kept = calls.setdefault(call["index"], {"function": {"name": "", "arguments": ""}})
                kept["function"]["name"] += (call.get("function") or {}).get("name") or ""
                kept["function"]["arguments"] += (call.get("function") or {}).get("arguments") or ""
    return {"content": content, "tool_calls": [calls[i] for i in sorted(calls)]}


def _streamed_response(raw: bytes) -> tuple[str, list[dict]]:
    """The text and function calls a Responses API stream adds up to (its text deltas, its finished call items)."""
    text, calls = "", []
    for line in raw.decode().splitlines():
        if not line.startswith("data: "):
            continue
        event = json.loads(line[6:])
        if event.get("type") == "response.output_text.delta":
            text += event["delta"]
        elif event.get("type") == "response.output_item.done" and event["item"]["type"] == "function_call":
            calls.append({"function": event["item"]})
    return text, calls


def _reply(route: str, body: dict, raw: bytes) -> tuple[str, list[tuple[str, dict]]]:
    """(content, tool calls) of the reply the client got."""
    if route.startswith("responses") and body.get("stream"):
        text, calls = _streamed_response(raw)
        return text, _calls(calls)
    if route.startswith("responses"):
        output = json.loads(raw)["output"]
        text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
        calls = [{"function": item} for item in output if item["type"] == "function_call"]
        return text, _calls(calls)
    message = _streamed(raw) if body.get("stream") else json.loads(raw)["choices"][0]["message"]
    return message.get("content") or "", _calls(message.get("tool_calls") or [])


def _turns(mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each run of 1s in a loss mask."""
    runs, start = [], None
    for i, value in enumerate([*mask, 0]):
        if value and start is None:
            start = i
        elif not value and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _check_trajectory(trajectory: dict, requests: list[tuple], tokenizer) -> str | None:
    """The first difference between one trajectory and its requests ((route, body, reply bytes) each), or None."""

    def render(route, body):
        messages, tools = _sent(route, body)
        return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)["input_ids"]

    ids = trajectory["response_ids"]
    if trajectory["prompt_ids"] != render(*requests[0][:2]):
        return "prompt tokens are not the template over the first request"
    if len(trajectory["rollout_logprobs"]) != len(ids):
        return "not one logprob per response token"
    end = 0
    for k, ((start, stop), (route, body, raw)) in enumerate(zip(_turns(trajectory["loss_mask"]), requests)):
        between = ids[end:start]
        if k and render(route, body)[-len(between) :] != between:
            return f"tokens before turn {k} do not end the template over its request"
        sampled = ids[start:stop][:-1] if ids[stop - 1] == tokenizer.eos_token_id else ids[start:stop]
        text, offered = tokenizer.decode(sampled), _sent(route, body)[1]
        got = _reply(route, body, raw)
        if offered:
            parsed = parse_qwen(text, k).message
            seen = (parsed.get("content") or "", _calls(parsed.get("tool_calls") or []))
        else:
            seen = (text, [])
        if seen != got:
            return f"turn {k} decodes to {seen!r:.80}, the client got {got!r:.80}"
        end = stop
    return None


def check_sample(exchanges: list[tuple], records: list[dict], sample: str, tokenizer) -> str:
    """'yes', '-' or 'no: why' for one sample's exchanges ((sample, route, body, status, reply) each)."""
    answered = [(route, json.loads(body), raw) for _, route, body, status, raw in exchanges
                if status == 200 and route.split("?")[0] in ("chat/completions", "responses")]  # fmt: skip
    mine = [record for record in records if record["prompt_id"] == sample]
    if not answered and not mine:
        return "-"
    if len(mine) != 1:
        return f"no: {len(mine)} records for {len(answered)} answered requests"
    trajectories = [*mine[0].get("segments", []), mine[0]]
    counts = [len(_turns(t["loss_mask"])) for t in trajectories]
    if sum(counts) != len(answered):
        return f"no: {sum(counts)} turns recorded for {len(answered)} answered requests"
    first = 0
    for trajectory, count in zip(trajectories, counts):
        difference = _check_trajectory(trajectory, answered[first : first + count], tokenizer)
        if difference:
            return f"no: {difference}"
        first += count
    reasons = [t.get("reason", t.get("segment_reason")) for t in trajectories[1:]]  # the record's own: segment_reason
    return "yes" + (f" ({len(trajectories)} segments: new ones: {', '.join(map(str, reasons))})" if reasons else "")
