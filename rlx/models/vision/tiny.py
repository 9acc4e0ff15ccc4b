"""Tiny vision-language models for CPU tests and recipes, built in code for every supported family.

A tiny model is the family's real transformers class at toy size: a 2-layer decoder 64 wide with 3-D
rotary positions, and a 2-block vision tower 32 wide with 4-pixel patches merged 2 x 2 (one image token
per 8 x 8 pixels). Its processor is the family's PIL image processor at those patch sizes plus rlx's
character tokenizer extended with the family's special tokens and a chat template that renders image
parts as the family does.

    python -m rlx.models.vision.tiny --family qwen2_vl --out DIR

writes config.json, the tokenizer files and preprocessor_config.json (no weights: `rlx shard --init random`).
"""

from __future__ import annotations

import argparse
import string
from pathlib import Path

from rlx.errors import UserError
from rlx.models.tiny import build_char_tokenizer
from rlx.models.vision.families import FAMILIES, VisionFamily
from rlx.models.vision.processor import VisionProcessor

CHARS = string.ascii_letters + string.digits + string.punctuation + " \n"
PATCH_SIZE = 4
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
MIN_PIXELS = 8 * 8
MAX_PIXELS = 64 * 64

# Each part of a message: an image part becomes the family's placeholders (@IMAGE@), a text part its text.
_PARTS = (
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}@IMAGE@{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
)
_QWEN_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n" + _PARTS + "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_GLM_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n" + _PARTS + "\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def family_by_name(name: str) -> VisionFamily:
    """A supported family by its short name (qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe, glm4v, glm4v_moe)."""
    for family in FAMILIES.values():
        if family.name == name:
            return family
    raise UserError(f"unknown vision family {name!r}; expected one of {', '.join(f.name for f in FAMILIES.values())}")


def chat_template(family: VisionFamily) -> str:
    """A chat template in the family's style that renders image parts as its placeholders."""
    template = _GLM_TEMPLATE if family.name.startswith("glm4v") else _QWEN_TEMPLATE
    return template.replace("@IMAGE@", family.image_start + family.image_token + family.image_end)


def tiny_vision_tokenizer(family: VisionFamily, chars: str = CHARS):
    """rlx's character tokenizer plus the family's special tokens and chat template."""
    tokenizer = build_char_tokenizer(chars)
    tokenizer.add_special_tokens({"additional_special_tokens": list(family.special_tokens)})
    tokenizer.chat_template = chat_template(family)
    return tokenizer


def tiny_image_processor(family: VisionFamily, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS):
    """The family's PIL image processor with 4-pixel patches merged 2 x 2."""
    return family.load_image_processor_class()(
        patch_size=PATCH_SIZE,
        merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
    )


def tiny_vision_processor(family_name: str, **pixel_limits) -> VisionProcessor:
    """Tokenizer + image processor of a tiny model of `family_name`."""
    family = family_by_name(family_name)
    return VisionProcessor(family, tiny_image_processor(family, **pixel_limits), tiny_vision_tokenizer(family))


def _text_config(tokenizer, family: VisionFamily, num_layers: int, hidden_size: int) -> dict:
    """Decoder settings: GQA 4/2 heads of hidden_size / 4, mRoPE sections over the rotary half-dims (8 of them
    per 64 of width)."""
    if hidden_size < 64 or hidden_size % 64:
        raise UserError(f"tiny vision models need a hidden size that is a multiple of 64, got {hidden_size}")
    scale = hidden_size // 64
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2 * scale, 3 * scale, 3 * scale]}
    if family.name.startswith("glm4v"):  # GLM rotates half of each head: 4 frequencies in all (per 64 of width)
        rope.update(mrope_section=[scale, scale, 2 * scale], partial_rotary_factor=0.5)
    if family.name.startswith("qwen3_vl"):
        rope["mrope_interleaved"] = True
    text = dict(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden_size // 4,
        max_position_embeddings=1024, rope_parameters=rope, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    if family.name == "qwen3_vl_moe":  # 4 experts of 32, 2 per token, in every layer
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
    if family.name == "glm4v_moe":  # a dense first layer, then 4 routed experts (2 per token) + 1 shared
        text.update(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                    first_k_dense_replace=1, n_group=1, topk_group=1)  # fmt: skip
    return text


def _vision_config(family: VisionFamily, hidden_size: int) -> dict:
    """A 2-block vision tower 32 wide with 4-pixel patches merged 2 x 2, projecting to the decoder's width."""
    common = dict(
        depth=2, num_heads=2, patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
    )  # fmt: skip
    if family.name == "qwen2_vl":
        return dict(common, embed_dim=32, hidden_size=hidden_size, mlp_ratio=2)
    tower = dict(common, hidden_size=32, intermediate_size=64, out_hidden_size=hidden_size)
    if family.name == "qwen2_5_vl":  # windows of 2 x 2 merged patches, the last block attends fully
        return dict(tower, window_size=PATCH_SIZE * MERGE_SIZE * 2, fullatt_block_indexes=[1])
    if family.name.startswith("qwen3_vl"):  # a 4 x 4 learned position grid, DeepStack features from block 0
        return dict(tower, num_position_embeddings=16, deepstack_visual_indexes=[0])
    return dict(tower, image_size=16)  # glm4v: its position table covers 16 x 16 pixels (4 x 4 patches)


def tiny_vision_config(family_name: str, tokenizer=None, num_layers: int = 2, hidden_size: int = 64):
    """The family's config at toy size; special-token ids match `tokenizer` (the tiny one by default)."""
    family = family_by_name(family_name)
    tokenizer = tokenizer if tokenizer is not None else tiny_vision_tokenizer(family)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in family.special_tokens}
    video_token = family.extra_tokens[0]
    config = family.load_config_class()(
        text_config=_text_config(tokenizer, family, num_layers, hidden_size),
        vision_config=_vision_config(family, hidden_size),
        image_token_id=ids[family.image_token],
        video_token_id=ids[video_token],
        **{family.start_token_key: ids[family.image_start], family.end_token_key: ids[family.image_end]},
        tie_word_embeddings=True,
    )
    if family.name.startswith("glm4v"):
        config.video_start_token_id = ids["<|begin_of_video|>"]
        config.video_end_token_id = ids["<|end_of_video|>"]
    config.architectures = [family.model_class]
    return config


def build_tiny_vision_model(family_name: str, seed: int = 0, **config_kwargs):
    """(model in float32 eval mode with seeded random weights, its VisionProcessor)."""
    import torch

    processor = tiny_vision_processor(family_name)
    config = tiny_vision_config(family_name, processor.tokenizer, **config_kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = processor.family.load_model_class()(config).float().eval()
    return model, processor


def write_tiny_vision_model_dir(out: str | Path, family_name: str, **config_kwargs) -> Path:
    """config.json + tokenizer files + preprocessor_config.json of a tiny model (no weights) in `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    processor = tiny_vision_processor(family_name)
    tiny_vision_config(family_name, processor.tokenizer, **config_kwargs).save_pretrained(out)
    processor.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", required=True, choices=[f.name for f in FAMILIES.values()])
    parser.add_argument("--out", required=True, help="folder to write")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    args = parser.parse_args()
    write_tiny_vision_model_dir(args.out, args.family, hidden_size=args.hidden_size, num_layers=args.num_layers)


if __name__ == "__main__":
    main()
