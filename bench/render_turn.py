"""Host-side cost of building one multi-turn prompt: `ChatRenderer` per sample-turn, on the CPU.

    python bench/render_turn.py                       # qwen3-style template, no tools, 256 samples x 8 turns
    python bench/render_turn.py --style qwen2.5 --tools

Replays what `EnvRollout` does between two model turns of `bench/multi_turn.py`: a renderer per sample,
its opening prompt, then per turn the end of the model's turn (~7 tokens ending in <|im_end|>) and the
template tokens of the environment's reply (a tool result and a user message) with the next generation
prompt. Prints the mean (what `timing/render_s` sums) and the median milliseconds per sample-turn; a
sample's first turn also renders the template's fixed anchors, so the mean is above the median.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from rlx.chat.trajectory import ChatRenderer
from rlx.models.tiny_chat import build_chat_tokenizer
from rlx.tasks.calculator import CalculatorEnv

OPENING = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Begin."}]


def time_sample(tokenizer, rng: random.Random, args) -> list[float]:
    """Seconds per turn of one sample (a fresh renderer, as each episode gets)."""
    kwargs = {"enable_thinking": False} if args.style == "qwen3" else {}
    renderer = ChatRenderer(tokenizer, {tokenizer.eos_token_id}, CalculatorEnv.tools if args.tools else None, kwargs)
    renderer.opening_ids(OPENING)
    seconds = []
    for turn in range(1, args.turns):
        text = "".join(rng.choice("abcdefgh ") for _ in range(6))
        turn_ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        replies = [{"role": "tool", "content": f"result {turn}"}, {"role": "user", "content": "Next."}]
        began = time.perf_counter()
        renderer.turn_end_ids(turn_ids) + renderer.message_ids(replies)
        seconds.append(time.perf_counter() - began)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--style", default="qwen3", choices=("qwen2.5", "qwen3"))
    parser.add_argument("--tools", action="store_true", help="the calculator task's tool list in the template")
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--turns", type=int, default=8, help="model turns per sample (turns - 1 renders)")
    args = parser.parse_args()
    tokenizer = build_chat_tokenizer(args.style)
    rng = random.Random(0)
    time_sample(tokenizer, rng, args)  # warm-up (template compilation)
    seconds = [s for _ in range(args.samples) for s in time_sample(tokenizer, rng, args)]
    result = {
        "args": vars(args),
        "sample_turns": len(seconds),
        "mean_ms_per_turn": round(1000 * statistics.fmean(seconds), 4),
        "median_ms_per_turn": round(1000 * statistics.median(seconds), 4),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
