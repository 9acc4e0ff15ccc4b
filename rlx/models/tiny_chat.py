"""A character tokenizer with chat special tokens and two chat templates, for multi-turn tests and CPU recipes.

The templates are written for rlx and follow the token layout of the Qwen2.5 and Qwen3 families
(`<|im_start|>role\\n...<|im_end|>\\n` turns, tools listed in the system turn, `<tool_call>` blocks
holding `{"name": ..., "arguments": ...}`, tool results inside `<tool_response>` in a user turn). Tools
are listed compactly, one `name(arg, ...)` line each, to keep contexts short for tiny CPU models.

- 'qwen2.5': the history renders the same whatever follows it (each turn extends the previous one).
- 'qwen3': assistant turns may open with a `<think>...</think>` block, which is dropped from every
  assistant message before the last user message, so a conversation re-rendered after a new user
  message no longer starts with the tokens the model saw (the multi-turn drift rlx must not train on).
  `enable_thinking=False` (a template argument) pre-fills an empty think block in the generation prompt.
"""

from __future__ import annotations

import string

from rlx.models.tiny import build_char_tokenizer, tiny_llama_config

CHAT_CHARS = "".join(ch for ch in string.printable if ch not in "\x0b\x0c\r")
END_OF_TURN = "<|im_end|>"
SPECIAL_CHAT_TOKENS = ("<|im_start|>", END_OF_TURN)
# not special: they stay in decoded text (skip_special_tokens=True), where tool-call parsers read them
MARKUP_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")

_SYSTEM_AND_TOOLS = (
    "{%- if messages and messages[0].role == 'system' %}{%- set system_text = messages[0].content %}"
    "{%- set first = 1 %}{%- else %}{%- set system_text = '' %}{%- set first = 0 %}{%- endif %}"
    "{%- if system_text or tools %}"
    "{{- '<|im_start|>system\\n' + system_text }}"
    "{%- if tools %}"
    "{{- ('\\n\\n' if system_text else '') + 'Tools:\\n<tools>' }}"
    "{%- for tool in tools %}{%- set fn = tool.function if tool.function is defined else tool %}"
    "{{- '\\n' + fn.name + '(' + (((fn.parameters or {}).properties or {}) | list | join(', ')) + ')' }}"
    "{%- endfor %}"
    "{{- '\\n</tools>' }}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
)

_TOOL_CALLS = (
    "{%- for call in (message.tool_calls or []) %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{{- ('\\n' if (body or not loop.first) else '') + '<tool_call>\\n{\"name\": \"' + fn.name }}"
    '{{- \'", "arguments": \' }}'
    "{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
)

_TOOL_RESULT = (
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
)

QWEN25_STYLE_TEMPLATE = (
    _SYSTEM_AND_TOOLS + "{%- for message in messages %}{%- if loop.index0 >= first %}"
    "{%- if message.role == 'assistant' %}"
    "{%- set body = message.content or '' %}"
    "{{- '<|im_start|>assistant\\n' + body }}" + _TOOL_CALLS + "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}" + _TOOL_RESULT + "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

QWEN3_STYLE_TEMPLATE = (
    _SYSTEM_AND_TOOLS + "{%- set ns = namespace(last_query=-1) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_query = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}{%- if loop.index0 >= first %}"
    "{%- if message.role == 'assistant' %}"
    "{%- set text = message.content or '' %}{%- set thought = '' %}"
    "{%- if '</think>' in text %}"
    "{%- set thought = text.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set text = text.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query and (loop.last or thought) %}"
    "{%- set body = '<think>\\n' + thought + '\\n</think>\\n\\n' + text %}"
    "{%- else %}{%- set body = text %}{%- endif %}"
    "{{- '<|im_start|>assistant\\n' + body }}" + _TOOL_CALLS + "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}" + _TOOL_RESULT + "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

CHAT_TEMPLATES = {"qwen2.5": QWEN25_STYLE_TEMPLATE, "qwen3": QWEN3_STYLE_TEMPLATE}


def build_chat_tokenizer(style: str | None = "qwen2.5"):
    """The character tokenizer over printable ASCII plus chat tokens; `<|im_end|>` is EOS (ends a turn).

    style: 'qwen2.5', 'qwen3', or None for a tokenizer without a chat template."""
    if style is not None and style not in CHAT_TEMPLATES:
        raise ValueError(f"style must be one of {', '.join(CHAT_TEMPLATES)} or None, got {style!r}")
    from tokenizers import Regex, pre_tokenizers

    tokenizer = build_char_tokenizer(CHAT_CHARS)
    # one piece per character, newlines included ('.' alone would leave "\n\n" as one unknown piece)
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_CHAT_TOKENS)})
    tokenizer.add_tokens(list(MARKUP_TOKENS))
    tokenizer.eos_token = END_OF_TURN
    if style is not None:
        tokenizer.chat_template = CHAT_TEMPLATES[style]
    return tokenizer


def tiny_chat_config(tokenizer, **config_kwargs):
    """A tiny Llama config for `build_chat_tokenizer`'s vocabulary, stopping at `<|im_end|>`."""
    config = tiny_llama_config(len(tokenizer), **{"max_positions": 1024, **config_kwargs})
    config.eos_token_id = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    return config
