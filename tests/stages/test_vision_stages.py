"""Vision-language models through every stage, driven through the commands: image references through
prompts.jsonl, rollouts.jsonl and batch.safetensors; rollout (hf and native engines: equal tokens and logprobs,
equal to transformers' own forward), score (old logprobs == the sampler's), train-step (packed == padded, a
frozen tower does not move, FSDP and sequence parallelism == one process), shard / merge with the processor
files, `rlx ppo` == the shell pipeline, the tiny recipe learns, and every bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from rlx.errors import UserError
from rlx.formats.records import PromptRecord
from rlx.models.loading import read_weights, resolve_source
from rlx.models.vision.families import FAMILIES
from rlx.models.vision.images import data_uri
from rlx.models.vision.tiny import build_tiny_vision_model, write_tiny_vision_model_dir
from rlx.parallel.dist import DistContext
from rlx.rollout.base import build_engine
from rlx.rollout.config import NativeConfig, RolloutConfig, SamplingParams
from rlx.tasks.shapes import generate_shapes, write_shapes
from tests.conftest import REPO, cli, cli_env, cli_ok, read_jsonl, torchrun_commands, write_jsonl, write_length_reward
from tests.unit.test_vision import chat, image_part, random_image

FAMILY_NAMES = [f.name for f in FAMILIES.values()]
RECIPE = REPO / "recipes" / "tiny_vlm_shapes.toml"


def tower_keys(weights: dict) -> list[str]:
    return [k for k in weights if k.startswith("model.visual.")]


def assert_same_gradients(a: Path, b: Path) -> None:
    """The first Adam moments of two one-step checkpoints (0.1 x the gradients) agree to fp32 noise (1e-8 against
    gradients of ~1e-2), and so do the weights up to Adam's sign-like first step on near-zero gradients."""
    ma, mb = (load_file(str(p / "optimizer.safetensors")) for p in (a, b))
    assert ma.keys() == mb.keys()
    for key in (k for k in ma if k.endswith("::exp_avg")):
        torch.testing.assert_close(ma[key], mb[key], atol=1e-8, rtol=0, msg=key)
    assert_same_weights(a, b, atol=1e-4)


def assert_same_weights(a: Path, b: Path, atol: float = 0.0) -> None:
    wa, wb = read_weights(a), read_weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], atol=atol, rtol=0, msg=key)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> dict:
    """A tiny Qwen2-VL (random init, step-0 checkpoint), prompts with image files next to them (one image, two
    images, none), a dense reward, and a rollout of them."""
    root = tmp_path_factory.mktemp("vlm")
    model = write_tiny_vision_model_dir(root / "model", "qwen2_vl")
    cli_ok("shard", "--model", model, "--init", "random", "--seed", "0", "--out", root / "ckpt0")
    prompts = root / "data" / "prompts.jsonl"
    pairs = generate_shapes(6, seed=1, size=32, kinds=("count",), max_count=3)
    write_shapes(prompts, pairs, embed=False)
    records = read_jsonl(prompts)
    random_image(24, 40, 7).save(root / "data" / "wide.png")
    first = records[0]["prompt"][0]["content"][0]["image"]
    two = chat("compare", {"type": "image", "image": "wide.png"}, {"type": "image", "image": first})
    records += [{"id": "two", "prompt": two}, {"id": "text", "prompt": "no image here"}]
    write_jsonl(prompts, records)
    reward = write_length_reward(root)
    cli_ok("rollout", "--model", root / "ckpt0", "--prompts", prompts, "--out", root / "r.jsonl", "--n", "2",
           "--max-new-tokens", "5", "--seed", "1")  # fmt: skip
    return {"root": root, "model": model, "ckpt": root / "ckpt0", "prompts": prompts, "reward": f"{reward}:score",
            "rollouts": root / "r.jsonl"}  # fmt: skip


def test_rollouts_keep_image_references_and_transformers_logprobs(vlm):
    records = read_jsonl(vlm["rollouts"])
    assert len(records) == 16
    text = vlm["rollouts"].read_text()
    assert "data:" not in text and "pixel" not in text  # references, not pixels
    first = records[0]["prompt"][0]["content"][0]["image"]
    assert first == str(vlm["prompts"].parent / "prompts_images" / "shapes-0.png")  # resolved against the file
    two = next(r for r in records if r["prompt_id"] == "two")
    assert [p["image"] for p in two["prompt"][0]["content"] if p["type"] == "image"] == [
        str(vlm["prompts"].parent / "wide.png"),
        first,
    ]
    from rlx.checkpoints.loading import load_model, load_processor

    source = resolve_source(vlm["ckpt"])
    model, processor = load_model(source).eval(), load_processor(source)
    token = processor.image_token_id
    assert two["prompt_ids"].count(token) == 6 * 10 // 4 + 16  # 24 x 40 pixels: 6 x 10 patches merged 2 x 2
    checked = 0
    for record in records:  # the sampler's logprobs == transformers' own forward (its own mRoPE positions)
        if token in record["response_ids"]:
            continue  # transformers would take a sampled placeholder for an image
        encoded = processor.encode(record["prompt"], prompt_id=record["prompt_id"])
        assert encoded.input_ids == record["prompt_ids"]
        ids = torch.tensor([record["prompt_ids"] + record["response_ids"]])
        with torch.no_grad():
            logits = model(
                input_ids=ids, mm_token_type_ids=(ids == token).int(), **encoded.vision.model_kwargs()
            ).logits
        n = len(record["response_ids"])
        want = torch.log_softmax(logits[0, -n - 1 : -1], -1).gather(-1, ids[0, -n:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(record["rollout_logprobs"]), want, atol=1e-5, rtol=0)
        checked += 1
    assert checked >= 8


def engine_prompts() -> list[PromptRecord]:
    """No image, one, two, and two prompts whose tokens are equal but whose images differ."""
    same_text = [chat(image_part(16, 16, seed), "same words") for seed in (11, 12)]
    prompts = [
        "plain text",
        chat(image_part(16, 24, 2), "one"),
        chat("two", image_part(24, 32, 3), image_part(16, 16, 4)),
        *same_text,
    ]
    return [PromptRecord(id=f"p{i}", prompt=p) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_hf_and_native_engines_agree(name):
    model, processor = build_tiny_vision_model(name)
    prompts = engine_prompts()
    for temperature in (0.0, 1.0):
        results = {}
        for engine in ("hf", "native"):
            cfg = RolloutConfig(
                engine=engine,
                precision="float32",
                batch_size=3,
                kv_cache_gib=0.01,
                sampling=SamplingParams(n=2, max_new_tokens=6, temperature=temperature, seed=5),
                native=NativeConfig(block_size=4),
            )
            built = build_engine(cfg, model, processor.tokenizer, DistContext(device=torch.device("cpu")), processor)
            results[engine] = built.generate(prompts, cfg.sampling, progress=False).records
        for hf, native in zip(results["hf"], results["native"]):
            assert hf.response_ids == native.response_ids, (name, temperature, hf.id)
            torch.testing.assert_close(
                torch.tensor(native.rollout_logprobs), torch.tensor(hf.rollout_logprobs), atol=2e-5, rtol=0
            )
        if temperature:  # equal words, other image: other responses
            assert results["hf"][6].response_ids != results["hf"][8].response_ids


def test_score_and_train_step_with_images(vlm, tmp_path):
    score = ["score", "--rollouts", vlm["rollouts"], "--actor", vlm["ckpt"], "--ref", vlm["ckpt"],
             "--reward", vlm["reward"]]  # fmt: skip
    cli_ok(*score, "--out", tmp_path / "s")
    cli_ok(*score, "--out", tmp_path / "sp", "--store-pixels")
    batch = tmp_path / "s" / "batch.safetensors"
    with safe_open(str(batch), "pt") as f:
        names, header = set(f.keys()), f.metadata()
        old, rollout = f.get_tensor("old_logprobs"), f.get_tensor("rollout_logprobs")
    assert {"vision/image_grid_thw", "vision/images_per_sample"} <= names and "vision/pixel_values" not in names
    refs = json.loads(header["vision_image_refs"])
    assert len(refs) == 16 and refs[-1] == [] and len(refs[-3]) == 2
    torch.testing.assert_close(old, rollout, atol=1e-5, rtol=0)  # the padded forward with images == the sampler
    with safe_open(str(tmp_path / "sp" / "batch.safetensors"), "pt") as f:
        assert "vision/pixel_values" in set(f.keys())
    # packed rows with their images (a small budget: several rows, samples with 0, 1 and 2 images together)
    cli_ok(*score, "--out", tmp_path / "packed_score", "--use-packing", "--max-tokens-per-micro-batch", "300")
    with safe_open(str(tmp_path / "packed_score" / "batch.safetensors"), "pt") as f:
        torch.testing.assert_close(f.get_tensor("old_logprobs"), old, atol=1e-5, rtol=0)
        torch.testing.assert_close(f.get_tensor("ref_logprobs"), old, atol=1e-5, rtol=0)
    step = ["train-step", "--checkpoint", vlm["ckpt"], "--lr", "1e-2", "--micro-batch-size", "5"]
    cli_ok(*step, "--batch", batch, "--out", tmp_path / "padded")
    cli_ok(*step, "--batch", batch, "--out", tmp_path / "packed", "--use-packing")
    cli_ok(*step, "--batch", tmp_path / "sp" / "batch.safetensors", "--out", tmp_path / "pixels")
    cli_ok(*step, "--batch", batch, "--out", tmp_path / "tower", "--no-freeze-vision-tower")
    assert_same_gradients(tmp_path / "padded", tmp_path / "packed")
    assert_same_weights(tmp_path / "padded", tmp_path / "pixels")
    before, frozen, trained = (read_weights(p) for p in (vlm["ckpt"], tmp_path / "padded", tmp_path / "tower"))
    assert tower_keys(before) and all(torch.equal(before[k], frozen[k]) for k in tower_keys(before))
    assert any(not torch.equal(before[k], frozen[k]) for k in before if k not in tower_keys(before))
    assert all(not torch.equal(before[k], trained[k]) for k in tower_keys(before) if "weight" in k)
    with safe_open(str(tmp_path / "padded" / "optimizer.safetensors"), "pt") as f:
        assert not any(".visual." in k for k in f.keys())  # noqa: SIM118 - safe_open is not a mapping


def test_shard_merge_carries_the_processor_files(tmp_path):
    model, processor = build_tiny_vision_model("glm4v", seed=3)
    model.save_pretrained(tmp_path / "hf")
    processor.save_pretrained(tmp_path / "hf")
    for layout in ("single", "fsdp"):
        cli_ok("shard", "--model", tmp_path / "hf", "--layout", layout, "--out", tmp_path / layout)
        cli_ok("merge", "--checkpoint", tmp_path / layout, "--out", tmp_path / f"merged-{layout}")
        merged = tmp_path / f"merged-{layout}"
        assert_same_weights(tmp_path / "hf", merged)
        for name in ("preprocessor_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            assert (merged / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), name
    from transformers import AutoModelForImageTextToText

    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged-fsdp")
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))


@pytest.mark.slow  # 4 fresh processes of the shell pipeline: ~45 s on 2 shared CPU cores
def test_ppo_equals_the_shell_pipeline(tmp_path):
    """recipes/tiny_vlm_shapes.sh, stage by stage, gives the rollouts, scores and weights of `rlx ppo` on its recipe
    (one step: the seeds and data positions of later steps are the quickstart's, tests/stages/test_ppo.py)."""
    env = cli_env(STEPS="1", SEED="3")
    script = REPO / "recipes" / "tiny_vlm_shapes.sh"
    subprocess.run(["bash", str(script), str(tmp_path / "sh")], env=env, check=True, capture_output=True)
    cli_ok("ppo", RECIPE, "--out", tmp_path / "ppo", "--set", "steps=1", "--set", "seed=3")
    sh, ppo = tmp_path / "sh", tmp_path / "ppo"
    assert_same_weights(sh / "checkpoints" / "step_000001", ppo / "checkpoints" / "step_000001")
    assert (sh / "step_000001" / "rollouts.jsonl").read_bytes() == (ppo / "step_000001" / "rollouts.jsonl").read_bytes()
    assert (sh / "step_000001" / "scores.jsonl").read_bytes() == (ppo / "step_000001" / "scores.jsonl").read_bytes()
    assert "data:image/png;base64," in (ppo / "step_000001" / "rollouts.jsonl").read_text()  # the recipe's images


def error_of(*args) -> str:
    result = cli(*args)
    assert result.exit_code == 1, result
    assert "Traceback" not in result.stderr
    return result.stderr.strip()


def test_bad_images_and_image_settings(vlm, tmp_path, tiny_ckpt):
    rollout = ["rollout", "--model", vlm["ckpt"], "--n", "1", "--max-new-tokens", "2"]
    gone = chat({"type": "image", "image": "gone.png"}, "x")
    missing = write_jsonl(tmp_path / "missing.jsonl", [{"id": "q1", "prompt": gone}])
    message = error_of(*rollout, "--prompts", missing, "--out", tmp_path / "r.jsonl")
    assert f"prompt 'q1': image '{tmp_path / 'gone.png'}' does not exist" in message
    assert not (tmp_path / "r.jsonl").exists()
    (tmp_path / "bad.png").write_text("not a picture")
    bad = chat({"type": "image", "image": "bad.png"})
    broken = write_jsonl(tmp_path / "broken.jsonl", [{"id": "q2", "prompt": bad}])
    assert "prompt 'q2': image" in error_of(*rollout, "--prompts", broken, "--out", tmp_path / "r.jsonl")
    no_path = write_jsonl(tmp_path / "nopath.jsonl", [{"prompt": chat({"type": "image"})}])
    assert f"{no_path}:1: field 'prompt'" in error_of(*rollout, "--prompts", no_path, "--out", tmp_path / "r.jsonl")
    message = error_of("rollout", "--model", tiny_ckpt, "--prompts", vlm["prompts"], "--out", tmp_path / "r.jsonl")
    assert "prompt 'shapes-0' has image parts, but model type 'llama' is a text-only model" in message
    message = error_of(
        *rollout, "--prompts", vlm["prompts"], "--out", tmp_path / "r.jsonl", "--max-prompt-tokens", "30"
    )
    assert "prompt 'shapes-0': 87 tokens with its images (image tokens [16]) exceed the limit of 30" in message
    assert "lower max_pixels (now 4096)" in message
    message = error_of(*rollout, "--prompts", vlm["prompts"], "--out", tmp_path / "r.jsonl", "--engine", "vllm")
    assert "engine 'vllm' runs vision-language models (qwen2_vl) on CUDA only" in message
    score = ["score", "--rollouts", vlm["rollouts"], "--actor", vlm["ckpt"], "--reward", vlm["reward"]]
    message = error_of(*score, "--out", tmp_path / "s1", "--max-pixels", str(16 * 16))
    assert "sample 'shapes-0/0': its prompt holds [16] image tokens" in message and "--max-pixels" in message
    assert not (tmp_path / "s1").exists()


def test_prompt_length_limits_count_the_image_tokens(vlm, tmp_path):
    """Length limits on a prompt file count each image's tokens (from its size, as the engine expands it): the
    count equals the encoded prompt's for 0-2 images and other pixel limits, and on_long_prompt 'filter' leaves
    out the prompts their images make too long (text alone, with one placeholder per image, would fit)."""
    from rlx.checkpoints.loading import load_processor
    from rlx.formats.records import read_prompts
    from rlx.models.vision.config import VisionConfig

    records = read_prompts(str(vlm["prompts"]))
    for pixels in (VisionConfig(), VisionConfig(min_pixels=32 * 32, max_pixels=64 * 64)):
        processor = load_processor(resolve_source(str(vlm["ckpt"])), pixels)
        for record in records:
            encoded = processor.encode(record.prompt, prompt_id=record.id)
            assert processor.prompt_length(record.prompt, record.id) == len(encoded.input_ids), record.id
    out = tmp_path / "r.jsonl"
    result = cli_ok("rollout", "--model", vlm["ckpt"], "--prompts", vlm["prompts"], "--n", "1", "--max-new-tokens",
                    "2", "--max-prompt-length", "80", "--on-long-prompt", "filter", "--out", out)  # fmt: skip
    assert "left out 6 of 8 prompts as too long (first: prompt 'shapes-0', 87 tokens, over max_prompt_length 80)" in (
        result.stderr
    )
    assert [r["prompt_id"] for r in read_jsonl(out)] == ["two", "text"]


def test_missing_processor_kimi_and_changed_images(vlm, tmp_path):
    no_processor = tmp_path / "no-processor"
    shutil.copytree(vlm["ckpt"], no_processor)
    (no_processor / "preprocessor_config.json").unlink()
    message = error_of("rollout", "--model", no_processor, "--prompts", vlm["prompts"], "--out", tmp_path / "r.jsonl")
    assert f"{no_processor}: no preprocessor_config.json (nor a processor_config.json" in message
    assert "the Qwen2-VL image processor is missing" in message
    kimi = tmp_path / "kimi"
    kimi.mkdir()
    config = {"model_type": "kimi_vl", "architectures": ["KimiVLForConditionalGeneration"]}
    (kimi / "config.json").write_text(json.dumps(config))
    message = error_of("shard", "--model", kimi, "--out", tmp_path / "k")
    assert "Kimi-VL (model_type 'kimi_vl') is remote code only" in message
    # a batch stored without pixels reloads its images: a file replaced since scoring is an error naming it
    data = tmp_path / "data"
    shutil.copytree(vlm["prompts"].parent, data)
    rollouts = tmp_path / "r.jsonl"
    cli_ok("rollout", "--model", vlm["ckpt"], "--prompts", data / "prompts.jsonl", "--out", rollouts, "--n", "2",
           "--max-new-tokens", "2", "--num-prompts", "2")  # fmt: skip
    cli_ok("score", "--rollouts", rollouts, "--actor", vlm["ckpt"], "--reward", vlm["reward"], "--out", tmp_path / "s")
    random_image(40, 48, 1).save(data / "prompts_images" / "shapes-1.png")
    message = error_of("train-step", "--checkpoint", vlm["ckpt"], "--batch", tmp_path / "s" / "batch.safetensors",
                       "--out", tmp_path / "c1")  # fmt: skip
    assert "sample 'shapes-1/0': image" in message and "shapes-1.png' now gives patch grid [1, 10, 12]" in message


def test_lora_adapts_the_language_model(vlm, tmp_path):
    """LoRA on a vision-language model: 'all-linear' adapts the language model's linear layers (the tower gets
    adapters only where its layers are named); train-step with images trains them; the merged model changes the
    language model only."""
    cli_ok("shard", "--model", vlm["ckpt"], "--out", tmp_path / "lora", "--lora-rank", "4", "--lora-init", "random")
    adapters = read_weights(tmp_path / "lora")
    assert adapters and all(".language_model." in k for k in adapters if "lora_" in k)
    cli_ok("score", "--rollouts", vlm["rollouts"], "--actor", tmp_path / "lora", "--reward", vlm["reward"],
           "--out", tmp_path / "s", "--use-packing")  # fmt: skip
    step = ["train-step", "--batch", tmp_path / "s" / "batch.safetensors", "--lr", "1e-2"]
    cli_ok(*step, "--checkpoint", tmp_path / "lora", "--out", tmp_path / "step1", "--use-packing")
    cli_ok("merge", "--checkpoint", tmp_path / "step1", "--out", tmp_path / "merged")
    before, after = read_weights(vlm["ckpt"]), read_weights(tmp_path / "merged")
    assert before.keys() == after.keys() and tower_keys(before)
    assert all(torch.equal(before[k], after[k]) for k in tower_keys(before))
    assert any(not torch.equal(before[k], after[k]) for k in before if ".language_model." in k)
    cli_ok("shard", "--model", vlm["ckpt"], "--out", tmp_path / "qkv", "--lora-rank", "4", "--lora-target-modules",
           "qkv")  # fmt: skip
    named = [k for k in read_weights(tmp_path / "qkv") if "lora_A" in k]
    assert named and all(".visual." in k and ".qkv." in k for k in named)
    cli_ok("shard", "--model", vlm["ckpt"], "--out", tmp_path / "critic", "--role", "critic", "--lora-rank", "4")
    critic = [k for k in read_weights(tmp_path / "critic") if "lora_A" in k]
    assert critic and all(".language_model." in k for k in critic)


@pytest.mark.slow  # both steps in one launch of 2 processes: ~35 s on 2 shared CPU cores
def test_fsdp_and_sequence_parallel_train_steps_equal_one_process(vlm, tmp_path):
    cli_ok("score", "--rollouts", vlm["rollouts"], "--actor", vlm["ckpt"], "--reward", vlm["reward"], "--out",
           tmp_path / "s")  # fmt: skip
    step = ["train-step", "--checkpoint", vlm["ckpt"], "--batch", tmp_path / "s" / "batch.safetensors", "--lr", "1e-2",
            "--use-packing", "--no-freeze-vision-tower"]  # fmt: skip
    cli_ok(*step, "--out", tmp_path / "one")
    torchrun_commands(2, [*step, "--out", tmp_path / "fsdp"], [*step, "--out", tmp_path / "sp", "--sp-degree", "2"])
    assert_same_weights(tmp_path / "one", tmp_path / "fsdp", atol=1e-4)  # Adam: see assert_same_gradients
    assert_same_weights(tmp_path / "one", tmp_path / "sp", atol=1e-4)


@pytest.mark.slow  # 75 steps: half the 150-step run (~70 s in CI)
def test_tiny_vlm_recipe_learns(tmp_path):
    from rlx.ppo.config import load_recipe
    from rlx.ppo.loop import run_ppo

    # the recipe's first 75 of its 150 steps (constant lr: the full run's first 75). Mean reward of steps 1-5 ->
    # 71-75 at seed 0: 0.01 -> 0.71 (-> 0.80 at 96-100; seeds 1 / 2 at 96-100: 0.64 / 0.81, seed 1 the slowest)
    run_ppo(load_recipe(RECIPE, ["steps=75"]), tmp_path / "run")
    rewards = [m["reward/mean"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert len(rewards) == 75
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    # every prompt has the same text and answers 1-3 are equally likely: above 1/3 the model reads the image
    assert last >= first + 0.35 and last >= 0.45, (first, last, rewards)


def test_recipe_data_matches_the_generator(tmp_path):
    shipped = read_jsonl(REPO / "recipes" / "data" / "shapes_quickstart.jsonl")
    out = tmp_path / "shapes.jsonl"
    pairs = generate_shapes(len(shipped), seed=0, size=32, grid=2, kinds=("total",), max_count=3, min_side=0.75)
    write_shapes(out, pairs, embed=True)
    assert read_jsonl(out) == shipped
    assert shipped[0]["prompt"][0]["content"][0]["image"] == data_uri(pairs[0][1])


def save_like_transformers_processor(processor, out: Path) -> None:
    """What `Qwen2VLProcessor.save_pretrained` of transformers 5.17 writes: processor_config.json with the image
    (and video) processor nested inside, chat_template.jinja and the tokenizer files; no preprocessor_config.json.
    Its video processor needs torchvision, which this environment lacks: the class saves without one here and the
    video settings it would nest are added as transformers writes them."""
    from transformers import Qwen2VLProcessor

    class WithoutVideo(Qwen2VLProcessor):
        @classmethod
        def get_attributes(cls):
            return ["image_processor", "tokenizer"]

        def check_argument_for_proper_class(self, name, arg):
            if arg is not None:
                super().check_argument_for_proper_class(name, arg)

    WithoutVideo.__name__ = "Qwen2VLProcessor"
    hf = WithoutVideo(
        processor.image_processor, processor.tokenizer, None, chat_template=processor.tokenizer.chat_template
    )
    hf.save_pretrained(out)
    settings = json.loads((out / "processor_config.json").read_text())
    settings["video_processor"] = {"video_processor_type": "Qwen2VLVideoProcessor", "merge_size": 2, "patch_size": 4}
    (out / "processor_config.json").write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_weights_saved_by_transformers_shard_and_merge_back_bit_exactly(tmp_path, family):
    """A folder as `save_pretrained` of transformers 5.17 writes it (Qwen2-VL and Qwen2.5-VL under their legacy
    names `model.layers.*` / `visual.*`, as the hub's files are; GLM-4.5V's experts one tensor each): `rlx shard`
    reads the weights as transformers loads them, and `rlx merge` writes the same file back byte for byte."""
    from transformers import AutoModelForImageTextToText

    hub = write_tiny_vision_model_dir(tmp_path / "hf", family)
    model = build_tiny_vision_model(family, seed=1)[0]
    model.save_pretrained(hub)
    with safe_open(str(hub / "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    if family in ("qwen2_vl", "qwen2_5_vl"):
        assert any(k.startswith("visual.") for k in stored) and any(k.startswith("model.layers.") for k in stored)
    if family == "glm4v_moe":
        assert any(".experts.0." in k for k in stored)
    cli_ok("shard", "--model", hub, "--out", tmp_path / "ckpt")
    cli_ok("merge", "--checkpoint", tmp_path / "ckpt", "--out", tmp_path / "merged")
    assert (tmp_path / "merged" / "model.safetensors").read_bytes() == (hub / "model.safetensors").read_bytes()
    loaded = AutoModelForImageTextToText.from_pretrained(hub).state_dict()
    sharded = read_weights(tmp_path / "ckpt")  # the module's names, as transformers loads them
    expected = {k: v for k, v in loaded.items() if k in sharded or k != "lm_head.weight"}
    assert sharded.keys() == expected.keys() and all(torch.equal(sharded[k], expected[k]) for k in expected)


def test_a_processor_saved_by_transformers_is_read_and_round_trips(tmp_path):
    """A Qwen2-VL dir whose processor files are what transformers 5.17 writes: rlx reads its image processor, and
    shard then merge give the processor and tokenizer files back byte for byte (its weights: rlx's random ones;
    weights as transformers saves them: the test above)."""
    from rlx.models.vision.processor import load_vision_processor
    from rlx.models.vision.tiny import tiny_vision_config, tiny_vision_processor

    processor = tiny_vision_processor("qwen2_vl")
    hf = tmp_path / "hf"
    hf.mkdir()
    tiny_vision_config("qwen2_vl", processor.tokenizer).save_pretrained(hf)
    save_like_transformers_processor(processor, hf)
    assert not (hf / "preprocessor_config.json").exists()
    prompt = chat(image_part(16, 24, 0), "what is it?")
    expected = processor.encode(prompt, prompt_id="p")
    cli_ok("shard", "--model", hf, "--init", "random", "--out", tmp_path / "ckpt")
    cli_ok("merge", "--checkpoint", tmp_path / "ckpt", "--out", tmp_path / "merged")
    merged = tmp_path / "merged"
    for path in hf.iterdir():
        assert (merged / path.name).read_bytes() == path.read_bytes(), path.name
    for folder in (hf, tmp_path / "ckpt", merged):
        encoded = load_vision_processor(folder).encode(prompt, prompt_id="p")
        assert encoded.input_ids == expected.input_ids
        assert torch.equal(encoded.vision.pixel_values, expected.vision.pixel_values)
    (hf / "processor_config.json").write_text('{"processor_class": "Qwen2VLProcessor"}')  # nothing nested: refused
    with pytest.raises(UserError, match="no preprocessor_config.json \\(nor a processor_config.json"):
        load_vision_processor(hf)
