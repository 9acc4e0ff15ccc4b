"""Rule rewards: exact-answer checks for arithmetic, GSM8K and MATH-style problems and shape questions, and the
environment reward of multi-turn samples.

Each function follows the reward-function signature rlx calls for every sample,
`fn(data_source, solution_str, ground_truth, extra_info) -> float | dict`, the same one verl uses,
so a user's reward module works in both. A dict result must carry 'score'; its other numeric
entries are kept in scores.jsonl.
"""

from __future__ import annotations

import math as pymath
import re
from fractions import Fraction

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def _to_number(text: str) -> Fraction | None:
    """Parse '1,234', '-3.5', '7/2' or '.5' exactly; None when it is not a number."""
    text = text.strip().replace(",", "").rstrip(".")
    if not text:
        return None
    try:
        if "/" in text:
            num, den = text.split("/", 1)
            return Fraction(int(num), int(den)) if int(den) != 0 else None
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def _same_number(a: Fraction | None, b: Fraction | None) -> bool:
    return a is not None and b is not None and a == b


def last_number(text: str) -> str | None:
    """The last number written in `text` (commas allowed), or None."""
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def arith(data_source, solution_str: str, ground_truth, extra_info=None, format_score: float = 0.0) -> dict:
    """1.0 when the final number of the response equals the numeric ground truth, else 0.

    The answer is read from `\\boxed{...}` or after '####' when present, else the last number in the
    response; it must equal the ground truth exactly as a rational number ('0.5' == '1/2').
    `format_score` is given when a number was found but is wrong (verl's convention, default 0).
    """
    truth = _to_number(str(ground_truth))
    if truth is None:
        raise ValueError(f"ground_truth {ground_truth!r} is not a number")
    boxed = last_boxed(solution_str)
    if boxed is not None:
        answer = boxed
    elif "####" in solution_str:
        answer = solution_str.rsplit("####", 1)[1]
        answer = last_number(answer) or answer
    else:
        answer = last_number(solution_str)
    if answer is None:
        return {"score": 0.0, "has_answer": 0.0}
    correct = _same_number(_to_number(answer), truth)
    return {"score": 1.0 if correct else format_score, "has_answer": 1.0}


_GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")


def gsm8k(
    data_source, solution_str: str, ground_truth, extra_info=None, method: str = "strict", format_score: float = 0.0
) -> dict:
    """GSM8K: the answer after '#### ' ('strict', verl's default) or the last number ('flexible').

    Commas and a trailing period are ignored; the answer must equal the ground truth numerically.
    """
    if method == "strict":
        found = _GSM8K_STRICT.findall(solution_str)
        answer = found[-1] if found else None
    else:
        answer = last_number(solution_str)
    if answer is None:
        return {"score": 0.0, "has_answer": 0.0}
    truth = str(ground_truth).split("####")[-1]
    correct = _same_number(_to_number(answer), _to_number(truth))
    return {"score": 1.0 if correct else format_score, "has_answer": 1.0}


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), with nested braces; None if absent."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:]
    if rest.startswith("\\boxed ") and "{" not in rest.split()[0]:
        return rest[len("\\boxed ") :].split("$")[0].strip()
    brace = rest.find("{")
    if brace < 0:
        return None
    depth = 0
    for i in range(brace, len(rest)):
        depth += {"{": 1, "}": -1}.get(rest[i], 0)
        if depth == 0:
            return rest[brace + 1 : i]
    return None


_STRIP = [
    ("\\left", ""),
    ("\\right", ""),
    ("\\!", ""),
    ("\\,", ""),
    ("\\;", ""),
    ("\\ ", ""),
    ("dfrac", "frac"),
    ("tfrac", "frac"),
    ("^\\circ", ""),
    ("^{\\circ}", ""),
    ("\\$", ""),
    ("\\%", ""),
    ("%", ""),
    ("$", ""),
    (" ", ""),
    ("\n", ""),
]


def normalize_math(answer: str) -> str:
    """Canonical string form of a MATH answer (the usual Hendrycks normalisation, reduced)."""
    text = answer.strip()
    text = re.sub(r"\\text\{\s*([^}]*)\}", r"\1", text)
    for old, new in _STRIP:
        text = text.replace(old, new)
    text = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", text)
    text = re.sub(r"\\frac\{([^{}]+)\}\{([^{}]+)\}", r"(\1)/(\2)", text)
    text = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", text)
    if text.startswith("."):
        text = "0" + text
    text = re.sub(r"^[a-zA-Z]\s*=", "", text)
    text = text.rstrip(".")
    simple = re.fullmatch(r"\((-?\d+)\)/\((\d+)\)", text)
    if simple:
        text = f"{simple.group(1)}/{simple.group(2)}"
    number = _to_number(text)
    if number is not None:
        return str(number)
    return text


def _math_verify(answer_text: str, truth: str) -> bool | None:
    """Use math-verify when installed (symbolic equivalence); None when it is not installed."""
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    try:
        gold = parse(f"${truth}$")
        pred = parse(f"${answer_text}$")
        return bool(gold and pred and verify(gold, pred))
    except Exception:  # math-verify raises on inputs it cannot parse: treat as not equal
        return False


def math(data_source, solution_str: str, ground_truth, extra_info=None) -> dict:
    """MATH-style: compare the last `\\boxed{}` answer with the ground truth.

    Uses math-verify for symbolic equivalence when it is installed; otherwise compares normalised
    strings (fractions, \\left/\\right, units in \\text{}, spacing and dollar signs removed).
    """
    answer = last_boxed(solution_str)
    if answer is None:
        return {"score": 0.0, "has_answer": 0.0}
    truth = last_boxed(str(ground_truth)) or str(ground_truth)
    verified = _math_verify(answer, truth)
    if verified is None:
        verified = normalize_math(answer) == normalize_math(truth)
    return {"score": 1.0 if verified else 0.0, "has_answer": 1.0}


def shapes(data_source, solution_str: str, ground_truth, extra_info=None) -> dict:
    """Questions about an image (rlx.tasks.shapes): a numeric ground truth must equal the response's last
    number; a word ground truth (a colour) must be the last of the record's `choices` named in the response
    (any whole word when the record lists none), compared case-insensitively.
    """
    truth = str(ground_truth).strip()
    if _to_number(truth) is not None:
        return arith(data_source, solution_str, truth)
    choices = (extra_info or {}).get("choices") or []
    pattern = r"\b(" + "|".join(re.escape(c) for c in choices) + r")\b" if choices else r"[A-Za-z]+"
    found = re.findall(pattern, solution_str, flags=re.IGNORECASE)
    if not found:
        return {"score": 0.0, "has_answer": 0.0}
    return {"score": 1.0 if found[-1].lower() == truth.lower() else 0.0, "has_answer": 1.0}


def env(data_source, solution_str: str, ground_truth, extra_info=None) -> float:
    """The episode's environment reward (`--reward env`): the sum of a Python environment's step rewards, or a
    served agent's return value, which rlx rollout stores as `env_reward` and hands over in `extra_info`."""
    if not extra_info or extra_info.get("env_reward") is None:
        raise ValueError("the rollout has no env_reward (it is not a multi-turn --env/--agent rollout)")
    return float(extra_info["env_reward"])


def is_finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and pymath.isfinite(value)
