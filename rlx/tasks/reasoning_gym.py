"""Prompt files from reasoning-gym's procedural datasets, offline, scored by the `reasoning_gym` reward.

    python -m rlx.tasks.reasoning_gym --dataset basic_arithmetic --num 1000 --seed 0 --out prompts.jsonl
    python -m rlx.tasks.reasoning_gym --dataset countdown --num 500 --config '{"min_numbers": 3}' --out p.jsonl

Each record: a chat prompt (reasoning-gym's system prompt asking for <answer>...</answer>, then the
question), data_source `reasoning_gym/NAME`, ground_truth (the dataset's answer, when it has one) and
`extra_info.entry` = the whole generated entry (question, answer, metadata), which the dataset's
verifier needs. Needs `pip install 'rlx[tasks]'` (reasoning-gym); no network.
"""

from __future__ import annotations

import argparse
import json

from rlx.errors import UserError
from rlx.utils.io import write_jsonl

DATA_SOURCE_PREFIX = "reasoning_gym/"


def import_reasoning_gym():
    """The reasoning_gym package, or a UserError naming the extra that installs it."""
    try:
        import reasoning_gym
    except ImportError:
        raise UserError(
            "reasoning-gym tasks need the reasoning-gym package: pip install 'rlx[tasks]' "
            "(or pip install reasoning-gym)"
        ) from None
    return reasoning_gym


def _stored(entry: dict, name: str, index: int) -> dict:
    """The entry as JSON stores it (tuples become lists, ...); refuses values JSON cannot hold."""
    try:
        return json.loads(json.dumps({k: entry[k] for k in ("question", "answer", "metadata") if k in entry}))
    except (TypeError, ValueError) as e:
        raise UserError(f"reasoning-gym dataset {name!r}: entry {index} cannot be stored as JSON ({e})") from None


def generate_reasoning_gym(
    dataset: str, num: int, seed: int = 0, config: dict | None = None, system_prompt: str = "default"
) -> list[dict]:
    """`num` prompt records of reasoning-gym dataset `dataset` (deterministic for a seed); each entry's oracle
    answer is checked to score 1 with the stored copy of the entry, so the prompt file holds all scoring needs."""
    rg = import_reasoning_gym()
    from reasoning_gym.utils import SYSTEM_PROMPTS

    if system_prompt not in SYSTEM_PROMPTS:
        raise UserError(f"--system-prompt {system_prompt!r}: expected one of {', '.join(SYSTEM_PROMPTS)}")
    try:
        data = rg.create_dataset(dataset, size=num, seed=seed, **(config or {}))
    except (ValueError, TypeError, AssertionError) as e:
        raise UserError(f"reasoning-gym dataset {dataset!r}: {e}") from None
    width = len(str(num - 1))
    records = []
    for i in range(num):
        entry = _stored(data[i], dataset, i)
        if entry.get("answer") is not None and data.score_answer(entry["answer"], entry) != 1.0:
            raise UserError(f"reasoning-gym dataset {dataset!r}: entry {i} does not verify after storing it as JSON")
        records.append(
            {
                "id": f"{dataset}-{i:0{width}d}",
                "prompt": [
                    {"role": "system", "content": SYSTEM_PROMPTS[system_prompt]},
                    {"role": "user", "content": entry["question"]},
                ],
                "data_source": DATA_SOURCE_PREFIX + dataset,
                "ground_truth": entry.get("answer"),
                "extra_info": {"entry": entry},
            }
        )
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description="Write prompts.jsonl from a reasoning-gym dataset (offline).")
    parser.add_argument("--dataset", required=True, help="reasoning-gym dataset name, e.g. basic_arithmetic")
    parser.add_argument("--num", type=int, default=1000, help="number of questions (default 1000)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--config", default="{}", help="dataset settings as a JSON object (default {})")
    parser.add_argument("--system-prompt", default="default", help="reasoning-gym system prompt name (default)")
    parser.add_argument("--out", required=True, help="prompts.jsonl to write ('-' for stdout)")
    args = parser.parse_args()
    try:
        config = json.loads(args.config)
    except ValueError as e:
        parser.exit(1, f"rlx.tasks.reasoning_gym: error: --config: not JSON ({e})\n")
    if not isinstance(config, dict):
        parser.exit(1, f"rlx.tasks.reasoning_gym: error: --config: expected a JSON object, got {args.config}\n")
    if args.num < 1:
        parser.exit(1, f"rlx.tasks.reasoning_gym: error: --num must be at least 1, got {args.num}\n")
    try:
        write_jsonl(args.out, generate_reasoning_gym(args.dataset, args.num, args.seed, config, args.system_prompt))
    except UserError as e:
        parser.exit(1, f"rlx.tasks.reasoning_gym: error: {e}\n")


if __name__ == "__main__":
    main()
