"""Vision-language models: families, processors built in code, images, mRoPE positions, packed forwards with
images (== transformers per sample), a frozen vision tower, Ulysses SP 2 == SP 1, the compact batch form."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from PIL import Image

from rlx.errors import UserError
from rlx.logprobs import logprobs_from_logits, packed_response_logprobs
from rlx.models.attention import PACKED_ATTENTION, enable_packed_attention
from rlx.models.vision.config import VisionConfig
from rlx.models.vision.families import FAMILIES, family_for_prompt, freeze_vision_tower, vision_family_of
from rlx.models.vision.images import data_uri, image_refs, load_image, resolve_ref
from rlx.models.vision.inputs import VisionInputs, from_tensors, to_tensors
from rlx.models.vision.packing import VisionRow, set_decoder_attention, vision_forward
from rlx.models.vision.positions import mrope_positions
from rlx.models.vision.processor import load_vision_processor, vision_processor_for
from rlx.models.vision.tiny import (
    build_tiny_vision_model,
    tiny_vision_config,
    tiny_vision_processor,
    write_tiny_vision_model_dir,
)
from tests.conftest import REPO, WORKERS, run_torchrun

FAMILY_NAMES = [f.name for f in FAMILIES.values()]


def random_image(height: int, width: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def image_part(height: int, width: int, seed: int) -> dict:
    return {"type": "image", "image": data_uri(random_image(height, width, seed))}


def chat(*parts) -> list[dict]:
    return [{"role": "user", "content": [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]}]


# 0, 1 and 2 images of different sizes (grids 4x4, 4x6 and 6x8 patches: 4, 6 and 12 image tokens)
PROMPTS = [
    [{"role": "user", "content": "no image here"}],
    chat(image_part(16, 16, 1), "count them"),
    chat("a", image_part(16, 24, 2), image_part(24, 32, 3)),
]
RESPONSE_LENGTHS = (5, 3, 7)


def micro_batch(processor, prompts=PROMPTS, response_lengths=RESPONSE_LENGTHS, seed: int = 1) -> dict:
    """Encoded prompts with random responses as a padded micro-batch (left-padded prompts, right-padded
    responses) plus the samples' vision inputs and, per sample, its unpadded tokens."""
    encoded = [processor.encode(p, prompt_id=i) for i, p in enumerate(prompts)]
    generator = torch.Generator().manual_seed(seed)
    responses = [torch.randint(5, 60, (n,), generator=generator).tolist() for n in response_lengths]
    num, longest_prompt, longest_response = len(encoded), max(len(e.input_ids) for e in encoded), max(response_lengths)
    batch = {k: torch.zeros(num, longest_prompt, dtype=torch.long) for k in ("prompt_ids", "prompt_mask")}
    batch.update({k: torch.zeros(num, longest_response, dtype=torch.long) for k in ("response_ids", "response_mask")})
    for i, (e, r) in enumerate(zip(encoded, responses)):
        batch["prompt_ids"][i, longest_prompt - len(e.input_ids) :] = torch.tensor(e.input_ids)
        batch["prompt_mask"][i, longest_prompt - len(e.input_ids) :] = 1
        batch["response_ids"][i, : len(r)] = torch.tensor(r)
        batch["response_mask"][i, : len(r)] = 1
    return {"tensors": batch, "vision": VisionInputs.concat([e.vision for e in encoded]), "encoded": encoded,
            "responses": responses}  # fmt: skip


def straddling_micro_batch(processor, world: int) -> dict:
    """`micro_batch` with the first response's length chosen so that an image's tokens straddle the boundary
    between the first two of `world` sequence-parallel ranks."""
    for first in range(1, 64):
        batch = micro_batch(processor, response_lengths=(first, *RESPONSE_LENGTHS[1:]))
        row = [t for e, r in zip(batch["encoded"], batch["responses"]) for t in e.input_ids + r]
        half = -(-len(row) // world)
        if row[half - 1] == row[half] == processor.image_token_id:
            return batch
    raise AssertionError("no response length puts an image across the ranks' boundary")


def per_sample_reference(model, processor, batch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(logprobs, entropy) of each sample's response from transformers' own forward of that sample alone
    (its own processor outputs, its own 3-D positions from get_rope_index, sdpa attention)."""
    out = []
    for e, response in zip(batch["encoded"], batch["responses"]):
        ids = torch.tensor([e.input_ids + response])
        token_types = (ids == processor.image_token_id).int()
        logits = model(input_ids=ids, mm_token_type_ids=token_types, **e.vision.model_kwargs()).logits
        out.append(logprobs_from_logits(logits[0, len(e.input_ids) - 1 : -1], torch.tensor(response), 1.0, True))
    return out


def packed_logprobs(model, batch, impl: str = "naive"):
    """Packed logprobs and entropy [B, R] of the micro-batch through rlx's packed path with its images."""
    row = VisionRow.from_padded(**batch["tensors"], vision=batch["vision"], config=model.config)
    with vision_forward(model, row):
        return packed_response_logprobs(
            model, **batch["tensors"], temperature=1.0, dtype=torch.float32, with_entropy=True, impl=impl
        )


# --- families --------------------------------------------------------------------------------------------


def test_family_of_supported_and_unsupported_models():
    for name in FAMILY_NAMES:
        family = vision_family_of(tiny_vision_config(name))
        assert family.name == name and family.model_type == tiny_vision_config(name).model_type
    with pytest.raises(UserError, match=r"Kimi-VL .*remote code only"):
        vision_family_of(type("KimiVLConfig", (), {"model_type": "kimi_vl"})())
    from transformers import LlamaConfig, LlavaConfig

    with pytest.raises(UserError, match=r"'llama' is a text-only model: it cannot take image parts"):
        vision_family_of(LlamaConfig())
    with pytest.raises(UserError, match=r"vision-language model type 'llava' is not supported by rlx yet"):
        vision_family_of(LlavaConfig())


def test_image_parts_need_a_vision_model():
    from transformers import LlamaConfig

    assert family_for_prompt(LlamaConfig(), PROMPTS[0], "t") is None  # text on a text model
    assert family_for_prompt(tiny_vision_config("glm4v"), PROMPTS[0], "t").name == "glm4v"
    with pytest.raises(UserError, match=r"prompt 'p3' has image parts, but model type 'llama' is a text-only model"):
        family_for_prompt(LlamaConfig(), PROMPTS[1], "p3")


def test_vision_config_validates():
    assert VisionConfig().freeze_vision_tower
    with pytest.raises(UserError, match="max_pixels: must be >= 0"):
        VisionConfig(max_pixels=-1)
    with pytest.raises(UserError, match="min_pixels: must not exceed max_pixels"):
        VisionConfig(min_pixels=100, max_pixels=10)


# --- images ----------------------------------------------------------------------------------------------


def test_images_load_from_paths_urls_and_data_uris(tmp_path):
    import fsspec

    image = random_image(10, 12, 0)
    image.save(tmp_path / "a.png")
    with fsspec.open("memory://vision-test/b.png", "wb") as f:
        image.save(f, format="PNG")
    want = np.asarray(image)
    for ref, base in [
        ("a.png", tmp_path),  # relative to the prompts file's folder
        (str(tmp_path / "a.png"), None),
        (f"file://{tmp_path}/a.png", None),
        ("memory://vision-test/b.png", None),
        ("b.png", "memory://vision-test"),
        (data_uri(image), None),
    ]:
        assert np.array_equal(np.asarray(load_image(ref, prompt_id="p", base=base)), want), ref
    assert resolve_ref("x.png", "memory://d/") == "memory://d/x.png"
    assert image_refs(chat("hi", {"type": "image", "image": "a.png"}), "p") == ["a.png"]


def test_bad_images_name_the_prompt_and_the_path(tmp_path):
    (tmp_path / "notes.png").write_text("not an image")
    cases = [
        ("missing.png", r"prompt 'q7': image '.*missing.png' does not exist"),
        ("memory://vision-test/absent.png", r"prompt 'q7': image 'memory://vision-test/absent.png' does not exist"),
        ("notes.png", r"prompt 'q7': image '.*notes.png' is not an image format Pillow reads"),
        ("data:image/png;base64,@@@", r"prompt 'q7': image 'data:image/png;base64,@@@' has bad base64 data"),
        ("data:image/png,abc", r"prompt 'q7': image 'data:image/png,abc' is a data: URI without ';base64,'"),
    ]
    for ref, message in cases:
        with pytest.raises(UserError, match=message):
            load_image(ref, prompt_id="q7", base=tmp_path)
    with pytest.raises(UserError, match=r"prompt 'q7': an image part needs 'image'"):
        image_refs(chat({"type": "image"}), "q7")


# --- processor -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_processor_expands_placeholders_per_image(name):
    processor = tiny_vision_processor(name)
    encoded = processor.encode(PROMPTS[2], prompt_id=2)
    assert encoded.vision.image_grid_thw.tolist() == [[1, 4, 6], [1, 6, 8]]
    assert encoded.vision.pixel_values.shape == (24 + 48, 3 * 2 * 4 * 4)
    ids = encoded.input_ids
    assert ids.count(processor.image_token_id) == 6 + 12
    text = processor.tokenizer.decode(ids)
    family = processor.family
    one = family.image_start + family.image_token * 6 + family.image_end
    two = family.image_start + family.image_token * 12 + family.image_end
    assert f"a{one}{two}" in text


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_processed_pixels_give_back_images_that_process_to_the_same_pixels(name):
    """`images_of` inverts processing up to the resize: the images it gives process to the very pixels and grids
    they came from (what the vllm engine hands vLLM, which processes images itself)."""
    processor = tiny_vision_processor(name)
    rng = np.random.default_rng(0)
    originals = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((21, 37), (64, 40))]
    pixels, grids = processor.process_images(originals)
    images = processor.images_of(pixels, grids)
    assert [(i.height, i.width) for i in images] == [(h * 4, w * 4) for _, h, w in grids.tolist()]  # patch size 4
    again, regrids = processor.process_images(images)
    assert torch.equal(regrids, grids)
    torch.testing.assert_close(again, pixels, atol=1e-6, rtol=0)
    assert not torch.equal(processor.process_images(images[::-1])[0], pixels)  # the images' order matters


def test_processor_resizes_large_images_and_limits_prompts():
    processor = tiny_vision_processor("qwen2_vl")  # at most 64 x 64 pixels per image
    big = chat(image_part(200, 400, 0), "size?")
    grid = processor.encode(big, prompt_id="big").vision.image_grid_thw[0].tolist()
    assert grid == [1, 10, 22] and (grid[1] * 4) * (grid[2] * 4) <= 64 * 64  # 40 x 88 pixels: aspect kept, in budget
    smaller = processor.with_pixels(max_pixels=32 * 32).encode(big, prompt_id="big").vision.image_grid_thw
    assert smaller[0].tolist() == [1, 4, 10]
    with pytest.raises(UserError, match=r"prompt 'big': \d+ tokens with its images \(image tokens \[55\]\) exceed"):
        processor.encode(big, prompt_id="big", max_tokens=20)


def test_processor_rejects_mismatched_placeholders():
    processor = tiny_vision_processor("qwen3_vl")
    literal = chat("look <|image_pad|>", image_part(16, 16, 0))
    with pytest.raises(UserError, match=r"prompt 'x': 1 image parts but 2 '<\|image_pad\|>' placeholders"):
        processor.encode(literal, prompt_id="x")


def test_processor_round_trips_through_a_model_dir(tmp_path):
    write_tiny_vision_model_dir(tmp_path / "m", "glm4v")
    loaded = load_vision_processor(tmp_path / "m")
    want = tiny_vision_processor("glm4v").encode(PROMPTS[1], prompt_id=1)
    got = loaded.encode(PROMPTS[1], prompt_id=1)
    assert got.input_ids == want.input_ids and torch.equal(got.vision.pixel_values, want.vision.pixel_values)
    limited = vision_processor_for(tmp_path / "m", options=VisionConfig(max_pixels=8 * 16))
    assert limited.encode(PROMPTS[1], prompt_id=1).vision.image_grid_thw.tolist() == [[1, 2, 2]]  # 16x16 -> 8x8
    (tmp_path / "m" / "preprocessor_config.json").unlink()
    missing = r"no preprocessor_config.json \(nor a processor_config.json .*\): the GLM-4.1V image processor is missing"
    with pytest.raises(UserError, match=missing):
        load_vision_processor(tmp_path / "m")


# --- positions and packed forwards -----------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_mrope_positions_equal_get_rope_index(name):
    model, processor = build_tiny_vision_model(name)
    for prompt in PROMPTS:
        encoded = processor.encode(prompt, prompt_id=0)
        ids = torch.tensor([encoded.input_ids + [7, 8, 9]])
        grids = encoded.vision.image_grid_thw
        want, _ = model.model.get_rope_index(
            ids, (ids == processor.image_token_id).int(), grids if len(grids) else None
        )
        got = mrope_positions(ids[0], processor.image_token_id, grids, processor.merge_size)
        assert torch.equal(got, want[:, 0])
    with pytest.raises(ValueError, match="needs 4 placeholders"):
        mrope_positions([processor.image_token_id] * 3, processor.image_token_id, torch.tensor([[1, 4, 4]]), 2)


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_packed_logprobs_with_images_equal_transformers_per_sample(name):
    model, processor = build_tiny_vision_model(name)
    batch = micro_batch(processor)
    want = per_sample_reference(model, processor, batch)
    decoder_only = copy.deepcopy(model)
    enable_packed_attention(model)  # the whole model: the vision tower calls "rlx_varlen" once per image
    set_decoder_attention(decoder_only, PACKED_ATTENTION)  # the tower stays on sdpa
    for packed_model, impl in [(model, "naive"), (model, "chunked"), (decoder_only, "naive")]:
        logprob, entropy = packed_logprobs(packed_model, batch, impl)
        for i, (want_logprob, want_entropy) in enumerate(want):
            n = len(want_logprob)
            torch.testing.assert_close(logprob[i, :n], want_logprob, atol=1e-5, rtol=0)
            torch.testing.assert_close(entropy[i, :n], want_entropy, atol=1e-5, rtol=0)
    # the images matter: the same row without them (placeholders embedded as text) is far off
    text_only, _ = packed_response_logprobs(model, **batch["tensors"], temperature=1.0, dtype=torch.float32)
    assert (text_only[1, :3] - want[1][0]).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen3_vl"])
def test_frozen_vision_tower_gets_no_gradient(name):
    model, processor = build_tiny_vision_model(name)
    enable_packed_attention(model)
    batch = micro_batch(processor)
    tower = {id(p) for m in vision_family_of(model.config).vision_tower(model) for p in m.parameters()}
    for frozen in (True, False):
        model.zero_grad(set_to_none=True)
        assert freeze_vision_tower(model, frozen) == len(tower)
        logprob, _ = packed_logprobs(model, batch)
        (logprob * batch["tensors"]["response_mask"]).sum().backward()
        for param in model.parameters():
            if id(param) in tower and frozen:
                assert param.grad is None
        tower_grads = [p.grad for p in model.parameters() if id(p) in tower and p.grad is not None]
        decoder_grads = [p.grad for p in model.parameters() if id(p) not in tower and p.grad is not None]
        assert decoder_grads and all(torch.isfinite(g).all() for g in decoder_grads)
        assert sum(g.abs().sum() for g in decoder_grads) > 0
        if not frozen:
            assert len(tower_grads) == len(tower) and sum(g.abs().sum() for g in tower_grads) > 0


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen3_vl"])
def test_repeated_images_go_through_a_frozen_tower_once(name, monkeypatch):
    """A batch holding each image several times (a prompt's N samples) runs a frozen tower (or one under no_grad)
    on each image once; every copy's rows (and Qwen3-VL's DeepStack rows) equal the tower's on the whole batch, bit
    for bit. A tower that trains sees every copy."""
    import rlx.models.vision.features as features

    model, processor = build_tiny_vision_model(name)
    prompts = [chat(image_part(16, 24, 2), "a"), chat("b", image_part(24, 32, 3), image_part(16, 16, 4))]
    encoded = [processor.encode(p, prompt_id=str(i)).vision for i, p in enumerate(prompts)]
    vision = VisionInputs.concat(encoded * 3 + [encoded[1]])  # 11 images, 3 unique
    seen, tower = [], features._tower
    monkeypatch.setattr(
        features, "_tower", lambda m, b, pixels, grids: seen.append(len(grids)) or tower(m, b, pixels, grids)
    )
    backbone = getattr(model, model.base_model_prefix)
    whole = features._concat(tower(model, backbone, vision.pixel_values, vision.image_grid_thw))
    with torch.no_grad():
        once = features.image_features(model, vision)
    freeze_vision_tower(model, True)
    frozen = features.image_features(model, vision)
    assert seen == [3, 3]
    for got in (once, frozen):
        assert torch.equal(got.embeds, whole.embeds) and len(got.deepstack) == len(whole.deepstack)
        assert all(torch.equal(a, b) for a, b in zip(got.deepstack, whole.deepstack))
    assert len(whole.deepstack) == (name == "qwen3_vl")
    freeze_vision_tower(model, False)
    features.image_features(model, vision)
    assert seen == [3, 3, 11]


def test_only_equal_pixels_count_as_copies():
    """Copies are found by grid and a fingerprint (sum, sum of squares), then confirmed: an image with the same
    pixels shuffled has the same fingerprint but is not a copy; another grid with the same pixels is not either."""
    from rlx.models.vision.features import _first_copies

    a = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    shuffled = a.flip(0)  # the same values: the same sum and sum of squares
    patches = (a, a.clone(), shuffled, a.clone(), a.clone())
    grids = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 3, 2], [1, 2, 3]])
    assert _first_copies(patches, grids) == [0, 0, 2, 3, 0]
    assert _first_copies((a, shuffled), grids[:2]) == [0, 1]


# --- the compact batch form ------------------------------------------------------------------------------


def test_vision_inputs_select_micro_batches():
    processor = tiny_vision_processor("qwen2_vl")
    vision = micro_batch(processor)["vision"]
    assert vision.images_per_sample == (0, 1, 2) and vision.num_images == 3
    part = vision.select([2, 0])
    assert part.images_per_sample == (2, 0) and part.image_grid_thw.tolist() == [[1, 4, 6], [1, 6, 8]]
    assert torch.equal(part.pixel_values, vision.pixel_values[16:])
    assert vision.select([0]).pixel_values is None and vision.sample(1).pixel_values.shape[0] == 16


def test_vision_inputs_from_image_refs_of_rollouts(tmp_path):
    processor = tiny_vision_processor("glm4v")
    for i, (h, w) in enumerate([(16, 16), (24, 40)]):
        random_image(h, w, i).save(tmp_path / f"img{i}.png")
    a, b = str(tmp_path / "img0.png"), str(tmp_path / "img1.png")
    refs = [[a], [a], [], [b, a]]  # two responses of one prompt share its image
    got = processor.vision_inputs(refs, ["p/0", "p/1", "q/0", "r/0"])
    want = VisionInputs.concat(
        [processor.encode(chat(*[{"type": "image", "image": r} for r in s])).vision for s in refs]
    )
    assert got.images_per_sample == (1, 1, 0, 2) and torch.equal(got.image_grid_thw, want.image_grid_thw)
    assert torch.equal(got.pixel_values, want.pixel_values)
    with pytest.raises(UserError, match=r"prompt 'r/0': image '.*gone.png' does not exist"):
        processor.vision_inputs([[str(tmp_path / "gone.png")]], ["r/0"])


def test_vision_inputs_round_trip_through_safetensors(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    processor = tiny_vision_processor("qwen2_5_vl")
    paths = []
    for i, (h, w) in enumerate([(16, 16), (24, 40)]):
        random_image(h, w, i).save(tmp_path / f"img{i}.png")
        paths.append(str(tmp_path / f"img{i}.png"))
    prompts = [chat("none"), chat({"type": "image", "image": "img0.png"}, {"type": "image", "image": "img1.png"})]
    encoded = [processor.encode(p, prompt_id=i, base=tmp_path) for i, p in enumerate(prompts)]
    assert encoded[1].image_refs == paths
    vision = VisionInputs.concat([e.vision for e in encoded])
    for store_pixels in (False, True):
        tensors, metadata = to_tensors(vision, [e.image_refs for e in encoded], store_pixels=store_pixels)
        save_file(tensors, tmp_path / "batch.safetensors", metadata=metadata)
        with safe_open(tmp_path / "batch.safetensors", "pt") as f:
            loaded = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a mapping
            header = f.metadata()
        assert ("vision/pixel_values" in loaded) == store_pixels
        got, refs = from_tensors(loaded, header, processor, source="batch.safetensors")
        assert refs == [[], paths] and got.images_per_sample == (0, 2)
        assert torch.equal(got.pixel_values, vision.pixel_values)
    random_image(40, 40, 9).save(tmp_path / "img1.png")  # the file changed since the batch was written
    references_only = {k: v for k, v in loaded.items() if k != "vision/pixel_values"}
    message = r"batch.safetensors: sample 's1': image '.*img1.png' now gives patch grid \[1, 10, 10\]"
    with pytest.raises(UserError, match=message):
        from_tensors(references_only, header, processor, source="batch.safetensors", sample_ids=["s0", "s1"])


# --- Ulysses sequence parallelism ------------------------------------------------------------------------


@pytest.mark.slow  # one torchrun of 2 ranks over the six families and MLA: about 30 s on 2 CPU cores
def test_sequence_parallel_with_straddling_images_equals_one_rank(tmp_path):
    run_torchrun(2, WORKERS / "vision_ulysses.py", timeout=300)


# --- MLA (the decoder of Kimi's models): value heads narrower than query/key heads ------------------------


def tiny_mla_model(seed: int = 0):
    """A tiny DeepSeek-V3 (multi-head latent attention: q/k heads 24 wide, values 12; MoE after layer 0)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=50, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
        n_group=1, topk_group=1, max_position_embeddings=128,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return DeepseekV3ForCausalLM(config).float().eval()


def test_packed_attention_takes_mla_value_heads():
    from rlx.models.attention import pack

    model = tiny_mla_model()
    sequences = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12]]
    want = torch.cat([model(input_ids=torch.tensor([s])).logits[0] for s in sequences])
    enable_packed_attention(model)
    got = model(**pack(sequences).model_inputs()).logits[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_varlen_kernels_take_mla_value_heads(monkeypatch):
    """bfloat16 on CUDA: values 128 wide with queries/keys 192 wide (DeepSeek-V3 / Kimi) through a varlen
    kernel (values zero-padded) against the per-sample loop, forward and backward."""
    from rlx.models import attention

    kernels = {"torch_varlen": attention.varlen_attn, "flash_attn": attention.flash_attn_varlen_func}
    backends = [name for name, kernel in kernels.items() if kernel is not None]
    g = torch.Generator(device="cuda").manual_seed(0)
    cu_seqlens = torch.tensor([0, 100, 164, 301], dtype=torch.int32, device="cuda")
    shapes = [(301, 4, 192), (301, 4, 192), (301, 4, 128)]
    inputs = [torch.randn(s, generator=g, device="cuda", dtype=torch.bfloat16) for s in shapes]
    results = {}
    for name in [*backends, "sdpa"]:
        monkeypatch.setenv(attention.KERNEL_ENV, name)
        q, k, v = (t.detach().requires_grad_() for t in inputs)
        out = attention.varlen_attention(q, k, v, cu_seqlens, 137, scale=192**-0.5)
        out.float().square().sum().backward()
        results[name] = [out.float(), q.grad.float(), k.grad.float(), v.grad.float()]
    assert results["sdpa"][0].shape == (301, 4, 128)
    for name in backends:
        for got, want in zip(results[name], results["sdpa"]):
            assert ((got - want).norm() / want.norm()).item() < 2e-2, name


# --- the shapes task and its reward ----------------------------------------------------------------------


def shapes_in(image: Image.Image) -> list[tuple[str, str]]:
    """(shape, colour) of each shape drawn in `image`, read back from its pixels: connected regions of one
    colour, told apart by how much of their bounding box they fill (square 1, circle ~0.78, triangle ~0.5)."""
    from rlx.tasks.shapes import COLOURS

    pixels = np.asarray(image)
    found = []
    for colour, rgb in COLOURS.items():
        mask = (pixels == np.array(rgb)).all(-1)
        seen = np.zeros_like(mask)
        for y, x in zip(*np.nonzero(mask)):
            if seen[y, x]:
                continue
            stack, region = [(y, x)], []
            seen[y, x] = True
            while stack:
                a, b = stack.pop()
                region.append((a, b))
                for c, d in ((a + 1, b), (a - 1, b), (a, b + 1), (a, b - 1)):
                    if 0 <= c < mask.shape[0] and 0 <= d < mask.shape[1] and mask[c, d] and not seen[c, d]:
                        seen[c, d] = True
                        stack.append((c, d))
            ys, xs = [p[0] for p in region], [p[1] for p in region]
            fill = len(region) / ((max(ys) - min(ys) + 1) * (max(xs) - min(xs) + 1))
            found.append(("triangle" if fill < 0.65 else "circle" if fill < 0.92 else "square", colour))
    return found


def test_shapes_answers_match_the_images():
    from rlx.tasks.shapes import COLOURS, generate_shapes

    pairs = generate_shapes(200, seed=3, max_count=4)
    assert {r["kind"] for r, _ in pairs} == {"count", "compare"}
    for record, image in pairs:
        question = record["prompt"][0]["content"][1]["text"]
        drawn = shapes_in(image)
        if record["kind"] == "count":
            target = question.split()[2]  # "How many red shapes ..." / "How many circles ..."
            count = sum(1 for s, c in drawn if (c == target if target in COLOURS else s + "s" == target))
            assert record["ground_truth"] == str(count), (record, drawn)
        else:
            first, second = record["choices"]
            counts = {c: sum(1 for _, d in drawn if d == c) for c in (first, second)}
            assert counts[first] != counts[second] and record["ground_truth"] == max(counts, key=counts.get)
    again = generate_shapes(200, seed=3, max_count=4)
    assert [r for r, _ in again] == [r for r, _ in pairs]
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for (_, a), (_, b) in zip(again, pairs))


def test_shapes_total_needs_the_image():
    """'total' (the tiny VLM recipe's kind): one question text for every image, answers 1..max_count drawn evenly,
    each the number of shapes read back from the pixels; big shapes (min_side) fill most of their cell."""
    from rlx.scoring.rewards import BUILTIN
    from rlx.tasks.shapes import generate_shapes

    pairs = generate_shapes(90, seed=4, kinds=("total",), max_count=3, size=32, grid=2, min_side=0.75)
    question = "How many shapes are there? Answer with a number."
    assert {r["prompt"][0]["content"][1]["text"] for r, _ in pairs} == {question}
    answers = [r["ground_truth"] for r, _ in pairs]
    assert sorted(set(answers)) == ["1", "2", "3"] and max(answers.count(a) for a in "123") <= 40
    for record, image in pairs:
        assert record["kind"] == "total" and record["ground_truth"] == str(len(shapes_in(image))), record
        ink = (np.asarray(image) != 255).any(-1).sum()
        assert ink >= 0.5 * 12 * 12 * len(shapes_in(image))  # every shape at least 12 pixels across (triangles: half)
    reward = BUILTIN["shapes"]
    assert reward("shapes", "3", "3")["score"] == 1.0 and reward("shapes", "2", "3")["score"] == 0.0
    generate_shapes(2, kinds=("total",), max_count=4, size=32, grid=2)  # 'total' alone: up to grid^2 shapes
    with pytest.raises(ValueError, match="2 x max_count <= grid"):
        generate_shapes(2, kinds=("total", "count"), max_count=4, size=32, grid=2)
    with pytest.raises(ValueError, match="min_side"):
        generate_shapes(2, kinds=("total",), max_count=3, size=32, grid=2, min_side=0)


def test_shapes_files_next_to_the_prompts_or_data_uris(tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "data" / "shapes.jsonl"
    command = [sys.executable, "-m", "rlx.tasks.shapes", "--num", "6", "--seed", "1", "--size", "32", "--grid", "4"]
    subprocess.run([*command, "--out", str(out)], check=True, cwd=REPO)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    refs = [image_refs(r["prompt"], r["id"])[0] for r in records]
    assert refs == [f"shapes_images/{r['id']}.png" for r in records] and (out.parent / refs[0]).is_file()
    processor = tiny_vision_processor("qwen2_vl")
    encoded = processor.encode(records[0]["prompt"], prompt_id=records[0]["id"], base=out.parent)
    assert encoded.vision.image_grid_thw.tolist() == [[1, 8, 8]] and encoded.image_refs == [str(out.parent / refs[0])]
    embedded = subprocess.run([*command, "--out", "-", "--data-uri"], check=True, cwd=REPO, capture_output=True)
    inline = [json.loads(line) for line in embedded.stdout.decode().splitlines()]
    assert [r["ground_truth"] for r in inline] == [r["ground_truth"] for r in records]
    for record, ref in zip(inline, refs):
        image = load_image(image_refs(record["prompt"])[0], prompt_id=record["id"])
        assert np.array_equal(np.asarray(image), np.asarray(load_image(ref, base=out.parent)))


def test_shapes_reward():
    from rlx.scoring.rewards import BUILTIN

    reward = BUILTIN["shapes"]
    assert reward("shapes", "I see 3 of them. 4", "4")["score"] == 1.0
    assert reward("shapes", "there are 3", "4") == {"score": 0.0, "has_answer": 1.0}
    assert reward("shapes", "no idea", "2") == {"score": 0.0, "has_answer": 0.0}
    compare = {"choices": ["red", "blue"]}
    assert reward("shapes", "Not red: Blue.", "blue", compare)["score"] == 1.0
    assert reward("shapes", "blue? no, red", "blue", compare)["score"] == 0.0
    assert reward("shapes", "green", "blue", compare) == {"score": 0.0, "has_answer": 0.0}
    assert reward("shapes", "it is blue", "blue")["score"] == 1.0  # no choices: the last word
