"""One turn's latency through `rlx serve` (native engine) with and without `stream: true`: median and p90 over many.

    python bench/serve_stream.py                                          # 0.5B-like model, 200 turns of 128 tokens
    python bench/serve_stream.py --hidden-size 64 --num-layers 2 --turns 100 --max-tokens 32   # a CPU smoke run

A random chat model (--hidden-size/--num-layers size it, 0.5B-like by default) whose <|im_end|> is ruled out, so
every turn samples exactly --max-tokens tokens, is served by a real `rlx serve` process (`--engine native`; on CUDA
where there is one). One client on a kept-alive HTTP connection sends chat completions one at a time, each on a
sample of its own (`/s/<id>/v1`, so no turn extends another's context), plain and streamed in alternating order
(plain first on even pairs, streamed first on odd ones, so drift on a shared machine hits both alike), after
--warmup pairs. A turn's latency is from sending the request to the last byte of the reply: the whole JSON body,
or the stream's `data: [DONE]` (every chunk parsed, the pieces joined). Prints JSON: per mode the median, p90 and
mean seconds, the stream's time to its first content piece, and `stream_overhead`: the streamed median over the
plain one, minus 1 (also the median of the pairs' ratios, and of their differences per token), and the server's
CPU time per turn in each mode (from /proc: what streaming costs the server, far less sensitive to other load on a
shared machine than wall time). Both modes are checked to sample --max-tokens tokens, and every streamed turn to
send content.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402  (the openai client's HTTP stack)
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from rlx.models.tiny import SPECIAL_TOKENS  # noqa: E402
from rlx.models.tiny_chat import MARKUP_TOKENS, build_chat_tokenizer, tiny_chat_config  # noqa: E402

MESSAGES = [{"role": "system", "content": "Answer at length."}, {"role": "user", "content": "Tell me a story."}]


def save_endless_model(path: Path, hidden_size: int, num_layers: int) -> None:
    """Random weights; a constant embedding dimension read by the head rules out <|im_end|>, the special and the
    markup tokens, so a turn always runs to max_tokens with plain text (no tool call is ever read)."""
    tokenizer = build_chat_tokenizer("qwen2.5")
    config = tiny_chat_config(tokenizer, hidden_size=hidden_size, num_layers=num_layers, max_positions=4096)
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    banned = tokenizer.convert_tokens_to_ids([*SPECIAL_TOKENS, "<|im_start|>", "<|im_end|>", *MARKUP_TOKENS])
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 20.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[banned, 0] = -10.0
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def start_server(model_dir: Path, args) -> tuple[subprocess.Popen, str]:
    """`rlx serve` on a free port; its URL (its stderr is drained by a thread, the last lines kept)."""
    command = [sys.executable, "-m", "rlx", "serve", "--model", str(model_dir), "--port", "0", "--engine", "native",
               "--max-new-tokens", str(args.max_tokens), "--max-total-tokens", "4096", "--temperature", "1.0",
               "--seed", "0", "--precision", args.precision, "--session-idle-s", "0"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    for line in proc.stderr:
        if " on http://" in line:
            url = line.split(" on ", 1)[1].split("/v1", 1)[0]
            break
    else:
        raise SystemExit(f"rlx serve exited ({proc.wait()}) without printing its URL")
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    return proc, url


def cpu_seconds(pid: int) -> float:
    """CPU time the process has used (user + system, every thread), from /proc (0 where there is none)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def plain_turn(client: httpx.Client, url: str, sample: str, max_tokens: int) -> dict:
    began = time.perf_counter()
    reply = client.post(f"{url}/s/{sample}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": max_tokens})
    seconds = time.perf_counter() - began
    reply.raise_for_status()
    body = reply.json()
    return {"seconds": seconds, "tokens": body["usage"]["completion_tokens"]}


def streamed_turn(client: httpx.Client, url: str, sample: str, max_tokens: int) -> dict:
    request = {"messages": MESSAGES, "max_tokens": max_tokens, "stream": True}
    request["stream_options"] = {"include_usage": True}
    pieces, first, usage = [], None, None
    began = time.perf_counter()
    with client.stream("POST", f"{url}/s/{sample}/v1/chat/completions", json=request) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                if choice["delta"].get("content"):
                    pieces.append(choice["delta"]["content"])
                    first = first or time.perf_counter() - began
    seconds = time.perf_counter() - began
    return {"seconds": seconds, "first_piece_s": first, "tokens": usage["completion_tokens"], "text": "".join(pieces)}


def summary(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"median_s": statistics.median(ordered), "p90_s": ordered[int(0.9 * (len(ordered) - 1))],
            "mean_s": statistics.fmean(ordered)}  # fmt: skip


def measure(url: str, pid: int, args) -> dict:
    plain, streamed, ratios, extra = [], [], [], []
    cpu = {"plain": 0.0, "stream": 0.0}
    with httpx.Client(timeout=600) as client:
        for i in range(args.warmup + args.turns):
            kinds = ("plain", "stream") if i % 2 == 0 else ("stream", "plain")
            got = {}
            for kind in kinds:
                turn = plain_turn if kind == "plain" else streamed_turn
                used = cpu_seconds(pid)
                got[kind] = turn(client, url, f"{kind}-{i}", args.max_tokens)
                if i >= args.warmup:
                    cpu[kind] += cpu_seconds(pid) - used
                assert got[kind]["tokens"] == args.max_tokens, f"{kind} turn {i}: {got[kind]['tokens']} tokens"
            assert got["stream"]["text"], f"stream turn {i}: no content"
            if i >= args.warmup:
                plain.append(got["plain"]["seconds"])
                streamed.append(got["stream"])
                ratios.append(got["stream"]["seconds"] / got["plain"]["seconds"])
                extra.append(got["stream"]["seconds"] - got["plain"]["seconds"])
    stream_s = [t["seconds"] for t in streamed]
    out = {"plain": summary(plain), "stream": summary(stream_s)}
    out["stream"]["first_piece_median_s"] = statistics.median(t["first_piece_s"] for t in streamed)
    out["stream_overhead"] = out["stream"]["median_s"] / out["plain"]["median_s"] - 1
    out["stream_overhead_p90"] = out["stream"]["p90_s"] / out["plain"]["p90_s"] - 1
    out["stream_overhead_paired_median"] = statistics.median(ratios) - 1
    out["plain_ms_per_token"] = 1000 * out["plain"]["median_s"] / args.max_tokens
    out["stream_extra_ms_per_token_paired_median"] = 1000 * statistics.median(extra) / args.max_tokens
    for kind in cpu:  # the server's CPU time (all its threads) per turn: far less sensitive to a busy machine
        out[kind]["server_cpu_ms_per_turn"] = 1000 * cpu[kind] / args.turns
    out["stream_extra_server_cpu_ms_per_token"] = 1000 * (cpu["stream"] - cpu["plain"]) / args.turns / args.max_tokens
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=200, help="measured pairs (one plain, one streamed turn each)")
    parser.add_argument("--warmup", type=int, default=5, help="pairs sent first and not measured")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens sampled per turn (every turn runs to it)")
    parser.add_argument("--hidden-size", type=int, default=896)
    parser.add_argument("--num-layers", type=int, default=24)
    parser.add_argument("--precision", default="auto")
    args = parser.parse_args()
    model_dir = Path(tempfile.mkdtemp()) / "model"
    save_endless_model(model_dir, args.hidden_size, args.num_layers)
    proc, url = start_server(model_dir, args)
    try:
        results = measure(url, proc.pid, args)
    finally:
        proc.terminate()
        proc.wait(60)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(json.dumps({"device": device, "args": vars(args), **results}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
