"""The client side of bench/agent_clients.py: each client's ordinary calls, run in the clients' venv (no rlx import).

    python bench/agent_clients_calls.py CLIENT TEXT_ROOT TOOL_ROOT

CLIENT is openai-agents, langchain-openai, smolagents or openenv-core; TEXT_ROOT is the server of a model that writes
short text, TOOL_ROOT the one of a model that calls `add(1, 2)` every turn (both `http://host:port`, through
the bench's recording proxy). Each path talks to its own sample, `/s/<client>.<path>/v1` (openenv's client takes
a host and a port only, so its paths use each server's `default` sample). One line per path (ROW_MARK and JSON): client,
version, path, server (text or tool), sample, result ('ok', or the error the client raised), note.
"""

from __future__ import annotations

import asyncio
import json
import sys
import traceback
from importlib.metadata import version


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def _error(e: BaseException) -> str:
    status = getattr(e, "status_code", None)
    body = getattr(e, "body", None)
    if status is not None:
        message = body.get("message") if isinstance(body, dict) else str(e)
        return f"HTTP {status}: {message}"
    return f"{type(e).__name__}: {str(e)[:300]}"


def _url(root: str, client: str, path: str) -> str:
    return f"{root}/s/{client}.{path}/v1"


# --- openai-agents ---------------------------------------------------------------------------------------------


def openai_agents_paths(text_root: str, tool_root: str) -> dict:
    from agents import (
        Agent,
        MaxTurnsExceeded,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # its traces go to OpenAI's servers otherwise
    ran = []

    @function_tool
    def add_tool(a: int, b: int) -> int:
        """Adds two integers."""
        ran.append((a, b))
        return a + b

    add_tool.name = "add"

    def agent(root: str, path: str, api: str) -> Agent:
        client = AsyncOpenAI(base_url=_url(root, "openai-agents", path), api_key="unused")
        kind = OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel
        model = kind(model="rlx", openai_client=client)
        return Agent(name="helper", instructions="Be brief.", tools=[add_tool], model=model)

    async def run(root: str, path: str, api: str, streamed: bool = False) -> str:
        target = agent(root, path, api)
        if not streamed:
            return str((await Runner.run(target, "What is 1 + 2?", max_turns=2)).final_output)
        result = Runner.run_streamed(target, "What is 1 + 2?", max_turns=2)
        events = [event.type async for event in result.stream_events()]
        return f"{len(events)} events; {str(result.final_output)!r:.40}"

    async def tool_round(root: str, path: str, api: str, streamed: bool = False) -> str:
        ran.clear()
        try:
            await run(root, path, api, streamed)
        except MaxTurnsExceeded:
            if ran == [(1, 2), (1, 2)]:
                return "add ran twice, result sent back; stopped by max_turns=2 (the model calls add every turn)"
            raise
        raise AssertionError("the run ended without reaching max_turns")

    return {
        "chat.run": ("text", lambda: asyncio.run(run(text_root, "chat.run", "chat"))),
        "chat.stream": ("text", lambda: asyncio.run(run(text_root, "chat.stream", "chat", True))),
        "chat.tools": ("tool", lambda: asyncio.run(tool_round(tool_root, "chat.tools", "chat"))),
        "chat.tools.stream": ("tool", lambda: asyncio.run(tool_round(tool_root, "chat.tools.stream", "chat", True))),
        "responses.run": ("text", lambda: asyncio.run(run(text_root, "responses.run", "responses"))),
        "responses.stream": ("text", lambda: asyncio.run(run(text_root, "responses.stream", "responses", True))),
        "responses.tools": ("tool", lambda: asyncio.run(tool_round(tool_root, "responses.tools", "responses"))),
    }


# --- langchain-openai ------------------------------------------------------------------------------------------


def langchain_paths(text_root: str, tool_root: str) -> dict:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    def llm(root: str, path: str) -> ChatOpenAI:
        return ChatOpenAI(model="rlx", base_url=_url(root, "langchain-openai", path), api_key="unused")

    def invoke() -> str:
        return repr(llm(text_root, "invoke").invoke("Say hi.").content)

    def stream() -> str:
        pieces = [chunk.content for chunk in llm(text_root, "stream").stream("Say hi.")]
        return f"{len(pieces)} chunks: {''.join(pieces)!r}"

    def tools() -> str:
        adder = tool(add)
        bound = llm(tool_root, "tools").bind_tools([adder])
        history = [HumanMessage("What is 1 + 2?")]
        first = bound.invoke(history)
        if not first.tool_calls:
            raise AssertionError(f"no tool call in {first.content!r}")
        call = first.tool_calls[0]
        history += [first, ToolMessage(str(adder.invoke(call["args"])), tool_call_id=call["id"])]
        second = bound.invoke(history)
        return f"called {call['name']}({call['args']}), then {[c['name'] for c in second.tool_calls]}"

    class Verdict(BaseModel):
        is_sum_right: bool

    def structured() -> str:
        return repr(llm(text_root, "structured").with_structured_output(Verdict).invoke("Is 1 + 2 = 3?"))

    return {"invoke": ("text", invoke), "stream": ("text", stream), "tools": ("tool", tools),
            "structured": ("text", structured)}  # fmt: skip


# --- smolagents ------------------------------------------------------------------------------------------------


def smolagents_paths(text_root: str, tool_root: str) -> dict:
    import inspect

    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    adder = tool(add)

    def run(path: str, model_options: dict | None = None, **options) -> str:
        url = _url(tool_root, "smolagents", path)
        model = OpenAIServerModel(model_id="rlx", api_base=url, api_key="unused", **(model_options or {}))
        agent = ToolCallingAgent(tools=[adder], model=model, max_steps=2, verbosity_level=0, **options)
        answer = agent.run("What is 1 + 2?")
        errors = [str(step.error)[:120] for step in agent.memory.steps if getattr(step, "error", None)]
        return f"answer {str(answer)!r:.40}; step errors: {errors}"

    auto = {"tool_choice": "auto"}  # its default asks for 'required' (constrained decoding)
    paths = {"tools": ("tool", lambda: run("tools")), "tools.auto": ("tool", lambda: run("tools.auto", auto))}
    if "stream_outputs" in inspect.signature(ToolCallingAgent.__init__).parameters:
        paths["tools.stream"] = ("tool", lambda: run("tools.stream", stream_outputs=True))
        paths["tools.auto.stream"] = ("tool", lambda: run("tools.auto.stream", auto, stream_outputs=True))
    return paths


# --- openenv-core ----------------------------------------------------------------------------------------------


def openenv_paths(text_root: str, tool_root: str) -> dict:
    from openenv.core.llm_client import OpenAIClient

    def client(root: str) -> OpenAIClient:
        host, port = root.rsplit(":", 1)
        return OpenAIClient(endpoint=host, port=int(port), model="rlx", max_tokens=16)

    def complete() -> str:
        return repr(asyncio.run(client(text_root).complete("Say hi.")))

    async def tool_round() -> str:
        llm = client(tool_root)
        tools = [{"name": "add", "description": "Adds two integers.",
                  "inputSchema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                  "required": ["a", "b"]}}]  # fmt: skip
        messages = [{"role": "user", "content": "What is 1 + 2?"}]
        first = await llm.complete_with_tools(messages, tools)
        if not first.tool_calls:
            raise AssertionError(f"no tool call in {first.content!r}")
        call = first.tool_calls[0]
        result = {"role": "tool", "tool_call_id": call.id, "content": str(add(**call.args))}
        messages += [first.to_message_dict(), result]
        second = await llm.complete_with_tools(messages, tools)
        return f"called {call.name}({call.args}), then {[c.name for c in second.tool_calls]}"

    return {"complete": ("text", complete), "tools": ("tool", lambda: asyncio.run(tool_round()))}


ROW_MARK = "agent_clients row: "
"""Starts each row's line (clients print to stdout too)."""
CLIENTS = {
    "openai-agents": ("openai-agents", openai_agents_paths),
    "langchain-openai": ("langchain-openai", langchain_paths),
    "smolagents": ("smolagents", smolagents_paths),
    "openenv-core": ("openenv-core", openenv_paths),
}


def main() -> None:
    client, text_root, tool_root = sys.argv[1:4]
    dist, build = CLIENTS[client]
    paths = build(text_root, tool_root)
    for path, (server, call) in paths.items():
        sample = "default" if client == "openenv-core" else f"{client}.{path}"
        row = {"client": client, "version": version(dist), "path": path, "server": server, "sample": sample}
        try:
            row |= {"result": "ok", "note": call()}
        except Exception as e:  # noqa: BLE001 - a client's failure is the finding this row reports
            row |= {"result": _error(e), "note": traceback.format_exc(limit=-2)[-600:]}
        print(ROW_MARK + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
