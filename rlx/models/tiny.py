"""Tiny models for the CPU quickstart and tests: a character tokenizer built in code and a small Llama config.

`python -m rlx.models.tiny --out DIR` writes config.json and the tokenizer files (no weights;
`rlx shard --init random` or `init = "random"` in a recipe initialises them).
"""

from __future__ import annotations

import argparse
from pathlib import Path

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
ARITH_CHARS = "0123456789+-*= "


def build_char_tokenizer(chars: str = ARITH_CHARS):
    """A fast tokenizer with one token per character: <pad>=0, <bos>=1, <eos>=2, <unk>=3, then `chars`.

    Encoding prepends <bos>; decoding joins characters without spaces.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in chars:
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


def tiny_llama_config(
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_positions: int = 64,
):
    """A small Llama config (GQA, tied embeddings) whose special ids match `build_char_tokenizer`."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def write_tiny_model_dir(out: str | Path, chars: str = ARITH_CHARS, **config_kwargs) -> Path:
    """Write config.json + tokenizer files for a tiny model (no weights) into `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer(chars)
    tiny_llama_config(len(tokenizer), **config_kwargs).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder to write")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    args = parser.parse_args()
    write_tiny_model_dir(args.out, hidden_size=args.hidden_size, num_layers=args.num_layers)


if __name__ == "__main__":
    main()
