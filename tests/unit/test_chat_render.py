"""A turn's template tokens without Jinja: the framed render gives exactly the ids of the full render
(render(anchor + new) minus render(anchor)) for random texts under every template the multi-turn tests use,
is taken for shapes seen before (shared by later renderers), and is refused where the template looks at a text."""

from __future__ import annotations

import random

import pytest

from rlx.chat.template_shapes import probe_frame, shape_key
from rlx.chat.trajectory import _ANCHORS, ChatRenderer
from rlx.errors import UserError
from rlx.models.tiny_chat import build_chat_tokenizer
from rlx.tasks.calculator import CalculatorEnv
from tests.unit.test_agent import STRICT_TEMPLATE

PLAIN_TEMPLATE = (
    "{%- for m in messages %}{{- m.role + ': ' + m.content + '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'assistant: ' }}{%- endif %}"
)
TOOL_ID_TEMPLATE = (  # pastes tool_call_id too
    "{%- for m in messages %}{{- '<|im_start|>' + m.role }}{%- if m.tool_call_id is defined %}"
    "{{- ' ' + m.tool_call_id }}{%- endif %}{{- '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# (style, template to set instead of the style's, tools, template arguments)
TEMPLATES = {
    "qwen2.5": ("qwen2.5", None, None, {}),
    "qwen2.5 tools": ("qwen2.5", None, CalculatorEnv.tools, {}),
    "qwen3": ("qwen3", None, None, {}),
    "qwen3 no thinking, tools": ("qwen3", None, CalculatorEnv.tools, {"enable_thinking": False}),
    "strict": ("qwen2.5", STRICT_TEMPLATE, None, {}),
    "plain": ("qwen2.5", PLAIN_TEMPLATE, None, {}),
}
SHAPES = (("tool", "user"), ("user",), ("tool",), ("tool", "tool", "user"), ("assistant", "user"), ("system", "user"))
PARTS = (
    "a", "word", " ", "  ", "\n", "\n\n", "\t", "<|im_end|>", "<|im_start|>", "<tool_call>", "</tool_response>",
    "<think>", "</think>", "é", "日本", '"', "\\", "{{ x }}", "{%", "rlx-probe-0-a", "90007319046285", "user", "12",
)  # fmt: skip


def random_text(rng: random.Random) -> str:
    return "".join(rng.choice(PARTS) for _ in range(rng.choice((0, 1, 2, 3, 6))))


def reference_ids(tokenizer, tools, template_kwargs, messages) -> list[int] | str:
    """The rule by hand: the tokens after the first anchor that renders before `messages` and whose tokens
    the render extends; the error's text when none does."""

    def ids(conversation, add_generation_prompt):
        text = tokenizer.apply_chat_template(
            conversation, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    for anchor in _ANCHORS:
        try:
            base, full = ids(anchor, False), ids([*anchor, *messages], True)
        except Exception:
            continue
        if full[: len(base)] == base:
            return full[len(base) :]
    return "error"


def renderer_for(name: str) -> ChatRenderer:
    style, template, tools, template_kwargs = TEMPLATES[name]
    tokenizer = build_chat_tokenizer(style)
    if template is not None:
        tokenizer.chat_template = template
    return ChatRenderer(tokenizer, {tokenizer.eos_token_id}, tools, template_kwargs)


def message_ids_or_error(renderer: ChatRenderer, messages: list[dict]) -> list[int] | str:
    try:
        return renderer.message_ids(messages)
    except UserError:
        return "error"


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_framed_ids_equal_the_full_render_for_random_texts(name):
    renderer = renderer_for(name)
    rng = random.Random(name)
    for roles in SHAPES:
        for _ in range(12):
            messages = [{"role": role, "content": random_text(rng)} for role in roles]
            expected = reference_ids(renderer.tokenizer, renderer.tools, renderer.template_kwargs, messages)
            assert message_ids_or_error(renderer, messages) == expected, (name, messages)
    assert renderer.num_framed_renders > 0


def test_tool_call_ids_are_pasted_texts_too():
    tokenizer = build_chat_tokenizer("qwen2.5")
    tokenizer.chat_template = TOOL_ID_TEMPLATE
    renderer = ChatRenderer(tokenizer, {tokenizer.eos_token_id})
    rng = random.Random(0)
    for turn in range(20):
        messages = [{"role": "tool", "tool_call_id": f"call_{turn}_0", "content": random_text(rng)}]
        assert renderer.message_ids(messages) == reference_ids(tokenizer, None, {}, messages)
    assert renderer.num_framed_renders == 20


def test_framed_render_is_taken_and_shared_by_later_renderers():
    renderer = renderer_for("qwen3 no thinking, tools")
    replies = [{"role": "tool", "content": "408"}, {"role": "user", "content": "Next."}]
    first = renderer.message_ids(replies)
    assert renderer.num_framed_renders == 1
    later = ChatRenderer(renderer.tokenizer, renderer.stop_ids, renderer.tools, renderer.template_kwargs)
    assert later.message_ids([{"role": "tool", "content": "409"}, {"role": "user", "content": "Next."}]) != first
    assert later.num_framed_renders == 1 and later._state is renderer._state
    other_tools = ChatRenderer(renderer.tokenizer, renderer.stop_ids, None, renderer.template_kwargs)
    assert other_tools._state is not renderer._state  # the tools are listed in the anchor's system turn
    assert other_tools.message_ids(replies) == reference_ids(
        renderer.tokenizer, None, renderer.template_kwargs, replies
    )
    # a shape with a non-plain value renders in full
    odd = [{"role": "user", "content": "hi", "extra": object()}]
    assert shape_key(odd) is None
    assert renderer.message_ids(odd) == reference_ids(renderer.tokenizer, renderer.tools, renderer.template_kwargs, odd)


LOOKING_TEMPLATES = {  # each reads the content, so the probe refuses it
    "trim": "{%- for m in messages %}{{- m.role + '\\n' + m.content | trim + '\\n' }}{%- endfor %}",
    "in": "{%- for m in messages %}{%- if 'x' in m.content %}X{%- endif %}{{- m.content + '\\n' }}{%- endfor %}",
    "truthiness": "{%- for m in messages %}{{- (m.content or 'nothing') + '\\n' }}{%- endfor %}",
    "via ~": "{%- for m in messages %}{%- set t = m.content ~ '' %}{{- t.upper() + '\\n' }}{%- endfor %}",
    "tojson": "{%- for m in messages %}{{- m.content | tojson + '\\n' }}{%- endfor %}",
    "int": "{%- for m in messages %}{{- m.content + ((m.content | int) > 5) | string + '\\n' }}{%- endfor %}",
    "length": "{%- for m in messages %}{{- m.content + (m.content | length) | string + '\\n' }}{%- endfor %}",
}


@pytest.mark.parametrize("name", list(LOOKING_TEMPLATES))
def test_templates_that_look_at_the_content_render_in_full(name):
    tokenizer = build_chat_tokenizer("qwen2.5")
    tokenizer.chat_template = LOOKING_TEMPLATES[name]
    renderer = ChatRenderer(tokenizer, {tokenizer.eos_token_id})
    for content in ("x", " 7 ", "", "abc\n", "12"):
        messages = [{"role": "user", "content": content}]
        assert renderer.message_ids(messages) == reference_ids(tokenizer, None, {}, messages)
    assert renderer.num_framed_renders == 0
    assert set(renderer._state.frames.values()) == {None}


def test_qwen3_assistant_content_is_split_on_think_so_it_renders_in_full():
    renderer = renderer_for("qwen3")
    messages = [{"role": "assistant", "content": "<think>\nhm\n</think>\n\nok"}, {"role": "user", "content": "go"}]
    assert renderer.message_ids(messages) == reference_ids(renderer.tokenizer, None, {}, messages)
    assert renderer.num_framed_renders == 0


def test_probe_frame_pastes_texts_and_reraises_when_every_set_fails():
    def render(messages):
        return "<" + messages[0]["content"] + "|" + messages[0]["content"] + ">"

    frame = probe_frame(render, [{"role": "user", "content": "a"}], anchor=2)
    assert frame.anchor == 2 and frame.text(["ab"]) == "<ab|ab>"

    def refuse(messages):
        raise UserError("no")

    with pytest.raises(UserError, match="no"):
        probe_frame(refuse, [{"role": "user", "content": "a"}], anchor=0)


def trained_tokenizer(pre_tokenizer):
    """A small BPE tokenizer trained here, with chat special tokens and a non-special added token."""
    from tokenizers import Tokenizer, models, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizer
    corpus = ["user assistant tool result next answer briefly\n\n  the a an 12 34 <tool_response>"] * 20
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<|im_start|>", "<|im_end|>"])
    backend.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.add_tokens(["<tool_response>"])
    return tokenizer


@pytest.mark.parametrize("scheme", ["byte-level", "metaspace-first"])
def test_token_cuts_split_the_ids_exactly(scheme):
    from tokenizers import AddedToken, pre_tokenizers

    from rlx.chat.token_cuts import TokenCuts

    pre = pre_tokenizers.ByteLevel(add_prefix_space=True) if scheme == "byte-level" else None
    tokenizer = trained_tokenizer(pre or pre_tokenizers.Metaspace(prepend_scheme="first"))
    cuts = TokenCuts(tokenizer)
    assert cuts.is_usable and cuts.longest == len("<|im_start|>")

    def encode(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    rng = random.Random(scheme)
    parts = ("<|im_start|>", "<|im_end|>", "<|im_", "end|>", " ", "\n", "user", "a b", "<tool_response>")
    num_cuts = 0
    for _ in range(150):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(1, 8)))
        for at in range(len(text) + 1):
            if cuts.is_cut(text, at):
                num_cuts += 1
                assert encode(text) == encode(text[:at]) + encode(text[at:]), (text, at)
    assert num_cuts > 100
    assert not cuts.is_cut("<|im_end|>", 6) and not cuts.is_cut("a<|im_end|>", 0) and cuts.is_cut("a<|im_end|>", 1)
    tokenizer.add_special_tokens({"additional_special_tokens": [AddedToken("|>", normalized=False)]})
    assert not TokenCuts(tokenizer).is_cut("a<|im_end|>", 9)  # "|>" starts there, but inside "<|im_end|>"
    assert TokenCuts(tokenizer).is_cut("a<|im_end|>|>", 11)
    tokenizer.add_special_tokens({"additional_special_tokens": [AddedToken("<x>", lstrip=True, normalized=False)]})
    assert not TokenCuts(tokenizer).is_usable  # a token that eats the spaces before it
