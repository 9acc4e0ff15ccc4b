"""Reward functions by name: the built-in rules, any `module:function`, weighted sums, chosen per sample.

A reward spec is a built-in name (`arith`, `gsm8k`, `math`, `shapes`, `reasoning_gym`, `env`: a multi-turn sample's
environment reward), `package.module:function` or
`path/to/file.py:function`, optionally followed by `=WEIGHT`. Without specs, each sample's
`data_source` picks a built-in (`reasoning_gym/NAME` picks `reasoning_gym`). A function is called as verl calls it:
`fn(data_source=, solution_str=, ground_truth=, extra_info=)` and returns a number or a dict
with 'score' (its other entries are kept in scores.jsonl; metrics average the numeric ones). A prompt's
`extra_info` dict (verl's column) reaches the function as it is, merged over rlx's own keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rlx.errors import UserError
from rlx.formats.records import RolloutRecord
from rlx.scoring import reasoning_gym, rules
from rlx.utils.user_code import load_object

BUILTIN: dict[str, Callable] = {
    "arith": rules.arith,
    "gsm8k": rules.gsm8k,
    "math": rules.math,
    "shapes": rules.shapes,
    "reasoning_gym": reasoning_gym.reasoning_gym,
    "env": rules.env,
}
DATA_SOURCE_ALIASES = {
    "openai/gsm8k": "gsm8k",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
}


def parse_spec(text: str) -> tuple[str, float]:
    """'name' or 'name=weight' -> (name, weight)."""
    name, sep, weight = text.rpartition("=")
    if not sep:
        return text, 1.0
    try:
        return name, float(weight)
    except ValueError:
        raise UserError(f"--reward {text!r}: the weight after '=' must be a number") from None


@dataclass
class RewardFunction:
    """One named, weighted reward function."""

    name: str
    fn: Callable
    weight: float = 1.0


@dataclass
class RewardResult:
    """The reward of one sample: the weighted scalar, each component's details, or why it failed."""

    score: float
    details: dict
    error: str | None = None


class RewardFunctions:
    """Resolves and calls reward functions for samples (given specs for all, or by data_source)."""

    def __init__(self, specs: list[str]):
        self.fixed: list[RewardFunction] = []
        for text in specs:
            spec, weight = parse_spec(text)
            fn = (
                BUILTIN[spec]
                if spec in BUILTIN
                else load_object(
                    spec, "--reward", f"a built-in name ({', '.join(BUILTIN)}) or module:function", "reward"
                )
            )
            self.fixed.append(RewardFunction(spec if spec in BUILTIN else spec.rpartition(":")[2], fn, weight))

    def for_sample(self, rollout: RolloutRecord) -> list[RewardFunction]:
        if self.fixed:
            return self.fixed
        return self.for_source(rollout.data_source, f"sample {rollout.id!r}")

    def for_source(self, source: str | None, where: str) -> list[RewardFunction]:
        """The built-in a data_source names (used when no function is given); `where` starts the error."""
        name = DATA_SOURCE_ALIASES.get(source, source)
        if source and source.startswith(reasoning_gym.DATA_SOURCE_PREFIX):
            name = "reasoning_gym"
        if name in BUILTIN:
            return [RewardFunction(name, BUILTIN[name])]
        raise UserError(
            f"{where}: no reward function for data_source {source!r} "
            f"(pass --reward NAME|module:function; built-ins: {', '.join(BUILTIN)})"
        )

    def compute(self, rollout: RolloutRecord) -> RewardResult:
        """Weighted sum of the functions; an exception or non-finite score comes back as `error`."""
        extra_info = reward_extra_info(rollout)
        total, details = 0.0, {}
        for reward in self.for_sample(rollout):
            try:
                value = reward.fn(
                    data_source=rollout.data_source,
                    solution_str=rollout.response,
                    ground_truth=rollout.ground_truth,
                    extra_info=extra_info,
                )
            except Exception as e:  # the user's function: any failure is reported with the sample id
                return RewardResult(0.0, {}, f"reward function {reward.name!r} raised {type(e).__name__}: {e}")
            parts = value if isinstance(value, dict) else {"score": value}
            score = parts.get("score")
            if not rules.is_finite_number(score):
                return RewardResult(
                    0.0, {}, f"reward function {reward.name!r} returned {score!r}, expected a finite number"
                )
            details[reward.name] = reward_details(parts)
            total += reward.weight * float(score)
        return RewardResult(total, details)


def reward_extra_info(rollout: RolloutRecord) -> dict:
    """What a reward function gets as `extra_info`: the sample's id, prompt_id, sample_index, prompt and
    finish_reason, a multi-turn sample's messages, num_turns and env_reward, the prompt's other fields, and the
    entries of its own `extra_info` dict (verl's column) as they are, on top (not nested under 'extra_info')."""
    fields = dict(rollout.extra)
    own = fields.pop("extra_info", None)
    info = {
        "id": rollout.id,
        "prompt_id": rollout.prompt_id,
        "sample_index": rollout.sample_index,
        "prompt": rollout.prompt,
        "finish_reason": rollout.finish_reason,
        **fields,
    }
    if rollout.is_multi_turn:
        info.update(messages=rollout.messages, num_turns=rollout.num_turns, env_reward=rollout.env_reward)
    if isinstance(own, dict):
        info.update(own)
    elif own is not None:
        info["extra_info"] = own
    return info


def reward_details(parts: dict) -> dict:
    """A reward's dict as scores.jsonl keeps it: numbers as floats, other JSON values (strings, booleans,
    lists, null) unchanged; non-finite numbers and values JSON cannot hold are dropped."""
    out = {}
    for key, value in parts.items():
        if rules.is_finite_number(value):
            out[str(key)] = float(value)
        elif isinstance(value, (str, bool, type(None))) or _is_json(value):
            out[str(key)] = value
    return out


def _is_json(value) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_is_json(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_json(v) for k, v in value.items())
    if isinstance(value, float):
        return rules.is_finite_number(value)
    return value is None or isinstance(value, (str, bool, int))
