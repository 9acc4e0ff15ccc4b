"""`rlx serve`: the OpenAI-compatible endpoint of server.py as a command, backed by any rollout engine.

The server runs until interrupted (Ctrl-C or SIGTERM), or for `max_requests` requests. Every request belongs to
a sample: `/s/<sample_id>/v1/...` names it, `/v1/...` is the sample 'default'. On exit, with an output file,
each sample's trajectory (its last segment: see sessions.py) is written as a rollouts.jsonl record, token-exact
with its loss_mask (and a vision-language model's images in `image_refs`), so anything that drives a model through
an OpenAI client produces rlx training data.
"""

from __future__ import annotations

import signal
import threading

from rlx.chat.records import trajectory_record
from rlx.checkpoints.loading import load_model, load_processor
from rlx.errors import UserError
from rlx.formats.records import PromptRecord, RolloutRecord, write_records
from rlx.models.loading import load_tokenizer, resolve_source
from rlx.observe.tracking import console
from rlx.parallel.dist import setup
from rlx.rollout.base import build_engine
from rlx.rollout.config import RolloutConfig
from rlx.rollout.registry import engine_class
from rlx.serve.server import AgentServer
from rlx.serve.sessions import SampleSession
from rlx.serve.stream import StreamBackend


def run_serve(
    cfg: RolloutConfig, model_path: str, port: int, out: str | None, max_requests: int = 0, name: str = "rlx"
) -> list[RolloutRecord]:
    """Serve `model_path` on 127.0.0.1:`port` until interrupted (or `max_requests` answered); returns (and with
    `out`, writes) the samples' trajectories."""
    if cfg.env or cfg.agent:
        raise UserError("rlx serve takes no --env or --agent: clients drive the conversation")
    if not 0 <= port <= 65535:
        raise UserError(f"--port must be in [0, 65535], got {port}")
    source = resolve_source(model_path)
    tokenizer = load_tokenizer(source)
    processor = load_processor(source, cfg.vision)  # a vision-language model's images (None for a text model)
    ctx = setup(cfg.device)
    if ctx.world > 1:
        raise UserError("rlx serve runs in one process: start it without torchrun")
    dtype = engine_class(cfg.engine).model_dtype(cfg, ctx.device)
    engine = build_engine(cfg, load_model(source, dtype=dtype).requires_grad_(False), tokenizer, ctx, processor)
    sampling = cfg.sampling()
    backend = StreamBackend(engine, sampling, cfg.max_total_tokens, cfg.max_num_seqs)
    try:
        server = AgentServer(backend, tokenizer, set(engine.stop_ids), sampling, cfg, model_name=name, port=port)
    except OSError as e:
        backend.close()
        raise UserError(f"cannot listen on 127.0.0.1:{port}: {e.strerror or e}") from None
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    server.start()
    console(f"rlx serve: {engine.name} engine on {server.url}/v1 (per sample: {server.url}/s/<sample_id>/v1)")
    try:
        while not stop.wait(0.1):
            if max_requests and sum(s.num_requests for s in list(server.sessions.values())) >= max_requests:
                break
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.close()
        backend.close()
        engine.close()
    records = [session_record(s, sampling.temperature) for s in server.sessions.values() if s.segments]
    if out:
        write_records(out, records)
        console(f"rlx serve: {len(records)} sample trajectories -> {'stdout' if out == '-' else out}")
    return records


def session_record(session: SampleSession, temperature: float) -> RolloutRecord:
    """A served sample's last segment as a record: id `<prompt_id>/<index>` when the sample id has that form."""
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
        extra={"num_segments": len(session.segments), "segment_reason": last.reason, "requests": session.num_requests},
        image_refs=last.image_refs,
    )
