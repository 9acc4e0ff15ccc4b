"""The `reasoning_gym` reward: a reasoning-gym dataset's own verifier, offline (pip install 'rlx[tasks]').

Prompt files from `python -m rlx.tasks.reasoning_gym` carry data_source `reasoning_gym/NAME` and the
generated entry (question, answer, metadata) in `extra_info["entry"]`; this reward takes the response's
last `<answer>...</answer>` and scores it with the dataset's `score_answer(answer, entry)`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from rlx.errors import UserError
from rlx.tasks.reasoning_gym import DATA_SOURCE_PREFIX, import_reasoning_gym


@functools.cache
def _verifier(name: str) -> Callable:
    rg = import_reasoning_gym()
    try:
        return rg.get_score_answer_fn(name)
    except ValueError:
        raise UserError(f"reasoning-gym has no dataset {name!r}") from None


def extract_answer(response: str) -> str | None:
    """The content of the response's last <answer>...</answer> (reasoning-gym's own extraction), else None."""
    from reasoning_gym.utils import extract_answer as rg_extract

    return rg_extract(response)


def dataset_name(data_source: str | None, entry: dict) -> str:
    """NAME of data_source 'reasoning_gym/NAME', else the entry's metadata.source_dataset."""
    if data_source and data_source.startswith(DATA_SOURCE_PREFIX):
        return data_source[len(DATA_SOURCE_PREFIX) :]
    name = entry.get("metadata", {}).get("source_dataset") if isinstance(entry.get("metadata"), dict) else None
    if not name:
        raise ValueError(f"data_source {data_source!r} names no reasoning-gym dataset ('reasoning_gym/NAME')")
    return name


def reasoning_gym(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    """{"score": the verifier's score in [0, 1], "pred": the extracted answer or None}. A verifier that fails on
    the model's answer scores 0 and says why in "verifier_error" (a missing entry is an error: raised)."""
    import_reasoning_gym()
    entry = (extra_info or {}).get("entry")
    if not isinstance(entry, dict) or "answer" not in entry:
        raise ValueError(
            "extra_info has no reasoning-gym 'entry' {question, answer, metadata}: "
            "make prompts with python -m rlx.tasks.reasoning_gym"
        )
    verify = _verifier(dataset_name(data_source, entry))
    answer = extract_answer(solution_str)
    try:
        score = float(verify(answer, entry))
    except Exception as e:  # the model's answer broke the verifier: a wrong answer, shown in scores.jsonl
        return {"score": 0.0, "pred": answer, "verifier_error": f"{type(e).__name__}: {e}"[:200]}
    return {"score": score, "pred": answer}
