"""Prompt lengths against the limits: `max_prompt_length`, and prompt + `max_new_tokens` against the model's
context (its `max_position_embeddings`). Applied to a whole prompt file before any generation, the same way by
`rlx rollout`, `rlx eval` and `rlx ppo` (so the driver and a shell pipeline pick from the same list): each too-long
prompt is an error naming it and the count, or (`on_long_prompt = "filter"`) left out with the count printed."""

from __future__ import annotations

from rlx.errors import UserError
from rlx.formats.records import PromptRecord
from rlx.models.vision.families import family_for_prompt
from rlx.models.vision.images import image_refs
from rlx.observe.tracking import console
from rlx.rollout.config import RolloutConfig
from rlx.rollout.prompts import encode_prompt


def model_context(config) -> int | None:
    """The most positions the model takes (prompt + response), or None when its config does not say."""
    value = getattr(config, "max_position_embeddings", None)
    if value is None and hasattr(config, "get_text_config"):
        value = getattr(config.get_text_config(), "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def limit_reason(length: int, cfg: RolloutConfig, max_new_tokens: int, context: int | None) -> str | None:
    """Why a prompt of `length` tokens cannot be served, or None when it fits."""
    if cfg.max_prompt_length and length > cfg.max_prompt_length:
        return f"{length} tokens, over max_prompt_length {cfg.max_prompt_length}"
    if context is not None and length + max_new_tokens > context:
        return (
            f"{length} tokens + max_new_tokens {max_new_tokens} = {length + max_new_tokens} positions, over the "
            f"model's context of {context} (max_position_embeddings)"
        )
    return None


def _prompt_length(record: PromptRecord, tokenizer, cfg: RolloutConfig, processor) -> int:
    """Tokens of the encoded prompt (a vision-language prompt's images expanded when `processor` is given)."""
    if processor is not None and cfg.chat_template != "off" and image_refs(record.prompt, record.id):
        return processor.prompt_length(record.prompt, record.id, cfg.agent.chat_template_kwargs)
    return len(encode_prompt(tokenizer, record, cfg.chat_template, cfg.agent.chat_template_kwargs))


def limit_prompts(
    records: list[PromptRecord],
    tokenizer,
    cfg: RolloutConfig,
    context: int | None,
    where: str,
    max_new_tokens: int | None = None,
    config=None,
    processor=None,
) -> list[PromptRecord]:
    """`records` whose encoded prompt fits the limits; the others raise a UserError (on_long_prompt 'error')
    or are left out, counted on the console ('filter'). `max_new_tokens` defaults to cfg's. With the model's
    `config`, image parts given to a text-only model are an error naming the prompt; with a vision-language model's
    `processor`, a prompt's image tokens count (from the images' sizes, as the engine will expand them)."""
    max_new_tokens = cfg.sampling.max_new_tokens if max_new_tokens is None else max_new_tokens
    if not cfg.max_prompt_length and context is None:
        return records
    kept, dropped = [], []
    for record in records:
        if config is not None:
            family_for_prompt(config, record.prompt, record.id)
        reason = limit_reason(_prompt_length(record, tokenizer, cfg, processor), cfg, max_new_tokens, context)
        (kept if reason is None else dropped).append((record, reason))
    if not dropped:
        return records
    first, reason = dropped[0]
    count = f"{len(dropped)} of {len(records)} prompts"
    if cfg.on_long_prompt == "error":
        raise UserError(
            f"{where}: {count} are too long (first: prompt {first.id!r}, {reason}); shorten them, raise the "
            f"limit, or leave them out: on_long_prompt = 'filter' (--on-long-prompt filter)"
        )
    if not kept:
        raise UserError(f"{where}: all {len(records)} prompts are too long (first: prompt {first.id!r}, {reason})")
    console(f"{where}: left out {count} as too long (first: prompt {first.id!r}, {reason})")
    return [record for record, _ in kept]
