"""Images in multi-turn episodes: opening messages and environment replies with image parts on tiny VLMs.

Token-exact trajectories (each image's placeholders expanded where the template put them, loss_mask 0, references
in token order) whose logprobs equal transformers' forward of the whole sequence with all its images; hf == native
(greedy and seeded, several families); equal tokens with other images never share native cache blocks; a
placeholder the model sampled stays text in every engine and in scoring; score (padded, packed) and train-step
rebuild the images from the records; `rlx ppo` with an environment runs; bad input; rlx.tasks.shapes_look.
"""

from __future__ import annotations

import json
import math
import string

import pytest
import torch
from PIL import Image
from safetensors import safe_open

from rlx.agent.driver import EnvRollout
from rlx.agent.generate import refuse_images
from rlx.checkpoints.loading import load_model, load_processor
from rlx.errors import UserError
from rlx.formats.records import PromptRecord
from rlx.models.loading import resolve_source
from rlx.models.vision.images import data_uri
from rlx.models.vision.inputs import VisionInputs, from_tensors, to_tensors
from rlx.models.vision.positions import find_image_offsets, image_token_mask
from rlx.models.vision.tiny import build_tiny_vision_model, write_tiny_vision_model_dir
from rlx.parallel.dist import DistContext
from rlx.rollout.agent_config import AgentConfig
from rlx.rollout.base import build_engine
from rlx.rollout.config import RolloutConfig, SamplingParams
from rlx.rollout.native.blocks import BlockManager, Sequence
from rlx.rollout.registry import engine_class
from rlx.rollout.requests import TokenRequest
from rlx.tasks.shapes import generate_shapes
from rlx.tasks.shapes_look import LookAgainEnv, is_correct
from tests.agent_helpers import random_chat_model, spans, token_engine
from tests.conftest import cli, cli_ok, flat_config, read_jsonl, torchrun_commands, write_jsonl
from tests.stages.test_vision_stages import assert_same_gradients, assert_same_weights

ENVS = '''
import random
from pathlib import Path

from PIL import Image

from rlx.models.vision.images import data_uri


def picture(seed, height, width):
    rng = random.Random(seed)
    image = Image.new("RGB", (width, height))
    image.putdata([tuple(rng.randrange(256) for _ in range(3)) for _ in range(width * height)])
    return data_uri(image)


class ShowsPictures:
    """Opens with the prompt; turn 1 gets a tool message with a 16 x 24 picture and a user message with two more
    (8 x 8, 16 x 16), turn 2 a tool message with another 16 x 24 one; the episode ends at the third turn."""

    def __init__(self, record):
        self.record, self.turns = record, 0

    def reset(self):
        prompt = self.record["prompt"]
        return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)

    def step(self, message):
        self.turns += 1
        if self.turns == 3:
            return [], 1.0, True
        tool = {"role": "tool", "content": [{"type": "image", "image": picture(self.turns, 16, 24)},
                                            {"type": "text", "text": "seen"}]}
        if self.turns == 2:
            return [tool], 0.25, False
        two = [{"type": "text", "text": "and"}, {"type": "image", "image": picture(7, 8, 8)},
               {"type": "image", "image": picture(8, 16, 16)}]
        return [tool, {"role": "user", "content": two}], 0.25, False


class Big(ShowsPictures):
    def step(self, message):
        return [{"role": "user", "content": [{"type": "image", "image": picture(0, 64, 64)}]}], 0.0, False


class Missing(ShowsPictures):
    def step(self, message):
        return [{"role": "user", "content": [{"type": "image", "image": "gone.png"}]}], 0.0, False


class BadPart(ShowsPictures):
    def step(self, message):
        return [{"role": "user", "content": [{"type": "video", "video": "x.mp4"}]}], 0.0, False
'''
STOPS = (*string.ascii_letters[:30], *"01236", "\n")
"""Stop strings that end a random tiny model's turns after a few tokens (turns that end make episodes go on)."""


@pytest.fixture(scope="module")
def envs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("image_envs")
    (folder / "envs.py").write_text(ENVS)
    return folder


def image_prompts(num: int = 3) -> list[PromptRecord]:
    """Shapes questions with 32 x 32 pictures (16 image tokens), and one text prompt."""
    out = []
    for record, image in generate_shapes(num, seed=1, size=32, grid=2, max_count=2):
        record["prompt"][0]["content"][0]["image"] = data_uri(image)
        out.append(PromptRecord(id=record["id"], prompt=record["prompt"], ground_truth=record["ground_truth"]))
    return [*out, PromptRecord(id="text", prompt="no picture")]


def run_episodes(model, processor, envs, env: str, engine: str, temperature: float, **settings):
    flat = dict(n=2, max_new_tokens=6, temperature=temperature, seed=5, stop=list(STOPS), block_size=4)
    settings = {"max_total_tokens": 500, **settings}
    cfg = flat_config(RolloutConfig, engine=engine, precision="float32", kv_cache_gib=0.01, env=f"{envs}/envs.py:{env}",
                      **flat, **settings)  # fmt: skip
    engine = build_engine(cfg, model, processor.tokenizer, DistContext(device=torch.device("cpu")), processor)
    runner = EnvRollout(engine, processor.tokenizer, cfg.sampling, cfg.agent)
    result = runner.generate(image_prompts())
    return result.records, result.stats.episodes


def whole_sequence_logprobs(model, processor, record) -> torch.Tensor:
    """transformers' own forward of prompt + response with every image of the record (its mRoPE from the image
    tokens' types), the logprobs of the response tokens."""
    token = processor.image_token_id
    ids = torch.tensor([record.prompt_ids + record.response_ids])
    inserted = torch.tensor([1] * len(record.prompt_ids) + [1 - m for m in record.loss_mask])
    vision = processor.vision_inputs([record.image_refs])
    with torch.no_grad():
        logits = model(input_ids=ids, mm_token_type_ids=((ids[0] == token) & inserted.bool()).int()[None],
                       **vision.model_kwargs()).logits  # fmt: skip
    n = len(record.response_ids)
    return torch.log_softmax(logits[0, -n - 1 : -1], -1).gather(-1, ids[0, -n:, None])[:, 0]


def test_episodes_with_images_are_token_exact_and_equal_transformers(envs):
    model, processor = build_tiny_vision_model("qwen2_vl")
    records, stats = run_episodes(model, processor, envs, "ShowsPictures", "hf", 1.0)
    token = processor.image_token_id
    full = [r for r in records if r.num_turns == 3]
    assert len(full) >= 3 and stats.inserted_tokens > 0
    checked = 0
    for record in records:
        refs = record.image_refs or []
        opening = [] if record.prompt_id == "text" else [record.prompt[0]["content"][0]["image"]]
        assert refs[: len(opening)] == opening
        assert len(refs) == {1: 0, 2: 3, 3: 4}[record.num_turns] + len(opening)
        ids = record.prompt_ids + record.response_ids
        inserted = [1] * len(record.prompt_ids) + [1 - m for m in record.loss_mask]
        counts = [16] * len(opening) + [6, 1, 4, 6][: len(refs) - len(opening)]  # 16 x 24: 2 x 3 merged patches
        offsets = find_image_offsets(ids, token, counts, torch.tensor(inserted, dtype=torch.bool))
        assert all(inserted[o] for o in offsets)  # environment tokens: never trained
        if token in [t for t, m in zip(record.response_ids, record.loss_mask) if m]:
            continue  # transformers would take a sampled placeholder for an image
        want = whole_sequence_logprobs(model, processor, record) * torch.tensor(record.loss_mask)
        torch.testing.assert_close(torch.tensor(record.rollout_logprobs), want, atol=1e-5, rtol=0)
        checked += 1
    assert checked >= 6
    text = next(r for r in records if r.prompt_id == "text" and r.num_turns == 3)
    assert text.image_refs[1:] != text.image_refs[:-1]  # four pictures, in the order the replies showed them


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen3_vl", "glm4v"])
def test_hf_and_native_engines_agree_on_episodes_with_images(envs, name):
    model, processor = build_tiny_vision_model(name)
    for temperature in (0.0, 1.0):
        hf, _ = run_episodes(model, processor, envs, "ShowsPictures", "hf", temperature, batch_size=3)
        native, stats = run_episodes(model, processor, envs, "ShowsPictures", "native", temperature, max_num_seqs=4)
        assert sum(r.num_turns for r in hf) > len(hf) + 2, (name, temperature)
        for a, b in zip(hf, native):
            assert (a.response_ids, a.loss_mask, a.image_refs) == (b.response_ids, b.loss_mask, b.image_refs), a.id
            assert all(math.isclose(x, y, abs_tol=2e-5) for x, y in zip(a.rollout_logprobs, b.rollout_logprobs))
        contexts = sum(len(r.prompt_ids) + lo for r in native for lo, _, on in spans(r.loss_mask) if on)
        assert stats.prefill_tokens + stats.cached_prefix_tokens == contexts
        assert stats.cached_prefix_tokens > contexts / 3  # later turns find their earlier turns' blocks


def test_equal_tokens_with_other_images_never_share_blocks():
    blocks = BlockManager(num_blocks=20, block_size=4)
    tokens = list(range(10, 22))  # image tokens 4..7 (the second block)
    first = Sequence(0, list(tokens), 4, image_spans=((4, 8, b"A"),))
    blocks.allocate(first)
    first.num_computed, first_blocks = len(first), list(first.block_table)
    blocks.release(first)
    other = Sequence(1, list(tokens), 4, image_spans=((4, 8, b"B"),))
    blocks.allocate(other)
    assert other.num_computed == 4  # the text block before the image only
    same = Sequence(2, list(tokens), 4, image_spans=((4, 8, b"A"),))
    blocks.allocate(same)
    assert same.num_computed == 8 and same.block_table[:2] == first_blocks[:2]
    text = Sequence(3, list(tokens), 4)  # the same tokens as text (a placeholder the model sampled)
    blocks.allocate(text)
    assert text.num_computed == 4


def test_image_offsets_place_images_and_sampled_placeholders_stay_text():
    """Token requests whose context holds an image in its prompt, a placeholder the model sampled (text) and an
    inserted image: hf == native, two requests with equal tokens but another inserted image differ (no shared
    blocks), and the scoring forward (VisionRow from the offsets) gives the sampled tokens' logprobs."""
    from rlx.logprobs import response_logprobs

    model, processor = build_tiny_vision_model("qwen2_vl")
    token, tok = processor.image_token_id, processor.tokenizer
    start, end = (tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>"))
    text = tok("look ", add_special_tokens=False)["input_ids"]
    pictures = [Image.new("RGB", (16, 16), colour) for colour in ("red", "blue", "green")]
    pixels, grids = processor.process_images(pictures)
    ids = [*text, start, *[token] * 4, end, *text, token, *text, start, *[token] * 4, end, *text]
    offsets = (len(text) + 1, len(ids) - len(text) - 5)
    first, second = (VisionInputs(torch.cat([pixels[:16], pixels[k * 16 : k * 16 + 16]]), grids[[0, k]], (2,),
                                  offsets) for k in (1, 2))  # fmt: skip
    requests = [TokenRequest(key, ids, 5, vision=v) for key, v in (("r0", first), ("r1", second), ("r0", first))]
    sampling = SamplingParams(max_new_tokens=5, temperature=1.0, seed=3)
    out = {}
    for engine in ("hf", "native"):
        settings = {"block_size": 4, "kv_cache_gib": 0.01} if engine == "native" else {}
        out[engine] = token_engine(model, tok, engine, precision="float32", **settings).generate_tokens(
            requests, sampling
        )
    for a, b in zip(out["hf"], out["native"]):
        assert a.response_ids == b.response_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=2e-5, rtol=0)
    assert out["native"][0].logprobs != out["native"][1].logprobs  # other image, other logprobs: no shared blocks
    assert out["native"][0].response_ids == out["native"][2].response_ids
    # the scoring forward: the context as the prompt, the generated tokens as the response
    gen = out["hf"][0]
    prompt, response = torch.tensor([ids]), torch.tensor([gen.response_ids])
    logprobs, _ = response_logprobs(
        model,
        prompt,
        torch.ones_like(prompt, dtype=torch.bool),
        response,
        torch.ones_like(response, dtype=torch.bool),
        1.0,
        torch.float32,
        vision=first,
    )
    torch.testing.assert_close(logprobs[0], torch.tensor(gen.logprobs), atol=1e-5, rtol=0)


def test_vision_inputs_carry_image_offsets_through_batches(tmp_path):
    grids = torch.tensor([[1, 4, 4], [1, 2, 4], [1, 4, 4]])
    vision = VisionInputs(torch.randn(16 + 8 + 16, 6), grids, (1, 2), (3, 5, 20))
    assert vision.select([1]).image_offsets == (5, 20) and vision.select([0]).image_offsets == (3,)
    assert VisionInputs.concat([vision.select([1]), VisionInputs.empty(1)]).image_offsets == (5, 20)
    with pytest.raises(ValueError, match="with and without image offsets"):
        VisionInputs.concat([vision, VisionInputs(vision.pixel_values[:16], grids[:1], (1,))])
    tensors, header = to_tensors(vision, [["a"], ["b", "c"]], store_pixels=True)
    assert header["vision_format_version"] == "2"
    back, refs = from_tensors(tensors, header)
    assert back.image_offsets == (3, 5, 20) and refs == [["a"], ["b", "c"]]
    del tensors["vision/image_offsets"]
    with pytest.raises(UserError, match="needs vision/image_offsets"):
        from_tensors(tensors, header, source="b.safetensors")
    ids = [0, 9, 9, 9, 9, 0, 9]
    assert image_token_mask(ids, 9, torch.tensor([[1, 4, 4]]), 2, [1]).tolist() == [0, 1, 1, 1, 1, 0, 0]
    with pytest.raises(ValueError, match="needs 4 placeholders from token 3"):
        image_token_mask(ids, 9, torch.tensor([[1, 4, 4]]), 2, [3])


@pytest.fixture(scope="module")
def vlm_episodes(envs, tmp_path_factory):
    """A tiny Qwen2-VL checkpoint, shapes prompts and a multi-turn rollout with pictures in the replies."""
    root = tmp_path_factory.mktemp("vlm_episodes")
    write_tiny_vision_model_dir(root / "model", "qwen2_vl")
    cli_ok("shard", "--model", root / "model", "--init", "random", "--seed", "0", "--out", root / "ckpt0")
    records = [{"id": p.id, "prompt": p.prompt, "ground_truth": p.ground_truth} for p in image_prompts()]
    prompts = write_jsonl(root / "prompts.jsonl", records)
    write_jsonl(root / "shapes.jsonl", records[:-1])  # LookAgainEnv's: questions about a picture
    stops = [arg for stop in STOPS for arg in ("--stop", stop)]
    cli_ok("rollout", "--model", root / "ckpt0", "--prompts", prompts, "--env", f"{envs}/envs.py:ShowsPictures",
           "--n", "2", "--max-new-tokens", "6", "--max-total-tokens", "500", "--seed", "1", *stops,
           "--out", root / "r.jsonl")  # fmt: skip
    return {"root": root, "ckpt": root / "ckpt0", "prompts": prompts, "rollouts": root / "r.jsonl", "stops": stops}


def test_score_and_train_step_rebuild_the_episodes_images(vlm_episodes, tmp_path):
    records = read_jsonl(vlm_episodes["rollouts"])
    assert sum(len(r.get("image_refs", [])) > 1 for r in records) >= 3
    assert "pixel" not in vlm_episodes["rollouts"].read_text()
    score = ["score", "--rollouts", vlm_episodes["rollouts"], "--actor", vlm_episodes["ckpt"], "--ref",
             vlm_episodes["ckpt"], "--reward", "env"]  # fmt: skip
    cli_ok(*score, "--out", tmp_path / "s")
    cli_ok(*score, "--out", tmp_path / "packed", "--use-packing", "--max-tokens-per-micro-batch", "300")
    for name in ("s", "packed"):
        with safe_open(str(tmp_path / name / "batch.safetensors"), "pt") as f:
            header = f.metadata()
            mask = f.get_tensor("loss_mask")
            old, rollout = f.get_tensor("old_logprobs"), f.get_tensor("rollout_logprobs")
            assert header["vision_format_version"] == "2" and "vision/image_offsets" in set(f.keys())
        torch.testing.assert_close(old * mask, rollout * mask, atol=1e-5, rtol=0)  # the sampler's, with all images
    step = ["train-step", "--checkpoint", vlm_episodes["ckpt"], "--batch", tmp_path / "s" / "batch.safetensors",
            "--lr", "1e-2", "--micro-batch-size", "3"]  # fmt: skip
    cli_ok(*step, "--out", tmp_path / "padded")
    cli_ok(*step, "--out", tmp_path / "packed_step", "--use-packing")
    assert_same_gradients(tmp_path / "padded", tmp_path / "packed_step")


@pytest.mark.slow  # both steps in one launch of 2 processes: ~25 s on 2 shared CPU cores
def test_fsdp_and_sequence_parallel_train_steps_on_episodes_equal_one_process(vlm_episodes, tmp_path):
    """Episodes with pictures in the replies (images inside response_ids, environment tokens masked) train the same
    under FSDP and Ulysses SP 2 (the images' tokens split across the ranks) as in one process."""
    cli_ok("score", "--rollouts", vlm_episodes["rollouts"], "--actor", vlm_episodes["ckpt"], "--reward", "env",
           "--out", tmp_path / "s")  # fmt: skip
    step = ["train-step", "--checkpoint", vlm_episodes["ckpt"], "--batch", tmp_path / "s" / "batch.safetensors",
            "--lr", "1e-2", "--use-packing", "--no-freeze-vision-tower"]  # fmt: skip
    cli_ok(*step, "--out", tmp_path / "one")
    torchrun_commands(2, [*step, "--out", tmp_path / "fsdp"], [*step, "--out", tmp_path / "sp", "--sp-degree", "2"])
    assert_same_weights(tmp_path / "one", tmp_path / "fsdp", atol=1e-4)  # Adam: see assert_same_gradients
    assert_same_weights(tmp_path / "one", tmp_path / "sp", atol=1e-4)


def test_critic_values_of_episodes_with_images(vlm_episodes, tmp_path):
    """A vision-language critic scores episodes whose replies hold images: packed == padded == its own forward of
    the whole sequence with every image."""
    critic = tmp_path / "critic"
    cli_ok("shard", "--model", vlm_episodes["ckpt"], "--role", "critic", "--seed", "1", "--out", critic)
    score = ["score", "--rollouts", vlm_episodes["rollouts"], "--actor", vlm_episodes["ckpt"], "--critic", critic,
             "--estimator", "gae", "--reward", "env"]  # fmt: skip
    cli_ok(*score, "--out", tmp_path / "s")
    cli_ok(*score, "--out", tmp_path / "packed", "--use-packing", "--max-tokens-per-micro-batch", "300")
    values = {}
    for name in ("s", "packed"):
        with safe_open(str(tmp_path / name / "batch.safetensors"), "pt") as f:
            values[name] = f.get_tensor("values")
    torch.testing.assert_close(values["packed"], values["s"], atol=1e-5, rtol=0)
    model = load_model(resolve_source(critic), "critic").eval()
    processor = load_processor(resolve_source(critic))
    token = processor.image_token_id
    checked = 0
    for row, record in enumerate(read_jsonl(vlm_episodes["rollouts"])):
        if len(record.get("image_refs", [])) < 2:
            continue  # the episodes with images in their replies
        if token in [t for t, m in zip(record["response_ids"], record["loss_mask"]) if m]:
            continue  # transformers would take a sampled placeholder for an image
        ids = torch.tensor([record["prompt_ids"] + record["response_ids"]])
        inserted = torch.tensor([1] * len(record["prompt_ids"]) + [1 - m for m in record["loss_mask"]])
        vision = processor.vision_inputs([record["image_refs"]])
        with torch.no_grad():
            logits = model(input_ids=ids, mm_token_type_ids=((ids[0] == token) & inserted.bool()).int()[None],
                           **vision.model_kwargs()).logits  # fmt: skip
        n = len(record["response_ids"])
        want = logits[0, -n - 1 : -1, 0]
        torch.testing.assert_close(values["s"][row, :n], want, atol=1e-5, rtol=0)
        checked += 1
    assert checked >= 3


def test_ppo_runs_episodes_with_images(vlm_episodes, tmp_path):
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(f"""
seed = 0
steps = 1
[model]
path = "{vlm_episodes["ckpt"]}"
[data]
prompts = "{vlm_episodes["root"] / "shapes.jsonl"}"
prompts_per_step = 2
[rollout.sampling]
n = 2
max_new_tokens = 6
stop = {json.dumps(list(STOPS))}
[rollout.agent]
env = "rlx.tasks.shapes_look:LookAgainEnv"
max_total_tokens = 500
[score]
reward = "env"
[train]
mini_batch_size = 4
micro_batch_size = 4
[train.optim]
lr = 1e-3
""")
    cli_ok("ppo", recipe, "--out", tmp_path / "run")
    records = read_jsonl(tmp_path / "run" / "step_000001" / "rollouts.jsonl")
    assert any(len(r["image_refs"]) > 1 for r in records)  # wrong answers brought the picture back
    assert (tmp_path / "run" / "checkpoints" / "step_000001" / "model.safetensors").exists()


def test_bad_images_in_episodes(envs, vlm_episodes, tmp_path, monkeypatch):
    model, processor = build_tiny_vision_model("qwen2_vl")
    # too many image tokens for the episode: it ends with 'length' (an opening prompt over the limit is an error)
    records, _ = run_episodes(model, processor, envs, "Big", "hf", 1.0, max_total_tokens=150)
    shapes = [r for r in records if r.prompt_id != "text"]  # ~90 opening tokens: 64 more do not fit
    assert {(r.finish_reason, r.num_turns, len(r.image_refs)) for r in shapes} == {("length", 1, 1)}
    assert any(len(r.image_refs or []) == 1 and r.num_turns == 2 for r in records if r.prompt_id == "text")
    with pytest.raises(UserError, match=r"the opening prompt has \d+ tokens, not below max_total_tokens = 60"):
        run_episodes(model, processor, envs, "ShowsPictures", "hf", 1.0, max_total_tokens=60)
    monkeypatch.chdir(tmp_path)
    # episodes step concurrently: whichever sample's reply comes first is named
    missing = f"prompt '(shapes-[0-2]|text)/[01]': image '{tmp_path / 'gone.png'}' does not exist"
    with pytest.raises(UserError, match=missing):
        run_episodes(model, processor, envs, "Missing", "hf", 1.0)
    records, _ = run_episodes(model, processor, envs, "BadPart", "hf", 1.0, on_env_error="zero")
    assert "expected a string or a list of parts" in next(r for r in records if r.num_turns).extra["env_error"]
    # a text-only model: the sample and the message are named
    chat_model, tokenizer = random_chat_model(stop_bias=3.0)
    runner = EnvRollout(token_engine(chat_model, tokenizer), tokenizer,
                        SamplingParams(n=1, max_new_tokens=4, temperature=1.0),
                        AgentConfig(env=f"{envs}/envs.py:ShowsPictures", max_total_tokens=300))  # fmt: skip
    with pytest.raises(UserError, match=r"sample 'q/0': the environment's step\(\) message 0 \(tool\) has image parts, "
                                        "but model type 'llama' is a text-only model"):  # fmt: skip
        runner.generate([PromptRecord(id="q", prompt="hi")])
    # engines without images refuse prompts with images up front (agents: tests/stages/test_agent_images.py)
    prompts = image_prompts(1)

    class NoImages(engine_class("hf")):
        name, takes_images = "text-engine", False

    with pytest.raises(UserError, match="which engine 'text-engine' does not take in multi-turn rollouts"):
        refuse_images(prompts, RolloutConfig(agent=AgentConfig(env="e.py:Env")), NoImages)
    result = cli("rollout", "--model", vlm_episodes["ckpt"], "--prompts", vlm_episodes["prompts"], "--out",
                 tmp_path / "r.jsonl", "--env", f"{envs}/envs.py:ShowsPictures", "--engine", "vllm")  # fmt: skip
    assert result.exit_code == 1 and "'vllm' runs vision-language models (qwen2_vl) on CUDA only" in result.stderr


def test_look_again_env():
    record, image = generate_shapes(1, seed=2, size=32, grid=2, max_count=2, kinds=("count",))[0]
    record["prompt"][0]["content"][0]["image"] = data_uri(image)
    env = LookAgainEnv(record)
    assert env.reset() == record["prompt"] and env.tools[0]["function"]["name"] == "look"
    call = {"id": "c0", "type": "function", "function": {"name": "look", "arguments": "{}"}}
    replies, reward, done = env.step({"role": "assistant", "content": "", "tool_calls": [call]})
    assert (reward, done) == (0.0, False) and replies[0]["role"] == "tool" and replies[0]["tool_call_id"] == "c0"
    from rlx.models.vision.images import load_image

    enlarged = load_image(replies[0]["content"][0]["image"])
    assert (
        enlarged.size == (64, 64) and enlarged.resize((32, 32), Image.Resampling.NEAREST).tobytes() == image.tobytes()
    )
    wrong = str(int(record["ground_truth"]) + 1)
    replies, reward, done = env.step({"role": "assistant", "content": wrong})
    assert (reward, done) == (0.0, False) and replies[0]["content"][1]["type"] == "image"
    assert env.step({"role": "assistant", "content": f"It is {record['ground_truth']}"})[1:] == (1.0, True)
    assert is_correct("more blue", "blue", ["red", "blue"]) and not is_correct("blue, no: red", "blue", ["red", "blue"])
