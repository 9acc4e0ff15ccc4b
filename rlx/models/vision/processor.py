"""VisionProcessor: chat prompts with image parts -> token ids + the model's vision inputs, without torchvision.

transformers' own processor classes (Qwen2VLProcessor, Glm4vProcessor, ...) and AutoImageProcessor need
torchvision, which rlx does not require. A VisionProcessor is the same pipeline built from parts that do
not: the family's PIL image processor (resize to a multiple of patch x merge pixels within min/max pixels,
rescale, normalise, cut into patches -> pixel_values [P, C*T*p*p] and image_grid_thw [N, 3]), the
tokenizer, and its chat template, which renders each image part as `<start><image><end>`. After
tokenizing, each image placeholder is repeated once per merged patch of its image.

Resize policy (documented for users): an image larger than `max_pixels` is scaled down, keeping its aspect
ratio, until it fits; a smaller one than `min_pixels` is scaled up; sides are rounded to multiples of
patch_size x merge_size. A prompt that is still longer than `max_prompt_tokens` is a UserError naming it.

In a model dir the image processor is `preprocessor_config.json` next to the tokenizer files (which hold the chat
template), or, as a transformers 5 processor's `save_pretrained` writes it, the `image_processor` entry of
`processor_config.json` (with the video processor's; there is no preprocessor_config.json then).
`load_vision_processor` reads either and names what is missing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from rlx.errors import UserError
from rlx.models.vision.families import VisionFamily, vision_family_of
from rlx.models.vision.images import image_refs, image_size, load_image, resolve_ref
from rlx.models.vision.inputs import VisionInputs
from rlx.models.vision.positions import image_token_count

PREPROCESSOR_FILE = "preprocessor_config.json"
PROCESSOR_FILE = "processor_config.json"
"""A whole processor's settings (transformers 5): the image processor's nested under "image_processor"."""


def image_processor_file(model_dir: Path) -> Path | None:
    """The file holding the image processor's settings: preprocessor_config.json, else a processor_config.json
    with an "image_processor" entry (what transformers' from_pretrained reads first when both exist); None."""
    nested = model_dir / PROCESSOR_FILE
    if nested.is_file():
        try:
            settings = json.loads(nested.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"{nested}: not a readable JSON file ({e})") from None
        if isinstance(settings, dict) and isinstance(settings.get("image_processor"), dict):
            return nested
    return model_dir / PREPROCESSOR_FILE if (model_dir / PREPROCESSOR_FILE).is_file() else None


@dataclass(frozen=True)
class EncodedPrompt:
    """One prompt as the model takes it."""

    input_ids: list[int]
    """Prompt tokens, each image's placeholder repeated once per merged patch."""
    vision: VisionInputs
    """The prompt's images (one sample)."""
    image_refs: list[str]
    """The images' references, resolved against the prompts file's folder (what records keep)."""


class VisionProcessor:
    """Image processor + tokenizer (+ its chat template) of one vision-language family."""

    def __init__(self, family: VisionFamily, image_processor, tokenizer):
        self.family, self.image_processor, self.tokenizer = family, image_processor, tokenizer
        self.image_token_id = tokenizer.convert_tokens_to_ids(family.image_token)
        if self.image_token_id is None or self.image_token_id == tokenizer.unk_token_id:
            raise UserError(f"the tokenizer has no {family.image_token!r} token, which {family.title} images need")
        self.merge_size = int(image_processor.merge_size)

    def with_pixels(self, min_pixels: int = 0, max_pixels: int = 0) -> VisionProcessor:
        """A processor whose resize keeps images between `min_pixels` and `max_pixels` (0 = keep the setting)."""
        if not min_pixels and not max_pixels:
            return self
        settings = self.image_processor.to_dict()
        current = self.image_processor.size
        settings["size"] = {
            "shortest_edge": min_pixels or current.shortest_edge,
            "longest_edge": max_pixels or current.longest_edge,
        }
        return VisionProcessor(self.family, type(self.image_processor).from_dict(settings), self.tokenizer)

    def load(self, ref: str, *, prompt_id=None, base: str | Path | None = None):
        """The image behind a reference (see `rlx.models.vision.images.load_image`)."""
        return load_image(ref, prompt_id=prompt_id, base=base)

    def process_images(self, images: list) -> tuple[torch.Tensor | None, torch.Tensor]:
        """PIL images -> (pixel_values [P, D] float32 or None, image_grid_thw [N, 3] int64)."""
        if not images:
            return None, torch.zeros(0, 3, dtype=torch.long)
        out = self.image_processor(images=images, return_tensors="pt")
        return out["pixel_values"].float(), out["image_grid_thw"].long()

    def images_of(self, pixel_values: torch.Tensor, grids: torch.Tensor) -> list:
        """The PIL images whose processing gives `pixel_values` and `grids` (each image's first frame): patches put
        back in place, normalisation and rescaling undone, rounded to 8 bits. The images are already at their
        resized size, so processing them again with the same settings gives the same grids and pixel values (the
        resize keeps the size; the values were 8-bit before rescaling): how engines that process images themselves
        (vLLM) get the images of requests that carry processed pixels."""
        from PIL import Image

        proc = self.image_processor
        patch, merge = int(proc.patch_size), int(proc.merge_size)
        mean = torch.tensor(proc.image_mean, dtype=torch.float64)[:, None, None]
        std = torch.tensor(proc.image_std, dtype=torch.float64)[:, None, None]
        images, start = [], 0
        for t, h, w in grids.tolist():
            rows = pixel_values[start : start + t * h * w].double()
            start += t * h * w
            channels = rows.shape[1] // (int(proc.temporal_patch_size) * patch * patch)
            x = rows[: h * w].reshape(h // merge, w // merge, merge, merge, channels, -1, patch, patch)[..., 0, :, :]
            x = x.permute(4, 0, 2, 5, 1, 3, 6).reshape(channels, h * patch, w * patch)
            x = ((x * std + mean) / proc.rescale_factor).round().clamp(0, 255).to(torch.uint8)
            images.append(Image.fromarray(x.permute(1, 2, 0).numpy()))
        return images

    def vision_inputs(self, refs_per_sample: list[list[str]], sample_ids: list | None = None) -> VisionInputs:
        """The vision inputs of samples given their (resolved) image references, as rollout records keep them;
        an image shared by several samples (the n responses of a prompt) is loaded and processed once."""
        ids = sample_ids if sample_ids is not None else list(range(len(refs_per_sample)))
        cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for refs, sample_id in zip(refs_per_sample, ids):
            for ref in refs:
                if ref not in cache:
                    pixels, grid = self.process_images([self.load(ref, prompt_id=sample_id)])
                    cache[ref] = (pixels, grid)
        flat = [ref for refs in refs_per_sample for ref in refs]
        if not flat:
            return VisionInputs.empty(len(refs_per_sample))
        return VisionInputs(
            torch.cat([cache[ref][0] for ref in flat]),
            torch.cat([cache[ref][1] for ref in flat]),
            tuple(len(refs) for refs in refs_per_sample),
        )

    def render(self, prompt, prompt_id=None, template_kwargs: dict | None = None) -> str:
        """The prompt as text through the chat template (a plain string becomes one user message; `template_kwargs`:
        extra variables for the template)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise UserError(f"prompt {prompt_id!r}: the tokenizer has no chat template to place image parts with")
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **(template_kwargs or {})
        )

    def prompt_length(self, prompt, prompt_id=None, template_kwargs: dict | None = None) -> int:
        """The tokens `encode` gives the prompt, its images' included, from the images' sizes (read from their
        headers; no pixels are decoded or processed): to check a prompt file against length limits up front."""
        ids = self.tokenizer(self.render(prompt, prompt_id, template_kwargs), add_special_tokens=False)["input_ids"]
        extra = 0
        for ref in image_refs(prompt, prompt_id):
            width, height = image_size(ref, prompt_id=prompt_id)
            extra += self.image_processor.get_number_of_image_patches(height, width) // self.merge_size**2 - 1
        return len(ids) + extra

    def expand_placeholders(self, ids: list[int], grids: torch.Tensor, prompt_id=None) -> list[int]:
        """Repeat the i-th image placeholder of `ids` once per merged patch of image i."""
        found = sum(1 for t in ids if t == self.image_token_id)
        if found != len(grids):
            raise UserError(
                f"prompt {prompt_id!r}: {len(grids)} image parts but {found} {self.family.image_token!r} placeholders "
                f"after the chat template (a text part containing {self.family.image_token!r}, or a template that "
                f"drops image parts?)"
            )
        out, image = [], 0
        for token in ids:
            if token == self.image_token_id:
                out.extend([token] * image_token_count(grids[image].tolist(), self.merge_size))
                image += 1
            else:
                out.append(token)
        return out

    def encode(self, prompt, *, prompt_id=None, base: str | Path | None = None, max_tokens: int = 0,
               template_kwargs: dict | None = None) -> EncodedPrompt:  # fmt: skip
        """A prompt (text or chat messages with image parts) -> token ids and vision inputs.
        `base`: folder (or folder URL) that relative image paths are relative to: the prompts file's;
        `template_kwargs`: extra variables for the chat template."""
        refs = [resolve_ref(ref, base) for ref in image_refs(prompt, prompt_id)]
        pixels, grids = self.process_images([self.load(ref, prompt_id=prompt_id) for ref in refs])
        ids = self.tokenizer(self.render(prompt, prompt_id, template_kwargs), add_special_tokens=False)["input_ids"]
        ids = self.expand_placeholders(list(ids), grids, prompt_id)
        if max_tokens and len(ids) > max_tokens:
            counts = [image_token_count(g.tolist(), self.merge_size) for g in grids]
            raise UserError(
                f"prompt {prompt_id!r}: {len(ids)} tokens with its images (image tokens {counts}) exceed the limit of "
                f"{max_tokens}; lower max_pixels (now {self.image_processor.size.longest_edge}) to shrink the images"
            )
        return EncodedPrompt(ids, VisionInputs(pixels, grids, (len(refs),)), refs)

    def save_pretrained(self, out: str | Path) -> None:
        """Write preprocessor_config.json and the tokenizer files (with the chat template) into `out`."""
        self.image_processor.save_pretrained(str(out))
        self.tokenizer.save_pretrained(str(out))


def _chat_template_file(model_dir: Path) -> str | None:
    """A chat template saved by a transformers processor next to the tokenizer (.jinja or .json)."""
    if (model_dir / "chat_template.jinja").is_file():
        return (model_dir / "chat_template.jinja").read_text()
    if (model_dir / "chat_template.json").is_file():
        return json.loads((model_dir / "chat_template.json").read_text()).get("chat_template")
    return None


def load_vision_processor(model_dir: str | Path, config=None) -> VisionProcessor:
    """The processor of a vision-language model dir (its config.json when `config` is None)."""
    from transformers import AutoConfig, AutoTokenizer

    model_dir = Path(model_dir)
    if config is None:
        config = AutoConfig.from_pretrained(str(model_dir))
    family = vision_family_of(config)
    settings = image_processor_file(model_dir)
    if settings is None:
        raise UserError(
            f"{model_dir}: no {PREPROCESSOR_FILE} (nor a {PROCESSOR_FILE} with an image_processor entry): the "
            f"{family.title} image processor is missing from the model dir"
        )
    try:
        image_processor = family.load_image_processor_class().from_pretrained(str(model_dir))
    except (OSError, ValueError, TypeError) as e:
        raise UserError(f"{settings}: not a {family.title} image processor config ({e})") from None
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = _chat_template_file(model_dir)
    return VisionProcessor(family, image_processor, tokenizer)


def vision_processor_for(model_dir: str | Path, config=None, options=None) -> VisionProcessor:
    """`load_vision_processor` with a `VisionConfig`'s pixel limits applied."""
    processor = load_vision_processor(model_dir, config)
    if options is not None:
        processor = processor.with_pixels(options.min_pixels, options.max_pixels)
    return processor
