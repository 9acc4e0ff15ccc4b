"""Turn prompt records into token ids: chat template when the tokenizer has one, raw text otherwise; prompts with
image parts through a vision-language model's processor (token ids with each image's placeholders, and the
images' pixels and patch grids)."""

from __future__ import annotations

from dataclasses import dataclass

from rlx.errors import UserError
from rlx.formats.records import PromptRecord
from rlx.models.vision.families import family_for_prompt
from rlx.models.vision.images import image_refs


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_prompt(tokenizer, record: PromptRecord, mode: str, template_kwargs: dict | None = None) -> list[int]:
    """Token ids for one prompt.  mode: 'auto' | 'on' | 'off' (see RolloutConfig.chat_template); `template_kwargs`:
    extra variables for the chat template (RolloutConfig.agent.chat_template_kwargs)."""
    use_template = mode == "on" or (mode == "auto" and has_chat_template(tokenizer))
    if use_template and not has_chat_template(tokenizer):
        raise UserError("--chat-template on: the tokenizer has no chat template")
    if use_template:
        messages = record.prompt if isinstance(record.prompt, list) else [{"role": "user", "content": record.prompt}]
        encoded = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True, **(template_kwargs or {})
        )
        ids = list(encoded["input_ids"])
    elif isinstance(record.prompt, list):
        raise UserError(
            f"prompt {record.id!r} is a chat conversation but chat templates are off "
            f"(the tokenizer has none, or --chat-template off was given)"
        )
    else:
        ids = list(tokenizer(record.prompt)["input_ids"])
    if not ids:
        raise UserError(f"prompt {record.id!r} encodes to no tokens")
    return ids


@dataclass(frozen=True)
class PromptEncoder:
    """How a rollout engine turns prompt records into token ids (and images, for vision-language models)."""

    tokenizer: object
    chat_template: str = "auto"
    """'auto' | 'on' | 'off' (see RolloutConfig.chat_template)."""
    processor: object | None = None
    """The model's VisionProcessor (vision-language models), else None."""
    model_config: object | None = None
    """The model's config: image parts given to a text-only model are an error naming the prompt."""
    max_prompt_tokens: int = 0
    """Longest prompt with images, in tokens (0 = no limit): a longer one is an error naming it."""
    template_kwargs: dict | None = None
    """Extra variables for the chat template (RolloutConfig.agent.chat_template_kwargs)."""

    def encode(self, record: PromptRecord):
        """(token ids, the prompt's VisionInputs or None when it has no image)."""
        if self.model_config is not None:
            family_for_prompt(self.model_config, record.prompt, record.id)
        if not image_refs(record.prompt, record.id):
            return encode_prompt(self.tokenizer, record, self.chat_template, self.template_kwargs), None
        if self.chat_template == "off":
            raise UserError(f"prompt {record.id!r} has image parts, which only a chat template places (not 'off')")
        if self.processor is None:
            raise UserError(f"prompt {record.id!r} has image parts, but no image processor was loaded for the model")
        encoded = self.processor.encode(
            record.prompt, prompt_id=record.id, max_tokens=self.max_prompt_tokens, template_kwargs=self.template_kwargs
        )
        return encoded.input_ids, encoded.vision


def context_limit(config, max_prompt_tokens: int = 0) -> int:
    """The longest prompt a vision-language model takes: `max_prompt_tokens`, else its context length."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return max_prompt_tokens or int(getattr(text, "max_position_embeddings", 0) or 0)


def stop_token_ids(model, tokenizer) -> set[int]:
    """Token ids that end a response: the generation config's EOS ids, else the tokenizer's EOS."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is not None:
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
            break
    if not ids and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if not ids:
        raise UserError("the model and tokenizer define no EOS token; cannot tell where responses stop")
    return ids


def pad_token_id(tokenizer) -> int:
    """The id used for padding (pad token, else EOS, else 0); padded positions are always masked."""
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    return 0
