"""Hostile and malformed requests against `rlx serve`'s endpoint on loopback; the server must still answer after.

    python bench/serve_fuzz.py                      # ~300 requests, at most 120 s, a tiny random chat model on CPU
    python bench/serve_fuzz.py --count 2000 --seconds 300 --seed 1

A server (the in-process AgentServer, hf engine, a random tiny chat model; --image-root a fresh temporary folder,
--api-key set, a 64 KiB body limit) gets, in a seeded random order: malformed JSON, wrong types in every field,
huge bodies (declared and undeclared lengths), deeply nested JSON, hostile image references (/dev/zero, a FIFO, a
symlink out of the root, `zip://...::http://127.0.0.1:PORT`, http URLs, s3://), unknown fields, wrong methods and
routes, a missing or wrong API key, raw garbage bytes on the socket, and half-sent requests. Every request is
bounded (a 20 s timeout) and only 127.0.0.1 is contacted; a local listener counts any connection the server
makes (there must be none), and an audit hook (`sys.addaudithook`, event "open") records every file the process
opens while the requests run. Checks, printed as one JSON line: no 5xx answer, no connection to the listener, no
file opened under /etc or /dev (but /dev/null and /dev/urandom) or through the FIFO or the symlink out of the root,
the process's resident memory back within 256 MiB of its level after the first answered request, and a plain chat
request answered 200 at the end. Exit code 1 when a check fails.
"""

from __future__ import annotations

import argparse
import gc
import http.server
import json
import os
import random
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


class _Listener(http.server.BaseHTTPRequestHandler):
    hits = 0

    def do_GET(self):  # noqa: N802 - the base class's name
        type(self).hits += 1
        self.send_response(404)
        self.end_headers()

    def log_message(self, *args):
        pass


def build_server(root: Path, key: str):
    import torch
    from transformers import AutoModelForCausalLM

    from rlx.models.tiny_chat import build_chat_tokenizer, tiny_chat_config
    from rlx.parallel.dist import DistContext
    from rlx.rollout.agent_config import AgentConfig
    from rlx.rollout.base import build_engine
    from rlx.rollout.config import RolloutConfig, SamplingParams
    from rlx.serve.config import EndpointConfig
    from rlx.serve.server import AgentServer
    from rlx.serve.stream import StreamWorker

    tokenizer = build_chat_tokenizer("qwen2.5")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_chat_config(tokenizer)).eval()
    cfg = RolloutConfig(sampling=SamplingParams(max_new_tokens=4, temperature=1.0))
    engine = build_engine(cfg, model, tokenizer, DistContext(device=torch.device("cpu")))
    agent = AgentConfig(max_total_tokens=512)
    worker = StreamWorker(engine, cfg.sampling, agent.max_total_tokens)
    endpoint = EndpointConfig(api_key=key, max_request_mib=1 / 16, image_root=str(root), max_sessions=64)
    return AgentServer(worker, tokenizer, engine.stop_ids, cfg.sampling, agent, endpoint=endpoint).start()


def hostile_bodies(port: int, root: Path) -> list:
    """(description, body bytes or dict) pairs: what the fuzzer sends to /v1/chat/completions."""
    refs = ["/dev/zero", str(root / "fifo.png"), str(root / "out.png"), "../../etc/passwd", "file:///etc/hostname",
            f"zip://a.png::http://127.0.0.1:{port}/a.zip", f"http://127.0.0.1:{port}/a.png", "s3://b/k.png",
            "memory://x.png", "data:image/png;base64,@@@", "data:,", "", "a" * 5000]  # fmt: skip
    user = {"role": "user", "content": "hi"}
    parts = [[{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": ref}}] for ref in refs]
    out = [(f"image {ref[:40]!r}", {"messages": [{"role": "user", "content": p}]}) for ref, p in zip(refs, parts)]
    for field, value in [("messages", "x"), ("messages", [1]), ("max_tokens", -1), ("max_tokens", 10**12),
                         ("temperature", "hot"), ("stop", [None]), ("tools", [1]), ("n", 10**6), ("seed", 2**70),
                         ("stream", 1), ("stream_options", {"x": 1}), ("logprobs", 3), ("model", None),
                         ("tool_choice", {"type": "function"}), ("response_format", []), ("whatever", 1)]:  # fmt: skip
        out.append((f"field {field}={value!r:.30}", {"messages": [user], field: value}))
    out += [
        ("not json", b"{not json"),
        ("not an object", b"[1, 2]"),
        ("bad utf-8", b'{"messages": "\xff\xfe"}'),
        ("deep nesting", b'{"messages": ' + b"[" * 10000 + b"]" * 10000 + b"}"),
        ("huge body", b'{"messages": [], "x": "' + b"a" * (1 << 20) + b'"}'),
        ("huge content", {"messages": [{"role": "user", "content": "x" * 100000}]}),
        ("many messages", {"messages": [user] * 3000}),
        ("role missing", {"messages": [{"content": "x"}]}),
        ("audio part", {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}),
    ]
    return out


class OpenedFiles:
    """Paths the process opens while `recording` (builtins.open, os.open, io.open: the audit event "open")."""

    def __init__(self):
        self.paths: list[str] = []
        self.recording = False
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args) -> None:
        if self.recording and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            self.paths.append(os.fsdecode(args[0]))

    def forbidden(self, root: Path) -> list[str]:
        """Opened paths a request could only have reached by escaping the image root."""
        allowed = {"/dev/null", "/dev/urandom"}
        escapes = {str(root / "fifo.png"), str(root / "out.png"), "/etc/hostname", "/etc/passwd"}
        bad = [p for p in self.paths if p in escapes or (p.startswith(("/etc/", "/dev/")) and p not in allowed)]
        return sorted(set(bad))


def rss_mib() -> float:
    """Resident memory of this process (Linux /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def raw_socket(port: int, data: bytes) -> None:
    """Garbage or a half-sent request straight on the socket (bounded: 2 s)."""
    with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
        try:
            sock.sendall(data)
            sock.recv(1024)
        except OSError:
            pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=300, help="requests to send")
    parser.add_argument("--seconds", type=float, default=120.0, help="stop sending after this long")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    listener = http.server.HTTPServer(("127.0.0.1", 0), _Listener)
    threading.Thread(target=listener.serve_forever, daemon=True).start()
    key, rng = "fuzz-key", random.Random(args.seed)
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        os.mkfifo(root / "fifo.png")
        (root / "out.png").symlink_to("/etc/hostname")
        server = build_server(root, key)
        port = int(server.url.rsplit(":", 1)[1])
        cases = hostile_bodies(listener.server_address[1], root)
        half = b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{"
        long_line = b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n"
        raw = [b"GARBAGE\r\n\r\n", half, long_line, bytes(rng.randrange(256) for _ in range(512))]
        statuses: dict[int, int] = {}
        failures: list[str] = []
        began, sent = time.monotonic(), 0
        headers = {"Authorization": f"Bearer {key}"}
        opened = OpenedFiles()
        with httpx.Client(base_url=server.url, timeout=20) as client:
            last = {"messages": [{"role": "user", "content": "still there?"}], "max_tokens": 2}
            client.post("/v1/chat/completions", headers=headers, json=last)  # warm: the first answer's memory
            gc.collect()
            rss_before = rss_mib()
            opened.recording = True
            while sent < args.count and time.monotonic() - began < args.seconds:
                sent += 1
                pick = rng.random()
                if pick < 0.1:
                    raw_socket(port, rng.choice(raw))
                    continue
                name, body = rng.choice(cases)
                auth = headers if pick > 0.15 else rng.choice([{}, {"Authorization": "Bearer nope"}])
                session = {"X-Session-ID": f"fuzz/{rng.randrange(200)}"}
                kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
                path = rng.choice(["/v1/chat/completions"] * 8 + ["/v1/completions", "/v1/nothing", "/s/%00/v1/models"])
                try:
                    status = client.post(path, headers={**auth, **session}, **kwargs).status_code
                except httpx.HTTPError:
                    status = -1
                statuses[status] = statuses.get(status, 0) + 1
                if status >= 500 or status < 0:
                    failures.append(f"{status} {path} {name}")
            final = client.post("/v1/chat/completions", headers=headers, json=last)
            opened.recording = False
            gc.collect()
            rss_after = rss_mib()
        forbidden = opened.forbidden(root)
        server.close()
        server.worker.close()
    report = {
        "sent": sent,
        "seconds": round(time.monotonic() - began, 1),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "server_errors": sum(v for k, v in statuses.items() if k >= 500),
        "listener_hits": _Listener.hits,
        "final_status": final.status_code,
        "rss_mib_before_after": [round(rss_before), round(rss_after)],
        "forbidden_opens": forbidden,
        "failures": sorted(set(failures))[:20],
    }
    print(json.dumps(report))
    ok = report["server_errors"] == 0 and report["listener_hits"] == 0 and final.status_code == 200
    ok = ok and not forbidden and rss_after - rss_before < 256
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
