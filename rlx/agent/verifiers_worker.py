"""The worker verifiers_agent.py runs in verifiers' own venv (Python >= 3.11 with verifiers 0.4; never imported by rlx,
whose venv cannot import verifiers): it loads one environment as `vf-eval` would, holds its servers (shared tools,
the interception proxy the harness programs talk to) for the whole run, and plays one episode per request.

Lines of JSON on stdin and stdout (stdout is the protocol alone: anything else the process prints goes to stderr):
    in, first      {"model": SERVED_NAME, "args": [vf-eval options: the taskset id first]}
    out, once      {"ready": true, "num_tasks": N} or {"fatal": "why it could not start"}
    in, then       {"id": K, "task": INDEX, "base_url": URL}     one episode of task INDEX against URL
    out            {"id": K, "reward": R, "trace_id": ID} or {"id": K, "error": "what failed"}
Episodes run concurrently (at most vf-eval's --max-concurrent); the worker stops when stdin closes.
"""

import asyncio
import json
import logging
import os
import sys


def _protocol_out():
    """The real stdout, kept for the protocol; fd 1 (prints, harness programs) then writes to stderr."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def _load(argv: list[str]):
    """The eval config vf-eval would parse from `argv`, and its environment (errors: SystemExit with the reason)."""
    from pydantic_config import cli
    from verifiers.v1.cli.resolve import narrow_config, plugin_errors, with_positional_taskset
    from verifiers.v1.configs.cli.eval import EvalConfig
    from verifiers.v1.utils.loaders import load_environment

    argv = with_positional_taskset(argv)
    with plugin_errors():
        config = cli(narrow_config(EvalConfig, argv), args=argv)
        env = load_environment(config.env)
    return config, env


def _reply(episode) -> dict:
    """The reward of a single-agent episode, or why it has none."""
    if not episode.ok or len(episode.traces) != 1:
        errors = [f"{e.type}: {e.message}" for e in episode.errors]
        errors += [f"{e.type}: {e.message}" for t in episode.traces for e in t.errors]
        if len(episode.traces) != 1 and episode.ok:
            errors.append(f"the episode has {len(episode.traces)} traces; rlx trains single-agent environments")
        return {"error": "; ".join(errors)[:2000] or "the episode did not complete"}
    (trace,) = episode.traces
    return {"reward": float(trace.reward), "trace_id": trace.id}


async def _serve(out, setup: dict) -> None:
    try:
        from verifiers.v1.clients import ModelContext

        config, env = _load([str(a) for a in setup["args"]])
        tasks = list(env.taskset.select(config.select))
    except SystemExit as e:  # a bad option: the parser printed why (on stderr), or the reason is the code
        out.write(json.dumps({"fatal": e.code if isinstance(e.code, str) else None}) + "\n")
        return
    except Exception as e:  # the taskset's own code: reported, not a traceback
        out.write(json.dumps({"fatal": f"{type(e).__name__}: {e}"}) + "\n")
        return
    gate = asyncio.Semaphore(config.max_concurrent) if config.max_concurrent else None
    client = config.client.model_dump()

    async def play(request: dict) -> None:
        try:
            task = tasks[request["task"]]
            endpoint = type(config.client).model_validate({**client, "base_url": request["base_url"]})
            ctx = ModelContext(model=setup["model"], client=endpoint, sampling=config.sampling)
            (slot,) = env.slots(task, 1)
            reply = _reply(await env.run_slot(slot, ctx, gate))
        except Exception as e:  # reported to this request's caller; the worker keeps serving
            reply = {"error": f"{type(e).__name__}: {e}"[:2000]}
        out.write(json.dumps({"id": request["id"], **reply}) + "\n")

    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    running: set[asyncio.Task] = set()
    async with env.serving():
        out.write(json.dumps({"ready": True, "num_tasks": len(tasks)}) + "\n")
        while line := await reader.readline():
            job = asyncio.ensure_future(play(json.loads(line)))
            running.add(job)
            job.add_done_callback(running.discard)
        for job in list(running):
            job.cancel()
        await asyncio.gather(*running, return_exceptions=True)


def main() -> None:
    out = _protocol_out()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    setup = json.loads(sys.stdin.readline() or "{}")
    asyncio.run(_serve(out, setup))


if __name__ == "__main__":
    main()
