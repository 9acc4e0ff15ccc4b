"""A short, stable fingerprint of a tokenizer: which token ids mean what, and how chats become ids.

Rollout records carry it (`tokenizer`), `rlx score` copies it into batch.safetensors' header, and `rlx score` and
`rlx train-step` compare it with their model's tokenizer: token ids made by one tokenizer and scored or trained
under another are nonsense even when every id is inside the vocabulary. It hashes the vocabulary (token -> id,
added tokens included), the special tokens and the chat template(s): what decides the ids, not how the tokenizer
files happen to be written. Files of older rlx versions have no fingerprint: nothing is checked then.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
import weakref

from rlx.errors import UserError

_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def tokenizer_fingerprint(tokenizer) -> str:
    """`tok-` and 16 hex digits of SHA-256 over the vocabulary, special tokens and chat template. Computed once
    per tokenizer object (again if tokens are added or the template changes)."""
    key = (len(tokenizer), repr(getattr(tokenizer, "chat_template", None)))
    with _LOCK:
        try:
            cached = _CACHE.get(tokenizer)
        except TypeError:  # not weakly referenceable
            cached = None
    if cached is not None and cached[0] == key:
        return cached[1]
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: (item[1], item[0]))
    payload = {
        "vocab": vocab,
        "special": {name: value for name, value in sorted(tokenizer.special_tokens_map.items())},
        "chat_template": getattr(tokenizer, "chat_template", None),
    }
    text = json.dumps(payload, ensure_ascii=False, sort_keys=True, default=str)
    fingerprint = "tok-" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
    with _LOCK, contextlib.suppress(TypeError):
        _CACHE[tokenizer] = (key, fingerprint)
    return fingerprint


def check_fingerprint(found: str | None, where_found: str, expected: str, where_expected: str) -> None:
    """A UserError naming both when `found` (None: an older file, not checked) is not `expected`."""
    if found is not None and found != expected:
        raise UserError(
            f"{where_found} was made with tokenizer {found}, but {where_expected} has tokenizer {expected}; "
            f"token ids of one tokenizer mean other tokens under the other (use the model that made them)"
        )


def model_signature(config) -> str:
    """A model's architecture and sizes in one line ('llama 4x64 vocab 19'): what decides whether another
    checkpoint's logprobs could be this one's (weights aside)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None) or 0
    return (
        f"{getattr(text, 'model_type', '?')} {getattr(text, 'num_hidden_layers', '?')}x"
        f"{getattr(text, 'hidden_size', '?')} vocab {getattr(text, 'vocab_size', '?')}"
        + (f" experts {experts}" if experts else "")
    )
