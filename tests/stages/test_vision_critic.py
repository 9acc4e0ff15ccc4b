"""Critics (value models) of vision-language models: built from the policy (its vision tower and decoder + a scalar
head), values of packed rows == padded rows == the model's own forward, images that change the values, critic
train-steps on image batches (loss falls, frozen tower, packed == padded), shard -> merge with the processor files,
`rlx ppo` with [critic] == the shell pipeline, and the errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from rlx.checkpoints.loading import load_model
from rlx.errors import UserError
from rlx.logprobs import ModuleScorer, batched_response_values, packed_response_values
from rlx.models.attention import enable_packed_attention
from rlx.models.loading import ModelSource, model_class, read_weights
from rlx.models.value import build_value_model
from rlx.models.vision.families import freeze_vision_tower, vision_family_of
from rlx.models.vision.packing import VisionRow, vision_forward
from rlx.models.vision.tiny import build_tiny_vision_model, write_tiny_vision_model_dir
from rlx.parallel.dist import DistContext
from rlx.tasks.shapes import generate_shapes, write_shapes
from tests.conftest import REPO, cli, cli_ok, read_jsonl, torchrun_commands, write_length_reward
from tests.stages.test_ppo import stable
from tests.stages.test_vision_stages import assert_same_gradients, assert_same_weights, tower_keys
from tests.unit.test_vision import chat, image_part, micro_batch

CPU = DistContext(device=torch.device("cpu"))
PROCESSOR_FILES = ("preprocessor_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def plain_values(critic, processor, batch) -> list[torch.Tensor]:
    """Each sample's response values from the value model's own forward of that sample alone (transformers' image
    placement and 3-D positions, no padding)."""
    out = []
    for e, response in zip(batch["encoded"], batch["responses"]):
        ids = torch.tensor([e.input_ids + response])
        token_types = (ids == processor.image_token_id).int()
        with torch.no_grad():
            logits = critic(input_ids=ids, mm_token_type_ids=token_types, **e.vision.model_kwargs()).logits
        out.append(logits[0, len(e.input_ids) - 1 : -1, 0])
    return out


def scorer_values(critic, batch, micro_batch_size: int, max_tokens: int = 0) -> torch.Tensor:
    """[B, R] values as `rlx score` computes them (padded micro-batches, or packed rows of `max_tokens`)."""
    scorer = ModuleScorer(critic, CPU)
    return scorer.values(batch["tensors"], torch.float32, micro_batch_size, max_tokens, vision=batch["vision"])


@pytest.mark.parametrize("name", ["qwen2_vl", "glm4v", "qwen3_vl"])
def test_packed_and_padded_values_equal_the_models_own_forward(name):
    policy, processor = build_tiny_vision_model(name)
    critic = build_value_model(policy, seed=1).eval()
    assert type(critic).__name__ == critic.config.architectures[0] and critic.config.num_labels == 1
    backbone = policy.model.state_dict()
    assert all(torch.equal(v, backbone[k]) for k, v in critic.model.state_dict().items())  # tower and decoder
    batch = micro_batch(processor)  # samples with 0, 1 and 2 images
    want = plain_values(critic, processor, batch)
    padded = scorer_values(critic, batch, micro_batch_size=2)  # micro-batches [0, 1] and [2]: images picked per row
    packed = scorer_values(critic, batch, micro_batch_size=2, max_tokens=60)  # several packed rows
    for i, values in enumerate(want):
        n = len(values)
        torch.testing.assert_close(padded[i, :n], values, atol=1e-5, rtol=0)
        torch.testing.assert_close(packed[i, :n], values, atol=1e-5, rtol=0)
        assert not padded[i, n:].any()
    # without its images the same rows give other values: the tower's features reach the head
    text_only = batched_response_values(critic, batch["tensors"], torch.device("cpu"), torch.float32, 3)
    torch.testing.assert_close(text_only[0], padded[0], atol=1e-5, rtol=0)  # the sample without an image
    assert (text_only[1:] - padded[1:]).abs().max() > 1e-3


def test_two_images_with_the_same_words_give_different_values():
    policy, processor = build_tiny_vision_model("qwen2_vl")
    critic = build_value_model(policy, seed=2).eval()
    prompts = [chat(image_part(16, 16, seed), "how many shapes?") for seed in (11, 12)]
    batch = micro_batch(processor, prompts=prompts, response_lengths=(4, 4))
    batch["tensors"]["response_ids"][1] = batch["tensors"]["response_ids"][0]  # the same response too
    assert torch.equal(batch["tensors"]["prompt_ids"][0], batch["tensors"]["prompt_ids"][1])
    values = scorer_values(critic, batch, micro_batch_size=2)
    assert (values[0] - values[1]).abs().min() > 1e-4  # every token's value depends on the image


def test_the_critics_frozen_tower_gets_no_gradient():
    policy, processor = build_tiny_vision_model("qwen3_vl")
    critic = build_value_model(policy, seed=0)
    enable_packed_attention(critic, decoder_only=True)
    batch = micro_batch(processor)
    tower = {id(p) for m in vision_family_of(critic.config).vision_tower(critic) for p in m.parameters()}
    row = VisionRow.from_padded(**batch["tensors"], vision=batch["vision"], config=critic.config)
    for frozen in (True, False):
        critic.zero_grad(set_to_none=True)
        assert freeze_vision_tower(critic, frozen) == len(tower)
        with vision_forward(critic, row):
            values = packed_response_values(critic, **batch["tensors"], dtype=torch.float32)
        (values * batch["tensors"]["response_mask"]).sum().backward()
        tower_grads = [p.grad for p in critic.parameters() if id(p) in tower and p.grad is not None]
        assert critic.score.weight.grad.abs().sum() > 0
        if frozen:
            assert not tower_grads
        else:
            assert len(tower_grads) == len(tower) and sum(g.abs().sum() for g in tower_grads) > 0


def test_every_family_builds_saves_and_loads_a_critic(tmp_path):
    for name in ("qwen2_5_vl", "qwen3_vl_moe", "glm4v_moe"):
        policy, _ = build_tiny_vision_model(name, num_layers=1)
        critic = build_value_model(policy, seed=0)
        critic.save_pretrained(tmp_path / name)
        loaded = load_model(ModelSource(tmp_path / name), "critic")
        assert type(loaded) is type(critic) and loaded.config.architectures == critic.config.architectures
        assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), critic.state_dict().values()))


def test_a_family_without_a_value_model_is_named():
    from transformers import LlavaConfig

    with pytest.raises(UserError, match="'llava' is not supported by rlx"):
        model_class(LlavaConfig(), "critic")


# --- through the commands ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> dict:
    """A tiny Qwen2-VL (random init) with its critic, image prompts, a dense reward, rollouts and their GAE batch."""
    root = tmp_path_factory.mktemp("vlm_critic")
    model = write_tiny_vision_model_dir(root / "model", "qwen2_vl")
    cli_ok("shard", "--model", model, "--init", "random", "--seed", "0", "--out", root / "ckpt0")
    cli_ok("shard", "--model", root / "ckpt0", "--role", "critic", "--seed", "1", "--out", root / "critic0")
    prompts = root / "data" / "prompts.jsonl"
    write_shapes(prompts, generate_shapes(4, seed=1, size=32, kinds=("count",), max_count=3), embed=False)
    cli_ok("rollout", "--model", root / "ckpt0", "--prompts", prompts, "--out", root / "r.jsonl", "--n", "2",
           "--max-new-tokens", "5", "--seed", "1")  # fmt: skip
    out = {"root": root, "model": model, "ckpt": root / "ckpt0", "critic": root / "critic0",
           "reward": f"{write_length_reward(root)}:score", "batch": root / "s" / "batch.safetensors"}  # fmt: skip
    cli_ok(*score_args(out, root / "critic0"), "--out", root / "s")
    return out


def score_args(vlm: dict, critic: Path) -> list:
    """`rlx score` of the fixture's rollouts with `critic` (GAE, the dense reward); --out to add."""
    return ["score", "--rollouts", vlm["root"] / "r.jsonl", "--actor", vlm["ckpt"], "--critic", critic,
            "--estimator", "gae", "--reward", vlm["reward"]]  # fmt: skip


def test_critic_checkpoint_is_the_policy_backbone_with_the_processor_files(vlm, tmp_path):
    policy, critic = read_weights(vlm["ckpt"]), read_weights(vlm["critic"])
    assert tower_keys(critic) and critic["score.weight"].shape == (1, 64) and "lm_head.weight" not in critic
    assert set(critic) - {"score.weight", "score.bias"} == {k for k in policy if k.startswith("model.")}
    assert all(torch.equal(policy[k], critic[k]) for k in critic if k.startswith("model."))
    config = json.loads((vlm["critic"] / "config.json").read_text())
    assert config["architectures"] == ["Qwen2VLForTokenClassification"] and config["model_type"] == "qwen2_vl"
    for name in PROCESSOR_FILES:
        assert (vlm["critic"] / name).read_bytes() == (vlm["model"] / name).read_bytes(), name
    # shard -> merge, in both layouts, gives the critic back bit for bit with its processor files
    cli_ok("merge", "--checkpoint", vlm["critic"], "--out", tmp_path / "hf")
    for layout in ("single", "fsdp"):
        cli_ok("shard", "--model", tmp_path / "hf", "--role", "critic", "--layout", layout, "--out", tmp_path / layout)
        cli_ok("merge", "--checkpoint", tmp_path / layout, "--out", tmp_path / f"merged-{layout}")
        assert_same_weights(vlm["critic"], tmp_path / f"merged-{layout}")
        for name in (*PROCESSOR_FILES, "config.json"):
            assert (tmp_path / f"merged-{layout}" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), name
    loaded = load_model(ModelSource(tmp_path / "merged-fsdp"), "critic")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in critic.items())


def test_score_and_critic_train_steps_with_images(vlm, tmp_path):
    packing = ["--use-packing", "--max-tokens-per-micro-batch", "200"]  # several packed rows
    cli_ok(*score_args(vlm, vlm["critic"]), "--out", tmp_path / "packed", *packing)
    padded, packed = (load_file(str(p)) for p in (vlm["batch"], tmp_path / "packed" / "batch.safetensors"))
    mask = padded["response_mask"].bool()
    assert padded["values"][mask].abs().min() > 0 and not padded["values"][~mask].any()
    torch.testing.assert_close(packed["values"], padded["values"], atol=1e-5, rtol=0)
    step = ["train-step", "--role", "critic", "--batch", vlm["batch"], "--lr", "1e-3", "--cliprange-value", "10"]
    metrics = tmp_path / "m.jsonl"
    for k in range(3):  # the value loss falls on a fixed batch
        src = vlm["critic"] if k == 0 else tmp_path / f"c{k}"
        cli_ok(*step, "--checkpoint", src, "--out", tmp_path / f"c{k + 1}", "--metrics", metrics)
    losses = [line["critic/vf_loss"] for line in read_jsonl(metrics)]
    assert losses[2] < losses[1] < losses[0], losses
    for name in PROCESSOR_FILES:  # the trained critic reads its batches' images as the policy does
        assert (tmp_path / "c3" / name).read_bytes() == (vlm["critic"] / name).read_bytes()
    cli_ok(*score_args(vlm, tmp_path / "c3"), "--out", tmp_path / "after")
    after = load_file(str(tmp_path / "after" / "batch.safetensors"))
    error = lambda values: ((values - padded["returns"]) ** 2)[mask].mean()  # noqa: E731
    assert error(after["values"]) < error(padded["values"])
    # packed == padded train-steps; the frozen tower (default) keeps its weights and has no optimizer state
    cli_ok(*step, "--checkpoint", vlm["critic"], "--out", tmp_path / "packed1", "--use-packing")
    assert_same_gradients(tmp_path / "c1", tmp_path / "packed1")
    cli_ok(*step, "--checkpoint", vlm["critic"], "--out", tmp_path / "tower", "--no-freeze-vision-tower")
    before, frozen, trained = (read_weights(p) for p in (vlm["critic"], tmp_path / "c1", tmp_path / "tower"))
    assert all(torch.equal(before[k], frozen[k]) for k in tower_keys(before))
    assert not torch.equal(before["score.weight"], frozen["score.weight"])
    assert all(not torch.equal(before[k], trained[k]) for k in tower_keys(before) if "weight" in k)
    with safe_open(str(tmp_path / "c1" / "optimizer.safetensors"), "pt") as f:
        assert not any(".visual." in k for k in f.keys())  # noqa: SIM118 - safe_open is not a mapping


@pytest.mark.slow  # both steps in one launch of 2 ranks: ~25 s on 2 shared CPU cores
def test_fsdp_and_sequence_parallel_critic_train_steps_equal_one_process(vlm, tmp_path):
    step = ["train-step", "--role", "critic", "--checkpoint", vlm["critic"], "--batch", vlm["batch"], "--lr", "1e-2",
            "--use-packing", "--no-freeze-vision-tower"]  # fmt: skip
    cli_ok(*step, "--out", tmp_path / "one")
    torchrun_commands(2, [*step, "--out", tmp_path / "fsdp"], [*step, "--out", tmp_path / "sp", "--sp-degree", "2"])
    assert_same_weights(tmp_path / "one", tmp_path / "fsdp", atol=1e-4)  # Adam: see assert_same_gradients
    assert_same_weights(tmp_path / "one", tmp_path / "sp", atol=1e-4)


def test_a_text_critic_for_image_samples_is_an_error(vlm, tiny_ckpt, tmp_path):
    cli_ok("shard", "--model", tiny_ckpt, "--role", "critic", "--out", tmp_path / "text_critic")
    result = cli(*score_args(vlm, tmp_path / "text_critic"), "--out", tmp_path / "s")
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    assert "the samples have images, but the critic is a text-only model (llama)" in result.stderr


# --- rlx ppo with a critic ---------------------------------------------------------------------------------------

RECIPE = REPO / "recipes" / "tiny_vlm_shapes.toml"
PROMPTS = REPO / "recipes" / "data" / "shapes_quickstart.jsonl"
PPO_SETS = ["data.prompts_per_step=4", "rollout.sampling.n=4", "save_every=1", "score.estimator=gae",
            "critic.train.optim.lr=1e-3", "critic.train.mini_batch_size=8", "critic.train.micro_batch_size=16",
            "critic.train.optim.weight_decay=0.0", "train.mini_batch_size=8"]  # fmt: skip


def vlm_critic_shell_pipeline(out: Path, steps: int, seed: int) -> None:
    """recipes/tiny_vlm_shapes.sh with PPO_SETS (GAE, a critic from the policy), stage by stage."""
    ckpt = lambda k, part="": out / "checkpoints" / f"step_{k:06d}" / part  # noqa: E731
    metrics = ["--metrics", out / "metrics.jsonl"]
    cli_ok("shard", "--model", REPO / "recipes" / "tiny-vlm", "--init", "random", "--seed", seed, "--out", ckpt(0))
    cli_ok("shard", "--model", ckpt(0), "--role", "critic", "--seed", seed, "--out", ckpt(0, "critic"))
    for k in range(1, steps + 1):
        step = out / f"step_{k:06d}"
        cli_ok("rollout", "--model", ckpt(k - 1), "--prompts", PROMPTS, "--out", step / "rollouts.jsonl",
               "--num-prompts", 4, "--data-position", (k - 1) * 4, "--n", 4, "--max-new-tokens", 1,
               "--temperature", 1.0, "--batch-size", 128, "--seed", seed + k, *metrics)  # fmt: skip
        cli_ok("score", "--rollouts", step / "rollouts.jsonl", "--actor", ckpt(k - 1), "--ref", ckpt(0),
               "--critic", ckpt(k - 1, "critic"), "--estimator", "gae", "--reward", "shapes",
               "--micro-batch-size", 128, "--out", step, *metrics)  # fmt: skip
        common = ["--batch", step / "batch.safetensors", "--weight-decay", 0, "--seed", seed, "--freeze-vision-tower"]
        cli_ok("train-step", "--checkpoint", ckpt(k - 1), "--out", ckpt(k), "--lr", "1e-3", "--mini-batch-size", 8,
               "--micro-batch-size", 128, *common, *metrics)  # fmt: skip
        cli_ok("train-step", "--role", "critic", "--checkpoint", ckpt(k - 1, "critic"), "--out", ckpt(k, "critic"),
               "--lr", "1e-3", "--mini-batch-size", 8, "--micro-batch-size", 16, *common, *metrics)  # fmt: skip


def test_ppo_with_a_critic_equals_the_shell_pipeline_and_resumes(tmp_path):
    vlm_critic_shell_pipeline(tmp_path / "sh", steps=2, seed=3)
    sets = ["--set", "seed=3", *(arg for s in PPO_SETS for arg in ("--set", s))]
    cli_ok("ppo", RECIPE, "--out", tmp_path / "ppo", "--set", "steps=2", *sets)
    cli_ok("ppo", RECIPE, "--out", tmp_path / "resumed", "--set", "steps=1", *sets)
    cli_ok("ppo", RECIPE, "--out", tmp_path / "resumed", "--set", "steps=2", *sets, "--resume")
    sh, ppo = tmp_path / "sh", tmp_path / "ppo"
    for part in ("", "critic"):
        final = Path("checkpoints") / "step_000002" / part
        assert_same_weights(sh / final, ppo / final)
        assert_same_weights(tmp_path / "resumed" / final, ppo / final)
    first, final = (read_weights(run / "checkpoints" / f"step_00000{k}" / "critic") for run, k in ((sh, 0), (ppo, 2)))
    assert not torch.equal(first["score.weight"], final["score.weight"])  # the critic trained
    for name in PROCESSOR_FILES:
        assert (ppo / "checkpoints" / "step_000002" / "critic" / name).read_bytes() == (
            REPO / "recipes" / "tiny-vlm" / name
        ).read_bytes()
    # the driver's reference is a copy of the initial policy, `rlx score --ref` of the actor's own checkpoint shares
    # the actor's module: their KL differs by float noise (the same without a critic,
    # tests/stages/test_vision_stages.py)
    lines, shell_lines = (stable(read_jsonl(run / "metrics.jsonl")) for run in (ppo, sh))
    for step in (1, 2):
        assert abs(lines[step].pop("actor/ref_kl") - shell_lines[step].pop("actor/ref_kl")) < 1e-6
        assert "critic/vf_loss" in lines[step] and "critic/values_mean" in lines[step]
    assert shell_lines == lines
    for step in ("step_000001", "step_000002"):
        for name in ("rollouts.jsonl", "scores.jsonl"):
            assert (sh / step / name).read_bytes() == (ppo / step / name).read_bytes(), (step, name)
