"""Turn prompt records into token ids: chat template when the tokenizer has one, raw text otherwise."""

from __future__ import annotations

from rlx.engine.records import PromptRecord
from rlx.errors import UserError


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_prompt(tokenizer, record: PromptRecord, mode: str) -> list[int]:
    """Token ids for one prompt.  mode: 'auto' | 'on' | 'off' (see RolloutConfig.chat_template)."""
    use_template = mode == "on" or (mode == "auto" and has_chat_template(tokenizer))
    if use_template and not has_chat_template(tokenizer):
        raise UserError("--chat-template on: the tokenizer has no chat template")
    if use_template:
        messages = record.prompt if isinstance(record.prompt, list) else [{"role": "user", "content": record.prompt}]
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
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
