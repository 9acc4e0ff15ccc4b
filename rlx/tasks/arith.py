"""Generated arithmetic questions with exact answers, graded by the `arith` reward.

    python -m rlx.tasks.arith --out prompts.jsonl --num 2000 --max-value 9 --seed 0
    python -m rlx.tasks.arith --out prompts.jsonl --style chat --max-value 99
    python -m rlx.tasks.arith --style chat --ops +- --max-value 99 --num 500 --seed 1 --id-prefix arith-heldout \
        --exclude recipes/data/arith_chat.jsonl --out recipes/data/arith_chat_heldout.jsonl   # held out

'plain' prompts are bare expressions ("3+4="), for tiny character-level models; 'chat' prompts
are one user message asking for the number, for instruct models.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Iterable

from rlx.utils.io import read_jsonl, write_jsonl

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
    exclude: Iterable[dict] | None = None,
) -> list[dict]:
    """`num` prompt records {id, prompt, data_source: 'arith', ground_truth}, deterministic for a seed.

    With `exclude` (prompt records, e.g. a training set) the questions are held out: all different, and
    none has the prompt of an excluded record.
    """
    if style not in ("plain", "chat"):
        raise ValueError(f"style must be 'plain' or 'chat', got {style!r}")
    unknown = set(ops) - set(OPS)
    if unknown or not ops:
        raise ValueError(f"ops must be made of {''.join(OPS)}, got {ops!r}")
    taken = None if exclude is None else {_question_key(r["prompt"]) for r in exclude}
    if taken is not None:
        possible = (max_value - min_value + 1) ** 2 * len(set(ops))
        if num > possible - len(taken):
            raise ValueError(f"cannot hold out {num} questions: only {possible} exist and {len(taken)} are excluded")
    rng = random.Random(seed)
    width = len(str(num - 1))
    records = []
    while len(records) < num:
        i = len(records)
        a, b, op = rng.randint(min_value, max_value), rng.randint(min_value, max_value), rng.choice(ops)
        prompt = (
            f"{a}{op}{b}=" if style == "plain" else [{"role": "user", "content": CHAT_TEMPLATE.format(a=a, op=op, b=b)}]
        )
        if taken is not None:
            key = _question_key(prompt)
            if key in taken:
                continue
            taken.add(key)
        records.append(
            {
                "id": f"{id_prefix}-{i:0{width}d}",
                "prompt": prompt,
                "data_source": "arith",
                "ground_truth": str(OPS[op](a, b)),
            }
        )
    return records


def _question_key(prompt) -> str:
    return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)


def main() -> None:
    parser = argparse.ArgumentParser(description="Write generated arithmetic prompts as prompts.jsonl.")
    parser.add_argument("--out", required=True, help="prompts.jsonl to write ('-' for stdout)")
    parser.add_argument("--num", type=int, default=1000, help="number of questions (default 1000)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--min-value", type=int, default=0, help="smallest operand (default 0)")
    parser.add_argument("--max-value", type=int, default=9, help="largest operand (default 9)")
    parser.add_argument("--ops", default="+", help="operators to draw from, e.g. '+-*' (default '+')")
    parser.add_argument("--style", default="plain", choices=("plain", "chat"), help="prompt style (default plain)")
    parser.add_argument("--id-prefix", default="arith", help="ids are PREFIX-NNNN (default arith)")
    parser.add_argument(
        "--exclude",
        metavar="FILE",
        help="hold out: prompts.jsonl whose questions must not appear (e.g. the training set); questions unique",
    )
    args = parser.parse_args()
    exclude = [obj for _, obj in read_jsonl(args.exclude)] if args.exclude else None
    records = generate_arith(
        args.num, args.seed, args.min_value, args.max_value, args.ops, args.style, args.id_prefix, exclude
    )
    write_jsonl(args.out, records)


if __name__ == "__main__":
    main()
