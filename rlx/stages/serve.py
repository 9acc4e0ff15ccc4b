"""`rlx serve`: the OpenAI-compatible endpoint of server.py as a command, backed by any rollout engine.

The server runs until interrupted (Ctrl-C, or SIGTERM: exit code 143 once the output is written), or for
`max_requests` requests. Every request belongs to a sample: `/s/<sample_id>/v1/...` or an `X-Session-ID` header
names it, else it is the sample 'default'. On exit, with an output file, each sample's trajectory is written as a
rollouts.jsonl record: its last segment token-exact with its loss_mask (and a vision-language model's images in
`image_refs`), every earlier segment in `segments` (see sessions.py), what each turn asked in `turn_settings`, and
`evicted` for a session the server closed early; so anything that drives a model through an OpenAI client produces
rlx training data.
"""

from __future__ import annotations

import signal
import socket
import threading

from rlx.chat.records import trajectory_record
from rlx.checkpoints.loading import load_model, load_processor
from rlx.errors import Terminated, UserError
from rlx.formats.records import PromptRecord, RolloutRecord, write_records
from rlx.models.loading import load_tokenizer, resolve_model
from rlx.observe.tracking import console
from rlx.parallel.dist import setup
from rlx.rollout.base import build_engine
from rlx.rollout.registry import engine_class
from rlx.serve.config import ServeConfig
from rlx.serve.server import AgentServer
from rlx.serve.sessions import SampleSession
from rlx.serve.stream import StreamWorker


def run_serve(
    cfg: ServeConfig, model_path: str, port: int, out: str | None, max_requests: int = 0, name: str = "rlx"
) -> list[RolloutRecord]:
    """Serve `model_path` on `cfg.endpoint.host`:`port` until interrupted (or `max_requests` answered); returns
    (and with `out`, writes) the samples' trajectories. SIGTERM: Terminated once they are written."""
    if cfg.agent.is_multi_turn:
        raise UserError("rlx serve takes no --env or --agent: clients drive the conversation")
    if not 0 <= port <= 65535:
        raise UserError(f"--port must be in [0, 65535], got {port}")
    if max_requests < 0:
        raise UserError(f"--max-requests must be >= 0 (0 = until interrupted), got {max_requests}")
    _check_port(cfg.endpoint.host, port)  # before the model loads: a taken port is known in a second, not after it
    source, config = resolve_model(model_path)
    tokenizer = load_tokenizer(source)
    processor = load_processor(source, cfg.vision, config)  # a vision-language model's images (None for a text model)
    ctx = setup(cfg.device)
    if ctx.world > 1:
        raise UserError("rlx serve runs in one process: start it without torchrun")
    dtype = engine_class(cfg.engine).model_dtype(cfg, ctx.device)
    model = load_model(source, dtype=dtype, config=config).requires_grad_(False)
    engine = build_engine(cfg, model, tokenizer, ctx, processor)
    sampling = cfg.sampling
    worker = StreamWorker(engine, sampling, max_context(cfg, model), cfg.native.max_num_seqs)
    try:
        server = AgentServer(
            worker,
            tokenizer,
            set(engine.stop_ids),
            sampling,
            cfg.agent,
            model_name=name,
            port=port,
            endpoint=cfg.endpoint,
        )
    except OSError as e:
        worker.close()
        raise UserError(f"cannot listen on {cfg.endpoint.host}:{port}: {e.strerror or e}") from None
    except UserError:
        worker.close()
        raise
    terminated = _serve_until_stopped(server, worker, engine, max_requests)
    records = [session_record(s, sampling.temperature) for s in server.all_sessions() if s.segments]
    if out:
        write_records(out, records)
        console(f"rlx serve: {len(records)} sample trajectories -> {'stdout' if out == '-' else out}")
    if terminated:
        raise Terminated("terminated by SIGTERM")
    return records


def _check_port(host: str, port: int) -> None:
    """UserError when `host`:`port` cannot be listened on now (taken, or an address this machine lacks)."""
    if port == 0:
        return
    try:
        socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET).close()
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def max_context(cfg: ServeConfig, model) -> int:
    """The longest context a sample may reach: max_total_tokens, the model's context and vllm's max_model_len."""
    limits = [cfg.agent.max_total_tokens, getattr(model.config, "max_position_embeddings", 0), cfg.vllm.max_model_len]
    return min(limit for limit in limits if limit and limit > 0)


def _serve_until_stopped(server: AgentServer, worker: StreamWorker, engine, max_requests: int) -> bool:
    """Serve until Ctrl-C, SIGTERM (returns True) or `max_requests` answered; then close everything."""
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        server.start()
        url = server.url
        console(f"rlx serve: {engine.name} engine on {url}/v1 (per sample: {url}/s/<sample_id>/v1 or X-Session-ID)")
        while not stop.wait(0.1):
            if max_requests and server.num_requests >= max_requests:
                break
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.close()
        worker.close()
        engine.close()
    return stop.is_set()


def session_record(session: SampleSession, temperature: float) -> RolloutRecord:
    """A served sample as a record, its last segment as the trajectory and the earlier ones in `segments`: id
    `<prompt_id>/<index>` when the sample id has that form."""
    prompt_id, _, index = session.sample_id.rpartition("/")
    if not (prompt_id and index.isdigit()):
        prompt_id, index = session.sample_id, "0"
    last = session.segments[-1]
    messages = last.trajectory.messages
    if last.kind == "chat":  # the messages before the first reply
        first_reply = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
        opening = messages[:first_reply]
    else:
        opening = session.tokenizer.decode(last.trajectory.prompt_ids)
    prompt = PromptRecord(id=prompt_id, prompt=opening or session.sample_id)
    return trajectory_record(
        prompt,
        int(index),
        last.trajectory,
        finish_reason="length" if session.hit_token_limit else last.finish_reason,
        response=last.last_turn_text,
        temperature=temperature,
        env_reward=0.0,
        extra=_extra(session),
        image_refs=last.image_refs,
    )


def _extra(session: SampleSession) -> dict:
    last = session.segments[-1]
    extra = {"num_segments": len(session.segments), "segment_reason": last.reason, "requests": session.num_requests}
    if len(session.segments) > 1:
        extra["segments"] = [s.to_json() for s in session.segments[:-1]]
    if last.turn_settings:
        extra["turn_settings"] = last.turn_settings
    if session.evicted:
        extra["evicted"] = session.evicted
    if session.client_session_ids:
        extra["client_session_ids"] = session.client_session_ids
    return extra
