"""Shared by the multi-turn tests: tiny chat models whose turns end (no training), toy environments, mask spans.

- `random_chat_model`: random weights, untied output head; one embedding dimension is constant, and
  the head reads it to forbid the special and markup tokens and to make <|im_end|> likely, so sampled
  turns are short gibberish that stops.
- `bigram_chat_model`: the output depends on the last token only (attention and MLP outputs zeroed,
  one-hot embeddings), and the head maps each token of a script to the next one: greedy or sampled,
  every turn is that script.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from rlx.formats.records import PromptRecord
from rlx.models.tiny import SPECIAL_TOKENS
from rlx.models.tiny_chat import MARKUP_TOKENS, build_chat_tokenizer, tiny_chat_config


def _build(tokenizer, seed: int, **config_kwargs):
    config = tiny_chat_config(tokenizer, **config_kwargs)
    config.tie_word_embeddings = False
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def random_chat_model(style: str | None = "qwen2.5", seed: int = 0, stop_bias: float = 0.3, **config_kwargs):
    """(model, tokenizer): random weights whose sampled turns end with <|im_end|> after a few tokens
    (`config_kwargs`: tiny_llama_config's, e.g. num_heads)."""
    tokenizer = build_chat_tokenizer(style)
    model = _build(tokenizer, seed, **{"max_positions": 512, **config_kwargs})
    banned = tokenizer.convert_tokens_to_ids([*SPECIAL_TOKENS, "<|im_start|>", *MARKUP_TOKENS])
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0  # a constant direction the head can read as a bias
        head = model.lm_head.weight
        head[:, 0] = 0.0
        head[banned, 0] = -10.0
        head[tokenizer.eos_token_id, 0] = stop_bias
    return model, tokenizer


def bigram_chat_model(script: str, style: str | None = "qwen2.5", extra_tokens: tuple[str, ...] = ()):
    """(model, tokenizer) that continues every token of `script` (whose tokens must each occur once, but
    for the first) with the next one, and any other token with <|im_end|>. `extra_tokens` are added to
    the tokenizer first (multi-character tokens let a script repeat characters)."""
    tokenizer = build_chat_tokenizer(style)
    tokenizer.add_tokens(list(extra_tokens))
    vocab = len(tokenizer)
    model = _build(tokenizer, 0, hidden_size=-(-(vocab + 1) // 8) * 8, num_layers=1, intermediate_size=16)
    ids = tokenizer(script, add_special_tokens=False)["input_ids"]
    assert len(set(ids[1:])) == len(ids) - 1, f"a token repeats in the script {script!r}"
    following = dict(zip(ids[:-1], ids[1:]))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embedding = model.model.embed_tokens.weight
        embedding.zero_()
        embedding[:, 0] = 1.0
        embedding[torch.arange(vocab), torch.arange(vocab) + 1] = 1.0
        head = model.lm_head.weight
        head.zero_()
        for token in range(vocab):
            head[following.get(token, tokenizer.eos_token_id), token + 1] = 10.0
    return model, tokenizer


def token_engine(model, tokenizer, engine: str = "hf", **settings):
    """A rollout engine (`engine`: hf, native) around the model in this process: its token-level call."""
    from rlx.rollout.config import RolloutConfig
    from tests.conftest import flat_config, make_engine

    return make_engine(model, tokenizer, flat_config(RolloutConfig, engine=engine, **settings))


ENVS = '''
import time

class Echo:
    """A tool result and 'again' after each turn; the episode ends at the third assistant turn."""

    def __init__(self, record):
        self.question, self.turns = record["prompt"], 0

    def reset(self):
        return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": self.question}]

    def step(self, message):
        assert message["role"] == "assistant" and isinstance(message["content"], str)
        self.turns += 1
        if self.turns == 3:
            return [], 1.0, True
        return [{"role": "tool", "content": str(self.turns)}, {"role": "user", "content": "again"}], 0.25, False


class NeverStepped(Echo):
    def step(self, message):
        raise AssertionError("step() must not run")


class Raises(Echo):
    def step(self, message):
        raise ValueError("boom")


class Slow(Echo):
    def step(self, message):
        time.sleep(1.0)
        return [], 0.0, True


class BadReward(Echo):
    def step(self, message):
        return [], "1", False


class BadReset(Echo):
    def reset(self):
        return "hello"


class NoStep:
    def __init__(self, record):
        pass

    def reset(self):
        return [{"role": "user", "content": "hi"}]


NOT_CALLABLE = 3
'''

QUESTIONS = [PromptRecord(id=f"q{i}", prompt=f"say {i}") for i in range(2)]


def spans(mask: list[int]) -> list[tuple[int, int, int]]:
    """(start, end, value) of each run of equal values in a loss mask."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((start, i, mask[start]))
            start = i
    return out


# A turn calling the calculator: each piece one token, so a bigram model can write it.
CALC_PIECES = ('{"name": ', '"calculator"', ', "arguments": ', '{"expression": ', '"12*34"', "}}")
CALC_SCRIPT = "\n<tool_call>" + "".join(CALC_PIECES) + "</tool_call><|im_end|>"
