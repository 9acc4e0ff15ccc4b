"""Images through `rlx serve` and `--agent` on tiny VLMs: OpenAI `image_url` parts (data: URI, path, file://) and rlx's
`image` parts, token-exact with the environment path and transformers' forward of the whole sequence, hf == native,
compared by content (a changed image rewrites the history), `rlx score` rebuilding the images, bad images as HTTP
400 that the server survives, and an environment's unreadable image as an environment error under
--on-env-error zero.
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import torch
from PIL import Image
from safetensors import safe_open

from rlx.agent.agents import AgentRollout
from rlx.agent.driver import EnvRollout
from rlx.agent.generate import refuse_images
from rlx.errors import UserError
from rlx.models.vision.images import data_uri
from rlx.models.vision.tiny import build_tiny_vision_model, write_tiny_vision_model_dir
from rlx.parallel.dist import DistContext
from rlx.rollout.agent_config import AgentConfig
from rlx.rollout.base import build_engine
from rlx.rollout.config import RolloutConfig, SamplingParams
from rlx.rollout.registry import engine_class
from rlx.serve.config import EndpointConfig, ServeConfig
from rlx.serve.server import AgentServer
from rlx.serve.stream import StreamWorker
from rlx.stages.serve import run_serve
from tests.conftest import cli_ok, flat_config, read_jsonl, write_jsonl
from tests.stages.test_multi_turn_images import STOPS, image_prompts, whole_sequence_logprobs

FILES = '''
import random

from openai import OpenAI
from PIL import Image

from rlx.models.vision.images import data_uri


def picture(seed, height, width):
    rng = random.Random(seed)
    image = Image.new("RGB", (width, height))
    image.putdata([tuple(rng.randrange(256) for _ in range(3)) for _ in range(width * height)])
    return data_uri(image)


def opening(record):
    prompt = record["prompt"]
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def look_twice(record, base_url):
    """Sends the record's messages (rlx image parts as they are), then a second picture as an OpenAI image_url part."""
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = opening(record)
    for turn in range(2):
        choice = client.chat.completions.create(model="rlx", messages=messages).choices[0]
        if choice.finish_reason == "length":
            return 0.0
        messages.append(choice.message.model_dump(exclude_none=True))
        second = [{"type": "text", "text": "and"}, {"type": "image_url", "image_url": {"url": picture(7, 16, 16)}}]
        messages.append({"role": "user", "content": second})
    return 1.0


class LookTwice:
    """look_twice's conversation from the environment's side."""

    def __init__(self, record):
        self.record, self.turns = record, 0

    def reset(self):
        return opening(self.record)

    def step(self, message):
        self.turns += 1
        if self.turns == 2:
            return [], 1.0, True
        second = [{"type": "text", "text": "and"}, {"type": "image", "image": picture(7, 16, 16)}]
        return [{"role": "user", "content": second}], 0.0, False


class Broken(LookTwice):
    """Replies with a picture that cannot be used: missing for sample index 0, not an image for index 1."""

    def step(self, message):
        bad = "gone.png" if self.record["id"].endswith(("0", "2")) else "data:image/png;base64,bm90IGFuIGltYWdl"
        return [{"role": "user", "content": [{"type": "image", "image": bad}]}], 0.0, False
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("agent_images")
    (folder / "files.py").write_text(FILES)
    return folder


def vlm_engine(model, processor, engine: str, **settings):
    flat = dict(n=2, max_new_tokens=6, temperature=1.0, seed=5, stop=list(STOPS), max_total_tokens=500, block_size=4)
    cfg = flat_config(RolloutConfig, engine=engine, precision="float32", kv_cache_gib=0.01, max_num_seqs=8, **flat,
                      **settings)  # fmt: skip
    return build_engine(cfg, model, processor.tokenizer, DistContext(device=torch.device("cpu")), processor), cfg


def test_agent_with_images_equals_the_environment_and_transformers(files):
    """look_twice through the server == LookTwice through the environment path, token for token (hf and native), and
    the logprobs equal transformers' forward of the whole sequence with all of its images."""
    model, processor = build_tiny_vision_model("qwen2_vl")
    prompts = image_prompts()
    out = {}
    for engine_name in ("hf", "native"):
        engine, cfg = vlm_engine(model, processor, engine_name, env=f"{files}/files.py:LookTwice")
        from_env = EnvRollout(engine, processor.tokenizer, cfg.sampling, cfg.agent).generate(prompts).records
        runner = AgentRollout(engine, processor.tokenizer, cfg.sampling, cfg.agent, f"{files}/files.py:look_twice")
        out[engine_name] = runner.generate(prompts).records
        assert sum(r.num_turns == 2 for r in from_env) >= 4
        for env_rec, agent_rec in zip(from_env, out[engine_name]):
            assert (agent_rec.prompt_ids, agent_rec.response_ids) == (env_rec.prompt_ids, env_rec.response_ids)
            assert (agent_rec.loss_mask, agent_rec.image_refs) == (env_rec.loss_mask, env_rec.image_refs)
            assert (agent_rec.num_turns, agent_rec.env_reward) == (env_rec.num_turns, env_rec.env_reward)
            assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(agent_rec.rollout_logprobs,
                                                                        env_rec.rollout_logprobs))  # fmt: skip
            assert agent_rec.extra["num_segments"] == 1
    for hf, native in zip(out["hf"], out["native"]):
        assert (hf.response_ids, hf.image_refs) == (native.response_ids, native.image_refs)
        assert all(math.isclose(a, b, abs_tol=2e-5) for a, b in zip(hf.rollout_logprobs, native.rollout_logprobs))
    checked = 0
    for record in out["hf"]:
        opening = [] if record.prompt_id == "text" else [record.prompt[0]["content"][0]["image"]]
        assert record.image_refs[: len(opening)] == opening and len(record.image_refs) == len(opening) + (
            record.num_turns == 2
        )
        if processor.image_token_id in [t for t, m in zip(record.response_ids, record.loss_mask) if m]:
            continue  # transformers would take a sampled placeholder for an image
        want = whole_sequence_logprobs(model, processor, record) * torch.tensor(record.loss_mask)
        torch.testing.assert_close(torch.tensor(record.rollout_logprobs), want, atol=1e-5, rtol=0)
        checked += record.num_turns == 2
    assert checked >= 3


def png_bytes(seed: int, size: int = 16) -> bytes:
    rng = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size, size, 3), generator=rng, dtype=torch.uint8)
    return base64.b64decode(data_uri(Image.fromarray(pixels.numpy())).split(",", 1)[1])


def vlm_server(engine_type=None, image_root=None) -> tuple[AgentServer, StreamWorker]:
    """A server of a tiny Qwen2-VL on the hf engine (or `engine_type`, a subclass of it); clients may name files
    under `image_root`."""
    model, processor = build_tiny_vision_model("qwen2_vl")
    sampling = SamplingParams(max_new_tokens=4, temperature=1.0, seed=1, stop=STOPS)
    cfg = AgentConfig(max_total_tokens=400)
    engine_type = engine_type or engine_class("hf")
    ctx = DistContext(device=torch.device("cpu"))
    engine = engine_type(model, processor.tokenizer, RolloutConfig(precision="float32"), ctx, processor=processor)
    worker = StreamWorker(engine, sampling, cfg.max_total_tokens)
    endpoint = EndpointConfig(image_root=str(image_root or ""))
    return AgentServer(worker, processor.tokenizer, engine.stop_ids, sampling, cfg, endpoint=endpoint).start(), worker


def image_url(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_images_are_compared_by_content_whatever_the_url(tmp_path):
    """A data: URI, a path and a file:// URL of the same bytes, or the same pixels encoded otherwise (BMP), are the
    same image (the segment goes on); another picture, or other bytes under the same path, rewrite the history; the
    record keeps each image's reference as first sent, in token order."""
    first, second, other = (png_bytes(seed) for seed in (1, 2, 3))
    (tmp_path / "a.png").write_bytes(first)
    (tmp_path / "b.png").write_bytes(second)
    as_data = "data:image/png;base64," + base64.b64encode(first).decode()
    as_bmp = data_uri(Image.open(io.BytesIO(first)), "BMP")  # other bytes, the same pixels
    assert base64.b64decode(as_bmp.split(",", 1)[1]) != first
    tmp_path = Path(os.path.realpath(tmp_path))  # as the server resolves its image root
    server, worker = vlm_server(image_root=tmp_path)
    client = openai.OpenAI(base_url=server.base_url("v/0"), api_key="unused", max_retries=0)
    try:
        messages = [{"role": "user", "content": [{"type": "text", "text": "see"}, image_url(str(tmp_path / "a.png"))]}]
        reply = client.chat.completions.create(model="rlx", messages=messages).choices[0].message
        messages += [
            reply.model_dump(exclude_none=True),
            {"role": "user", "content": [image_url(f"file://{tmp_path}/b.png")]},
        ]
        messages[0]["content"][1] = {"type": "image", "image": as_bmp}  # the same pixels, encoded otherwise
        reply = client.chat.completions.create(model="rlx", messages=messages).choices[0].message
        session = server.sessions["v/0"]
        [segment] = session.segments
        assert segment.image_refs == [str(tmp_path / "a.png"), str(tmp_path / "b.png")]  # a file:// URL: its path
        vision = segment.images.vision()
        token = server.images.cache.processor.image_token_id
        ids = segment.trajectory.token_ids()
        assert [ids[o : o + 4] for o in vision.image_offsets] == [[token] * 4] * 2  # 16 x 16: 4 merged patches
        assert all(segment.trajectory.loss_mask[o - len(segment.trajectory.prompt_ids)] == 0
                   for o in vision.image_offsets[1:])  # fmt: skip
        tool = {"role": "tool", "content": [{"type": "text", "text": "more"}, image_url(as_data)]}
        messages += [reply.model_dump(exclude_none=True), tool]
        messages[2]["content"] = [image_url(str(tmp_path / "b.png"))]
        client.chat.completions.create(model="rlx", messages=messages)  # a path, where it was a file:// URL
        assert len(session.segments) == 1 and segment.trajectory.num_turns == 3
        assert segment.image_refs == [str(tmp_path / "a.png"), str(tmp_path / "b.png"), as_data]
        assert len(segment.images.vision().image_offsets) == 3
        (tmp_path / "b.png").write_bytes(other)  # other bytes under the same path: another image
        client.chat.completions.create(model="rlx", messages=messages)
        messages[2]["content"] = [image_url(as_data)]  # another picture
        client.chat.completions.create(model="rlx", messages=messages)
        assert [s.reason for s in session.segments] == ["first request", "history rewritten", "history rewritten"]
        assert session.segments[1].image_refs == [as_bmp, str(tmp_path / "b.png"), as_data]  # as this request sent
        assert session.segments[2].image_refs == [as_bmp, as_data, as_data]
        assert segment.to_json()["image_refs"] == segment.image_refs  # an earlier segment in the agent's record
    finally:
        server.close()
        worker.close()


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_bad_images_get_http_400_and_the_server_keeps_serving(tmp_path):
    tmp_path = Path(os.path.realpath(tmp_path))
    server, worker = vlm_server(image_root=tmp_path)
    url = f"{server.base_url('b/0')}/chat/completions"

    def ask(*parts, role="user"):
        status, reply = post(url, {"model": "rlx", "messages": [{"role": role, "content": [*parts]}]})
        return status, reply.get("error", {}).get("message", "")

    (tmp_path / "text.png").write_text("not a picture")
    try:
        for part, problem in [
            (image_url("https://example.com/a.png"), "image URL 'https://example.com/a.png' is refused"),
            ({"type": "image", "image": "http://example.com/a.png"}, "fetches nothing from the network"),
            (image_url(str(tmp_path / "gone.png")), f"image '{tmp_path / 'gone.png'}' does not exist under"),
            (image_url("/etc/hostname"), "image '/etc/hostname' is outside --image-root"),
            (image_url("data:image/png;base64,@@@"), "has bad base64 data"),
            (image_url(str(tmp_path / "text.png")), "is not an image format Pillow reads"),
            (image_url(data_uri(Image.new("RGB", (1000, 3)))), "cannot be processed (absolute aspect ratio"),
            ({"type": "image_url", "image_url": {}}, "an image part must be"),
            ({"type": "file", "file": {}}, "content parts of type 'file' are not supported"),
        ]:
            status, message = ask({"type": "text", "text": "x"}, part)
            assert status == 400 and problem in message, (part, message)
        status, message = ask(image_url(data_uri(Image.new("RGB", (8, 8)))), role="assistant")
        assert status == 400 and "message 0 (assistant) has image parts: images go in user, tool or system" in message
        assert not server.sessions["b/0"].segments  # nothing recorded
        status, _ = ask({"type": "text", "text": "x"}, image_url(data_uri(Image.new("RGB", (8, 8)))))
        assert status == 200 and server.sessions["b/0"].segments[0].image_refs
    finally:
        server.close()
        worker.close()


def test_engines_and_models_without_images_refuse_them(files):
    class NoImages(engine_class("hf")):
        name, takes_images = "text-engine", False

    server, worker = vlm_server(engine_type=NoImages)
    try:
        picture = image_url(data_uri(Image.new("RGB", (8, 8))))
        status, reply = post(f"{server.base_url('e/0')}/chat/completions",
                             {"messages": [{"role": "user", "content": [picture]}]})  # fmt: skip
        assert status == 400 and "which engine 'text-engine' does not take (use engine 'hf' or 'native')" in str(reply)
    finally:
        server.close()
        worker.close()
    prompts = image_prompts(1)
    for name in ("hf", "native", "vllm"):  # agents take images on these (vllm on CUDA: refused on CPU as it starts)
        refuse_images(prompts, RolloutConfig(agent=AgentConfig(agent="a.py:run")), engine_class(name))


def test_an_unusable_image_from_the_environment_is_an_environment_error(files, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, processor = build_tiny_vision_model("qwen2_vl")
    engine, cfg = vlm_engine(model, processor, "hf", env=f"{files}/files.py:Broken", on_env_error="zero")
    runner = EnvRollout(engine, processor.tokenizer, cfg.sampling, cfg.agent)
    result = runner.generate(image_prompts())
    failed = [r for r in result.records if "env_error" in r.extra]
    assert result.stats.episodes.env_errors == len(failed) >= 4
    assert {(r.finish_reason, r.env_reward, r.num_turns) for r in failed} == {("env_done", 0.0, 1)}
    errors = {r.extra["env_error"].split(": ", 2)[-1] for r in failed}
    assert any(f"image '{tmp_path / 'gone.png'}' does not exist" in e for e in errors)
    assert any("is not an image format Pillow reads" in e for e in errors)
    assert all(e.startswith("environment ") and "step() returned an image that cannot be used" in e
               for e in (r.extra["env_error"] for r in failed))  # fmt: skip
    engine, cfg = vlm_engine(model, processor, "hf", env=f"{files}/files.py:Broken")
    with pytest.raises(UserError, match=r"cannot be used: .* \(--on-env-error zero scores such episodes 0 instead\)"):
        EnvRollout(engine, processor.tokenizer, cfg.sampling, cfg.agent).generate(image_prompts(1))


@pytest.fixture(scope="module")
def vlm_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("agent_vlm")
    write_tiny_vision_model_dir(root / "model", "qwen2_vl")
    cli_ok("shard", "--model", root / "model", "--init", "random", "--seed", "0", "--out", root / "ckpt0")
    records = [{"id": p.id, "prompt": p.prompt, "ground_truth": p.ground_truth} for p in image_prompts()]
    return root / "ckpt0", write_jsonl(root / "prompts.jsonl", records)


def test_rollout_agent_with_images_then_score(files, vlm_checkpoint, tmp_path):
    """`rlx rollout --agent` on image prompts: the records keep the images (data: URIs as references, in token
    order) and `rlx score` rebuilds them: its old logprobs are the sampler's."""
    ckpt, prompts = vlm_checkpoint
    stops = [arg for stop in STOPS for arg in ("--stop", stop)]
    cli_ok("rollout", "--model", ckpt, "--prompts", prompts, "--agent", f"{files}/files.py:look_twice", "--n", "2",
           "--max-new-tokens", "6", "--max-total-tokens", "500", "--seed", "1", *stops,
           "--out", tmp_path / "r.jsonl")  # fmt: skip
    records = read_jsonl(tmp_path / "r.jsonl")
    assert sum(len(r.get("image_refs", [])) == 2 for r in records) >= 3
    assert all(ref.startswith("data:image/png;base64,") for r in records for ref in r.get("image_refs", []))
    cli_ok("score", "--rollouts", tmp_path / "r.jsonl", "--actor", ckpt, "--ref", ckpt, "--reward", "env",
           "--out", tmp_path / "s")  # fmt: skip
    with safe_open(str(tmp_path / "s" / "batch.safetensors"), "pt") as f:
        mask, old, rollout = (f.get_tensor(k) for k in ("loss_mask", "old_logprobs", "rollout_logprobs"))
        assert "vision/image_offsets" in set(f.keys())
    assert mask.sum() > 0
    torch.testing.assert_close(old * mask, rollout * mask, atol=1e-5, rtol=0)


def test_rlx_serve_takes_images(vlm_checkpoint, tmp_path):
    """The `rlx serve` stage on a vision-language checkpoint: its processor is loaded, a client's image_url part
    becomes image tokens and the written record names the image."""
    ckpt, _ = vlm_checkpoint
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    (tmp_path / "a.png").write_bytes(png_bytes(4))
    replies = []

    def client():
        """Asks once the server listens; without a 200 answer within 120 s, stops the server (SIGTERM)."""
        body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, image_url("a.png")]}]}
        deadline = time.monotonic() + 120
        while not replies and time.monotonic() < deadline:
            try:
                replies.append(post(f"http://127.0.0.1:{port}/s/p%2F0/v1/chat/completions", body))
            except OSError:  # not listening yet (URLError, a reset connection)
                time.sleep(0.1)
        if not replies or replies[0][0] != 200:  # the server would wait for a request forever
            os.kill(os.getpid(), signal.SIGTERM)

    tmp_path = Path(os.path.realpath(tmp_path))  # a relative path is taken from --image-root
    thread = threading.Thread(target=client)
    thread.start()
    try:
        cfg = ServeConfig(
            precision="float32",
            endpoint=EndpointConfig(image_root=str(tmp_path)),
            sampling=SamplingParams(max_new_tokens=3),
        )
        records = run_serve(cfg, str(ckpt), port, str(tmp_path / "served.jsonl"), max_requests=1)
    finally:
        thread.join()
    assert replies and replies[0][0] == 200, replies
    [record] = records
    assert record.image_refs == [str(tmp_path / "a.png")] and record.id == "p/0"
    assert read_jsonl(tmp_path / "served.jsonl")[0]["image_refs"] == [str(tmp_path / "a.png")]
