"""Agent clients of the ecosystem against `rlx serve`: each runs its ordinary code path, and rlx's records are checked.

    python bench/agent_clients.py --work /tmp/agent_clients            # all four clients, ~5 min on 2 CPU cores
    python bench/agent_clients.py --work /tmp/agent_clients --clients langchain-openai,openenv-core

One venv under --work (made with `uv`, found next to this interpreter or on PATH) gets the pinned clients
(openai-agents 0.24, langchain-openai 1.7, smolagents 1.26, openenv-core 0.3: they install side by side). Two
`rlx serve` processes (native engine, CPU) serve tiny chat models built here on rlx's character tokenizer with
its Qwen2.5-style template: `text`, random weights whose replies are a few characters and stop; `tool`, a bigram
model whose every turn is `<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>` (a random model
never writes a valid tool call, so this is how a tool path gets exercised: every turn calls the tool, so agent
loops end at their turn limit). Each server sits behind a recording proxy on loopback that keeps every request body
and reply (streams included) per sample. bench/agent_clients_calls.py then runs in the client venv, one path per
sample (`/s/<client>.<path>/v1`); the servers are stopped (their `--out` written) and each path's records checked:
one record per conversation; each segment's prompt tokens are the chat template over the messages the client sent
(a Responses request read as rlx reads it); each sampled turn decodes to the reply the client got (its text, or
its tool calls as rlx's parser reads them); the tokens between two turns end the template over the next request;
one logprob per response token. Prints a table (markdown) and the rows as JSON under --work.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PINS = ("openai-agents==0.24.*", "langchain-openai==1.7.*", "smolagents==1.26.*", "openenv-core==0.3.*")
CLIENTS = ("openai-agents", "langchain-openai", "smolagents", "openenv-core")
ADD_PIECES = ('{"name": ', '"add"', ', "arguments": ', '{"a": 1, "b": 2', "}}")
ADD_SCRIPT = "\n<tool_call>" + "".join(ADD_PIECES) + "</tool_call><|im_end|>"
ROW_MARK = "agent_clients row: "
"""As bench/agent_clients_calls.py marks its rows."""
CONTEXT = 16384
"""Positions of the tiny models and the servers' --max-total-tokens (smolagents' system prompt is ~8k characters)."""


def build_models(folder: Path) -> dict[str, Path]:
    """The `text` and `tool` model folders (see the module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlx.models.tiny import SPECIAL_TOKENS
    from rlx.models.tiny_chat import MARKUP_TOKENS, build_chat_tokenizer, tiny_chat_config

    def untied(tokenizer, **kwargs):
        config = tiny_chat_config(tokenizer, max_positions=CONTEXT, **kwargs)
        config.tie_word_embeddings = False
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config).eval()

    text_tokenizer = build_chat_tokenizer("qwen2.5")
    text = untied(text_tokenizer)
    banned = text_tokenizer.convert_tokens_to_ids([*SPECIAL_TOKENS, "<|im_start|>", *MARKUP_TOKENS])
    tool_tokenizer = build_chat_tokenizer("qwen2.5")
    tool_tokenizer.add_tokens(list(ADD_PIECES))
    vocab = len(tool_tokenizer)
    tool = untied(tool_tokenizer, hidden_size=-(-(vocab + 1) // 8) * 8, num_layers=1, intermediate_size=16)
    ids = tool_tokenizer(ADD_SCRIPT, add_special_tokens=False)["input_ids"]
    following = dict(zip(ids[:-1], ids[1:]))
    with torch.no_grad():
        text.model.embed_tokens.weight[:, 0] = 1.0  # a constant direction: the head reads it as a bias
        text.lm_head.weight[:, 0] = 0.0
        text.lm_head.weight[banned, 0] = -10.0
        text.lm_head.weight[text_tokenizer.eos_token_id, 0] = 0.15
        for layer in tool.model.layers:  # the output depends on the last token alone
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embedding, head = tool.model.embed_tokens.weight, tool.lm_head.weight
        embedding.zero_()
        embedding[:, 0] = 1.0
        embedding[torch.arange(vocab), torch.arange(vocab) + 1] = 1.0
        head.zero_()
        for token in range(vocab):
            head[following.get(token, tool_tokenizer.eos_token_id), token + 1] = 10.0
    folders = {}
    for name, model, tokenizer in (("text", text, text_tokenizer), ("tool", tool, tool_tokenizer)):
        folders[name] = folder / f"model-{name}"
        model.save_pretrained(folders[name])
        tokenizer.save_pretrained(folders[name])
    return folders


class Recorder(http.server.ThreadingHTTPServer):
    """A proxy on loopback in front of one `rlx serve`: forwards each request, streams the reply back, and keeps
    (sample, route, request body, status, reply bytes) of each."""

    daemon_threads = True

    def __init__(self, upstream: str):
        super().__init__(("127.0.0.1", 0), _Forward)
        self.upstream, self.exchanges, self.lock = upstream, [], threading.Lock()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Forward(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # one request per connection: the reply ends when the connection closes

    def log_message(self, *args):
        pass

    def do_GET(self):  # noqa: N802 - the base class's name
        self._forward(b"")

    def do_POST(self):  # noqa: N802
        self._forward(self.rfile.read(int(self.headers.get("Content-Length") or 0)))

    def _forward(self, body: bytes) -> None:
        import httpx

        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length", "connection")}
        reply = bytearray()
        url = self.server.upstream + self.path
        with httpx.Client(timeout=600) as client, client.stream(self.command, url, content=body, headers=headers) as r:
            self.send_response(r.status_code)
            for key, value in r.headers.items():
                if key.lower() not in ("content-length", "transfer-encoding", "connection", "content-encoding"):
                    self.send_header(key, value)
            self.end_headers()
            for chunk in r.iter_raw():
                reply += chunk
                self.wfile.write(chunk)
                self.wfile.flush()
        parts = self.path.split("/")
        sample = parts[2] if len(parts) > 2 and parts[1] == "s" else self.headers.get("X-Session-ID", "default")
        route = self.path.split("/v1/", 1)[-1]
        with self.server.lock:
            self.server.exchanges.append((sample, route, body, r.status_code, bytes(reply)))


def start_server(model: Path, out: Path, max_new_tokens: int) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "rlx", "serve", "--model", str(model), "--port", "0", "--out", str(out),
               "--max-new-tokens", str(max_new_tokens), "--seed", "1", "--engine", "native",
               "--max-total-tokens", str(CONTEXT)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    for line in proc.stderr:
        if " on http://" in line:
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep its pipe drained
            return proc, line.split(" on ", 1)[1].split("/v1", 1)[0].strip()
    raise RuntimeError(f"rlx serve exited ({proc.wait()}) without printing its URL")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    if proc.wait(timeout=120) != 128 + signal.SIGTERM:
        raise RuntimeError(f"rlx serve exited with {proc.returncode}")


def make_venv(work: Path) -> Path:
    """The clients' venv (kept between runs); its python."""
    uv = shutil.which("uv", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if uv is None:
        raise SystemExit("uv is needed to make the clients' venv (pip install uv)")
    venv = work / "venv"
    if not (venv / "bin" / "python").exists():
        subprocess.run([uv, "venv", "-q", "-p", sys.executable, str(venv)], check=True)
    subprocess.run([uv, "pip", "install", "-q", "-p", str(venv / "bin" / "python"), *PINS], check=True)
    return venv / "bin" / "python"


def run_client(python: Path, client: str, roots: dict[str, str]) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"OMP_NUM_THREADS": "1", "OPENAI_API_KEY": "unused", "NO_PROXY": "127.0.0.1"}
    script = REPO / "bench" / "agent_clients_calls.py"
    done = subprocess.run([str(python), str(script), client, roots["text"], roots["tool"]], capture_output=True,
                          text=True, env=env, timeout=1200)  # fmt: skip
    rows = [json.loads(line.split(ROW_MARK, 1)[1]) for line in done.stdout.splitlines() if ROW_MARK in line]
    if not rows:
        rows = [{"client": client, "version": "?", "path": "-", "server": "text", "sample": "-",
                 "result": f"client script failed ({done.returncode})", "note": done.stderr[-600:]}]  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="folder for the venv, models, records and rows")
    parser.add_argument("--clients", default=",".join(CLIENTS), help="comma-separated subset of " + ", ".join(CLIENTS))
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    from bench.agent_clients_check import check_sample, load_tokenizer

    python = make_venv(args.work)
    models = build_models(args.work)
    servers, recorders, outs = {}, {}, {}
    try:
        for name, folder in models.items():
            outs[name] = args.work / f"served-{name}.jsonl"
            outs[name].unlink(missing_ok=True)
            servers[name], url = start_server(folder, outs[name], args.max_new_tokens)
            recorders[name] = Recorder(url)
        roots = {name: recorder.root for name, recorder in recorders.items()}
        rows = [row for client in args.clients.split(",") for row in run_client(python, client, roots)]
        for proc in servers.values():
            stop_server(proc)
    finally:
        for proc in servers.values():
            proc.kill()
    records = {name: [json.loads(line) for line in out.read_text().splitlines()] for name, out in outs.items()}
    tokenizers = {name: load_tokenizer(folder) for name, folder in models.items()}
    for row in rows:
        server = row["server"]
        exchanges = [e for e in recorders[server].exchanges if e[0] == row["sample"]]
        row["records_exact"] = check_sample(exchanges, records[server], row["sample"], tokenizers[server])
    (args.work / "rows.json").write_text(json.dumps(rows, indent=1))
    for name, recorder in recorders.items():  # what the clients sent and got, to read a failure by
        lines = [json.dumps({"sample": e[0], "route": e[1], "request": e[2].decode(errors="replace"), "status": e[3],
                             "reply": e[4].decode(errors="replace")}) for e in recorder.exchanges]  # fmt: skip
        (args.work / f"exchanges-{name}.jsonl").write_text("".join(line + "\n" for line in lines))
    print("| client | version | path | result | records exact |\n|---|---|---|---|---|")
    for row in rows:
        result = " ".join(row["result"].replace("|", "/").split())[:160]
        print(f"| {row['client']} | {row['version']} | {row['path']} | {result} | {row['records_exact']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
