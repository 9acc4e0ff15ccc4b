"""verifiers 0.4 end to end against `rlx serve`: `vf-eval` (its own CLI, its built-in `null` harness, which streams
every turn, and its relay client, which names each rollout by `X-Session-ID`) runs an in-memory arithmetic taskset
(tests/stages/workers/verifiers_arith) on a tiny chat model; every rollout completes with its reward, and `--out`
holds one token-exact record per rollout. The client lives in its own venv (.venv-verifiers, made by
`make setup-test`: verifiers needs openai<3); without it the test is skipped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.agent_helpers import bigram_chat_model, random_chat_model
from tests.conftest import REPO, read_jsonl
from tests.stages.test_multi_turn_stages import wait_for_url

CLIENT_BIN = REPO / ".venv-verifiers" / "bin"
TASKSETS = Path(__file__).parent / "workers"
ADD_PIECES = ('{"name": ', '"add"', ', "arguments": ', '{"a": 1, "b": 2', "}}")
ADD_SCRIPT = "\n<tool_call>" + "".join(ADD_PIECES) + "</tool_call><|im_end|>"  # every turn calls add(1, 2)

pytestmark = pytest.mark.skipif(
    not (CLIENT_BIN / "vf-eval").exists(), reason="verifiers' client venv is absent (make setup-test makes it)"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("vf") / "model"
    model, tokenizer = random_chat_model(stop_bias=0.5)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def serve(model: Path, out: Path, max_new_tokens: int = 8) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "rlx", "serve", "--model", model, "--port", "0", "--out", out,
               "--max-new-tokens", max_new_tokens, "--seed", "1", "--engine", "native"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([str(c) for c in command], stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    return proc, wait_for_url(proc)


def vf_eval(url: str, output_dir: Path, *args: str, max_tokens: int = 8) -> list[dict]:
    """Runs vf-eval in the client's venv (its PATH first: the harness prepares its program with uv); the traces of
    the episodes it wrote, each checked to have ended without error."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"PATH": f"{CLIENT_BIN}{os.pathsep}{env['PATH']}", "PYTHONPATH": str(TASKSETS), "OMP_NUM_THREADS": "1"}
    command = [CLIENT_BIN / "vf-eval", *args, "--model", "rlx", "--client.base-url", f"{url}/v1",
               "--env.agent.harness.id", "null", "--env.agent.runtime.type", "subprocess", "--sampling.max-tokens",
               max_tokens, "--no-rich", "--no-push", "--output-dir", output_dir]  # fmt: skip
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, env=env, timeout=480)
    assert done.returncode == 0, done.stderr[-3000:]
    (written,) = output_dir.glob("*/traces.jsonl")
    episodes = read_jsonl(written)
    assert all(episode["ok"] and not episode["errors"] for episode in episodes), episodes
    return [trace for episode in episodes for trace in episode["traces"]]


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM, proc.stderr.read()


@pytest.mark.slow
def test_vf_eval_rollouts_are_recorded_token_exact_one_record_each(model_dir, tmp_path):
    """~60 s: one `rlx serve`; vf-eval's eval client (streamed chat completions) runs 3 questions x 2 rollouts
    concurrently, each its own X-Session-ID (two share each prompt); then its train client (token in, token out
    on /inference/v1/generate, the prompt rendered by verifiers' renderer from the model folder) 2 x 1."""
    out = tmp_path / "served.jsonl"
    proc, url = serve(model_dir, out)
    try:
        streamed = vf_eval(url, tmp_path / "eval", "verifiers-arith", "-n", "3", "-r", "2")
        train = ["--client.type", "train", "--client.renderer-model-name", str(model_dir)]
        rendered = vf_eval(url, tmp_path / "train", "verifiers-arith", "-n", "2", "-r", "1", *train)
        stop(proc)
    finally:
        proc.kill()
    records = {record["prompt_id"]: record for record in read_jsonl(out)}
    assert len(records) == len(read_jsonl(out)) == 8 and set(records) == {t["id"] for t in streamed + rendered}
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for trace in streamed + rendered:
        assert trace["is_completed"] and trace["ok"] and not trace["errors"], trace.get("errors")
        record = records[trace["id"]]
        assert record["num_segments"] == 1 and record["num_turns"] == 1
        answer = str(trace["task"]["data"]["answer"])
        assert trace["rewards"]["correct"]["score"] == float(answer in record["response"])
    for trace in streamed:
        assert_same_text(trace, records[trace["id"]], tokenizer)
    prompts = sorted(json.dumps(records[trace["id"]]["prompt"]) for trace in streamed)
    assert prompts[::2] == prompts[1::2] and len(set(prompts)) == 3  # two rollouts of each question, kept apart
    for trace in rendered:  # the client's own token-exact trajectory is the record's
        record = records[trace["id"]]
        assert [i for node in trace["nodes"] for i in node["token_ids"]] == record["prompt_ids"] + record[
            "response_ids"
        ]
        sampled = [lp for node in trace["nodes"] for lp in node["logprobs"]]
        assert sampled == pytest.approx(record["rollout_logprobs"], abs=1e-3)


def assert_same_text(trace: dict, record: dict, tokenizer) -> None:
    """The record's prompt tokens are the chat template over what the client sent; its sampled tokens decode to
    the reply the client got (a stop token is sampled and kept, but no text)."""
    *sent, reply = [node["message"] for node in trace["nodes"]]
    assert record["prompt_ids"] == tokenizer.apply_chat_template(sent, add_generation_prompt=True)["input_ids"]
    ids = record["response_ids"]
    if record["finish_reason"] == "stop":
        assert ids[-1] == tokenizer.eos_token_id
        ids = ids[:-1]
    assert reply["role"] == "assistant"  # an empty reply's trace node keeps no content
    assert tokenizer.decode(ids) == reply.get("content", "") == record["response"]
    assert len(record["rollout_logprobs"]) == len(record["response_ids"])


@pytest.mark.slow
def test_vf_eval_tool_rollout_is_one_token_exact_multi_turn_record(tmp_path):
    """~1-2 min (verifiers starts the tool's MCP server in its own process): a model that calls `add` every turn; the
    harness runs the tool and sends its result back until the rollout's 2 turns are used. One record holds both
    turns as sampled, the tool result (out of the loss) as the chat template renders it."""
    model_dir = tmp_path / "model"
    model, tokenizer = bigram_chat_model(ADD_SCRIPT, extra_tokens=ADD_PIECES)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    out = tmp_path / "served.jsonl"
    proc, url = serve(model_dir, out, max_new_tokens=16)
    try:
        tools = ["--env.taskset.task.tools", "true", "--env.agent.max-turns", "2"]
        (trace,) = vf_eval(url, tmp_path / "tools", "verifiers-arith", "-n", "1", "-r", "1", *tools, max_tokens=16)
        stop(proc)
    finally:
        proc.kill()
    assert trace["stop_condition"] == "max_turns" and trace["rewards"]["correct"]["score"] == 1.0
    (record,) = read_jsonl(out)
    assert record["prompt_id"] == trace["id"] and record["num_segments"] == 1 and record["num_turns"] == 2
    sent = [node["message"] for node in trace["nodes"]]
    assert (
        [m["role"] for m in sent]
        == [m["role"] for m in record["messages"]]
        == ["user", "assistant", "tool", "assistant"]
    )
    assert sent[2]["content"] == record["messages"][2]["content"] == "3"
    for seen, kept in zip(sent[1::2], record["messages"][1::2]):
        assert [(c["name"], json.loads(c["arguments"])) for c in seen["tool_calls"]] == [("add", {"a": 1, "b": 2})]
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in kept["tool_calls"]] == [
            ("add", '{"a": 1, "b": 2}')
        ]
    offered = [
        {"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}}
        for t in trace["tools"]
    ]

    def render(messages: list[dict]) -> list[int]:
        return tokenizer.apply_chat_template(messages, tools=offered, add_generation_prompt=True)["input_ids"]

    assert record["prompt_ids"] == render(sent[:1])
    ids, mask = record["response_ids"], record["loss_mask"]
    turn = tokenizer(ADD_SCRIPT.removeprefix("\n"), add_special_tokens=False)["input_ids"]  # the prompt ends in \n
    assert ids[: len(turn)] == turn == ids[-len(turn) :] and mask == [1] * len(turn) + [0] * (
        len(ids) - 2 * len(turn)
    ) + [1] * len(turn)
    between = ids[len(turn) : -len(turn)]  # the tool's result and the next turn's opening, as the template writes them
    assert render(record["messages"][:3])[-len(between) :] == between
