"""Generated arithmetic questions with exact answers, graded by the `arith` reward.

    python -m rlx.tasks.arith --out prompts.jsonl --num 2000 --max-value 9 --seed 0
    python -m rlx.tasks.arith --out prompts.jsonl --style chat --max-value 99

'plain' prompts are bare expressions ("3+4="), for tiny character-level models; 'chat' prompts
are one user message asking for the number, for instruct models.
"""

from __future__ import annotations

import argparse
import random

from rlx.utils.io import write_jsonl

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
CHAT_TEMPLATE = "What is {a} {op} {b}? Reply with only the final number."


def generate_arith(
    num: int,
    seed: int = 0,
    min_value: int = 0,
    max_value: int = 9,
    ops: str = "+",
    style: str = "plain",
    id_prefix: str = "arith",
) -> list[dict]:
    """`num` prompt records {id, prompt, data_source: 'arith', ground_truth}, deterministic for a seed."""
    if style not in ("plain", "chat"):
        raise ValueError(f"style must be 'plain' or 'chat', got {style!r}")
    unknown = set(ops) - set(OPS)
    if unknown or not ops:
        raise ValueError(f"ops must be made of {''.join(OPS)}, got {ops!r}")
    rng = random.Random(seed)
    width = len(str(num - 1))
    records = []
    for i in range(num):
        a, b, op = rng.randint(min_value, max_value), rng.randint(min_value, max_value), rng.choice(ops)
        prompt = (
            f"{a}{op}{b}=" if style == "plain" else [{"role": "user", "content": CHAT_TEMPLATE.format(a=a, op=op, b=b)}]
        )
        records.append(
            {
                "id": f"{id_prefix}-{i:0{width}d}",
                "prompt": prompt,
                "data_source": "arith",
                "ground_truth": str(OPS[op](a, b)),
            }
        )
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description="Write generated arithmetic prompts as prompts.jsonl.")
    parser.add_argument("--out", required=True, help="prompts.jsonl to write ('-' for stdout)")
    parser.add_argument("--num", type=int, default=1000, help="number of questions (default 1000)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--min-value", type=int, default=0, help="smallest operand (default 0)")
    parser.add_argument("--max-value", type=int, default=9, help="largest operand (default 9)")
    parser.add_argument("--ops", default="+", help="operators to draw from, e.g. '+-*' (default '+')")
    parser.add_argument("--style", default="plain", choices=("plain", "chat"), help="prompt style (default plain)")
    args = parser.parse_args()
    write_jsonl(args.out, generate_arith(args.num, args.seed, args.min_value, args.max_value, args.ops, args.style))


if __name__ == "__main__":
    main()
