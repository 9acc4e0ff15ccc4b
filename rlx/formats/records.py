"""Typed, versioned records that cross stage boundaries: prompts, rollouts and scores (JSONL lines).

Each record validates what it reads and names the file, line and field that is wrong. Fields a
record does not know are kept in `extra` and written back, so user data rides through every stage.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlx.errors import UserError
from rlx.formats.parquet import is_parquet, read_parquet_rows
from rlx.models.vision.images import folder_of, resolve_prompt_images
from rlx.utils.io import read_jsonl, write_jsonl

FORMAT_VERSION = 1


class _Fields:
    """Reads typed fields from one JSON object, with errors that name file:line and the field."""

    def __init__(self, obj: dict, where: str):
        self.obj, self.where = obj, where

    def fail(self, key: str, expected: str) -> UserError:
        got = self.obj.get(key, "<missing>")
        text = repr(got) if len(repr(got)) < 60 else repr(got)[:57] + "..."
        return UserError(f"{self.where}: field '{key}': expected {expected}, got {text}")

    def get(self, key: str, expected: str, ok, required: bool = True, default: Any = None) -> Any:
        if key not in self.obj:
            if required:
                raise UserError(f"{self.where}: missing required field '{key}' ({expected})")
            return default
        value = self.obj[key]
        if not ok(value):
            raise self.fail(key, expected)
        return value

    def int_list(self, key: str) -> list[int]:
        return self.get(
            key,
            "a list of integer token ids",
            lambda v: isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v),
        )

    def float_list(self, key: str) -> list[float]:
        return self.get(
            key,
            "a list of numbers",
            lambda v: isinstance(v, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v),
        )

    def check_version(self) -> None:
        version = self.obj.get("format_version", FORMAT_VERSION)
        if version != FORMAT_VERSION:
            raise UserError(
                f"{self.where}: format_version {version!r} is not supported (this rlx reads version {FORMAT_VERSION})"
            )


def _is_part(part: Any) -> bool:
    """A content part of a chat message: {"type": "text", "text": str} or {"type": "image", "image": reference}."""
    if not isinstance(part, dict):
        return False
    kind = part.get("type")
    return (kind == "text" and isinstance(part.get("text"), str)) or (
        kind == "image" and isinstance(part.get("image"), str) and bool(part["image"])
    )


def _is_content(content: Any) -> bool:
    return isinstance(content, str) or (isinstance(content, list) and all(_is_part(p) for p in content))


def _is_prompt(value: Any) -> bool:
    if isinstance(value, str):
        return bool(value)
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) and _is_content(m.get("content")) for m in value)
    )


_PROMPT_EXPECTED = (
    "a non-empty string or a list of chat messages {role, content}; content is a string or a list of parts "
    '{"type": "text", "text": ...} / {"type": "image", "image": PATH_OR_URL}'
)


def _is_id(value: Any) -> bool:
    return isinstance(value, (str, int)) and not isinstance(value, bool)


_PROMPT_KEYS = ("id", "prompt", "data_source", "ground_truth", "format_version")


@dataclass(kw_only=True)
class PromptRecord:
    """One line of prompts.jsonl: the question asked and what grading it needs."""

    id: str
    """Unique prompt id; defaults to the line's position in the file (0-based) when absent."""
    prompt: str | list[dict]
    """The text, or chat messages ([{"role": ..., "content": ...}, ...])."""
    data_source: str | None = None
    """Chooses the reward function when `rlx score --reward` is not given."""
    ground_truth: Any = None
    """The reference answer handed to the reward function."""
    extra: dict = field(default_factory=dict)
    """Any other fields of the line, kept through every stage."""

    @classmethod
    def from_json(cls, obj: dict, where: str, index: int) -> PromptRecord:
        f = _Fields(obj, where)
        f.check_version()
        prompt = f.get("prompt", _PROMPT_EXPECTED, _is_prompt)
        pid = f.get("id", "a string or integer", _is_id, required=False, default=index)
        source = f.get("data_source", "a string", lambda v: isinstance(v, str) or v is None, required=False)
        extra = {k: v for k, v in obj.items() if k not in _PROMPT_KEYS}
        return cls(id=str(pid), prompt=prompt, data_source=source, ground_truth=obj.get("ground_truth"), extra=extra)

    def to_json(self) -> dict:
        out = {"id": self.id, "prompt": self.prompt}
        if self.data_source is not None:
            out["data_source"] = self.data_source
        if self.ground_truth is not None:
            out["ground_truth"] = self.ground_truth
        out.update(self.extra)
        return out


def read_prompts(path: str | Path) -> list[PromptRecord]:
    """Read and validate prompts.jsonl, or a verl-style .parquet file: at least one record, unique ids. Relative
    image paths in chat prompts are resolved against the file's folder (records keep references, not pixels)."""
    name = "<stdin>" if str(path) == "-" else str(path)
    if is_parquet(path):
        rows = read_parquet_rows(path)
    else:
        rows = [(f"{name}:{number}", obj) for number, obj in read_jsonl(path)]
    if not rows:
        raise UserError(f"{name}: no prompts (the file is empty)")
    records, seen, base = [], {}, folder_of(path)
    for index, (where, obj) in enumerate(rows):
        record = PromptRecord.from_json(obj, where, index)
        record.prompt = resolve_prompt_images(record.prompt, base)
        if record.id in seen:
            raise UserError(f"{where}: duplicate prompt id {record.id!r} (first seen on {seen[record.id]})")
        seen[record.id] = where.rsplit(":", 1)[1] if is_parquet(path) else f"line {where.rsplit(':', 1)[1]}"
        records.append(record)
    return records


SINGLE_TURN_FINISH = ("stop", "length")
MULTI_TURN_FINISH = ("stop", "length", "max_turns", "env_done")

_ROLLOUT_KEYS = (
    "format_version",
    "id",
    "prompt_id",
    "sample_index",
    "prompt",
    "response",
    "prompt_ids",
    "response_ids",
    "rollout_logprobs",
    "finish_reason",
    "temperature",
    "is_greedy_baseline",
    "data_source",
    "ground_truth",
    "loss_mask",
    "messages",
    "num_turns",
    "env_reward",
    "image_refs",
    "policy_version",
    "rollout_restarts",
    "policy_versions",
    "resumed_from",
    "tokenizer",
    "routed_experts",
    "routed_experts_shape",
)
_MULTI_TURN_KEYS = ("loss_mask", "messages", "num_turns", "env_reward", "image_refs")
_ASYNC_KEYS = ("policy_version", "rollout_restarts", "resumed_from")
_OPTIONAL_KEYS = _MULTI_TURN_KEYS + _ASYNC_KEYS + ("policy_versions", "tokenizer", "tools", "routed_experts")


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in value)


@dataclass(kw_only=True)
class RolloutRecord:
    """One line of rollouts.jsonl: one sampled response to one prompt, with the sampler's logprobs."""

    id: str
    """Sample id, `<prompt_id>/<sample_index>`."""
    prompt_id: str
    """Id of the prompt this response answers (GRPO groups by it)."""
    sample_index: int
    """Which of the N samples of this prompt (0-based)."""
    prompt: str | list[dict]
    """The prompt as given in prompts.jsonl."""
    response: str
    """The decoded response text (special tokens removed)."""
    prompt_ids: list[int]
    """Token ids fed to the model, chat template applied."""
    response_ids: list[int]
    """Sampled token ids, including the final EOS when the response stopped."""
    rollout_logprobs: list[float]
    """The sampler's logprob of each response token: log_softmax(logits / temperature), before top-k/top-p."""
    finish_reason: str
    """'stop' (EOS sampled) or 'length' (max_new_tokens reached); multi-turn also 'max_turns' (the turn limit
    ended the episode) or 'env_done' (the environment ended it)."""
    temperature: float
    """Sampling temperature (0 = greedy); scoring and training divide logits by it (1 for greedy)."""
    is_greedy_baseline: bool = False
    """A greedy response decoded as ReMax's baseline (scored, never trained on)."""
    data_source: str | None = None
    """Copied from the prompt."""
    ground_truth: Any = None
    """Copied from the prompt."""
    extra: dict = field(default_factory=dict)
    """The prompt's other fields."""
    loss_mask: list[int] | None = None
    """Multi-turn: 1 on response tokens the model generated, 0 on tokens the environment or a tool inserted
    (same length as response_ids); None for a single-turn sample (all ones)."""
    messages: list[dict] | None = None
    """Multi-turn: the whole conversation (role, content, tool_calls)."""
    num_turns: int | None = None
    """Multi-turn: assistant turns generated."""
    env_reward: float | None = None
    """Multi-turn: the sum of the environment's step rewards (an agent's return value)."""
    image_refs: list[str] | None = None
    """Multi-turn with images: every image's reference (resolved: an absolute path, URL or data: URI) in the order
    its tokens appear in prompt_ids + response_ids, the opening messages' and the environment's replies'; its tokens
    are the placeholders of the prompt and of the inserted (loss_mask 0) response tokens. None without images."""
    policy_version: int | None = None
    """Asynchronous runs: the policy that generated the sample (k = the weights after step k; 0 = the start)."""
    rollout_restarts: int | None = None
    """Asynchronous runs: how often new weights arrived while the sample was generated and it started again
    (async.partial_rollouts = 'drop'); 0 = generated in one go by policy_version."""
    policy_versions: list[list[int]] | None = None
    """Asynchronous runs with async.partial_rollouts = 'continue', a sample whose generation spanned a weight
    update: [[response token index, policy version], ...] where each run of tokens generated by one policy
    begins (the first is [0, policy_version]); None when one policy generated the whole response."""
    resumed_from: int | None = None
    """Asynchronous runs: set on the samples of the steps after a resume that the stopped run may have generated
    already (they are generated again): the checkpoint step the run resumed from."""
    tools: list[dict] | None = None
    """Multi-turn: the tools (OpenAI function schemas) offered to the model: the environment's `tools`, or those of
    the agent's last request (its record's segment); None when none were offered. A single-turn line's `tools`
    is one of the prompt's fields (in `extra`)."""
    tokenizer: str | None = None
    """A fingerprint of the tokenizer that made the token ids (rlx.models.fingerprint); `rlx score` checks it
    against the actor's. None in lines of older rlx versions (not checked)."""
    routed_experts: Any = None
    """MoE models (hf engine): int16 tensor [len(response_ids), layers, k], entry i the experts each MoE layer
    routed the position that predicts response token i to (-1: not recorded); on disk one base64 string of
    little-endian int16 (`routed_experts`) and its shape (`routed_experts_shape`). See rlx/models/routing.py."""

    @property
    def is_multi_turn(self) -> bool:
        return self.loss_mask is not None

    @property
    def trained_mask(self) -> list[int]:
        """1 on the response tokens a loss may see (the model's own), 0 elsewhere."""
        return self.loss_mask if self.loss_mask is not None else [1] * len(self.response_ids)

    @classmethod
    def from_json(cls, obj: dict, where: str) -> RolloutRecord:
        f = _Fields(obj, where)
        f.check_version()
        rec = cls(
            id=str(f.get("id", "a string", _is_id)),
            prompt_id=str(f.get("prompt_id", "a string", _is_id)),
            sample_index=f.get(
                "sample_index",
                "a non-negative integer",
                lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
            ),
            prompt=f.get("prompt", "a string or chat messages", _is_prompt),
            response=f.get("response", "a string", lambda v: isinstance(v, str)),
            prompt_ids=f.int_list("prompt_ids"),
            response_ids=f.int_list("response_ids"),
            rollout_logprobs=f.float_list("rollout_logprobs"),
            finish_reason=f.get(
                "finish_reason",
                "one of " + ", ".join(MULTI_TURN_FINISH if "loss_mask" in obj else SINGLE_TURN_FINISH),
                lambda v: v in (MULTI_TURN_FINISH if "loss_mask" in obj else SINGLE_TURN_FINISH),
            ),
            temperature=float(
                f.get(
                    "temperature",
                    "a number >= 0",
                    lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0,
                )
            ),
            is_greedy_baseline=f.get(
                "is_greedy_baseline", "true or false", lambda v: isinstance(v, bool), required=False, default=False
            ),
            data_source=obj.get("data_source"),
            ground_truth=obj.get("ground_truth"),
            extra={k: v for k, v in obj.items() if k not in _ROLLOUT_KEYS},
            **_multi_turn_fields(f),
            **{key: f.get(key, "a non-negative integer", _is_count, required=False) for key in _ASYNC_KEYS},
            policy_versions=f.get(
                "policy_versions", "a list of [token index, policy version] pairs", _is_spans, required=False
            ),
            tokenizer=f.get("tokenizer", "a string", lambda v: isinstance(v, str), required=False),
        )
        rec.routed_experts = _read_routes(f, len(rec.response_ids))
        if rec.is_multi_turn:
            rec.tools = f.get("tools", "a list of function schemas (objects)", _is_tools, required=False)
            rec.extra.pop("tools", None)
        if not rec.prompt_ids:
            raise f.fail("prompt_ids", "at least one token")
        if not rec.response_ids:
            raise f.fail("response_ids", "at least one token")
        if len(rec.rollout_logprobs) != len(rec.response_ids):
            raise UserError(
                f"{where}: 'rollout_logprobs' has {len(rec.rollout_logprobs)} entries but "
                f"'response_ids' has {len(rec.response_ids)}; expected one logprob per token"
            )
        if rec.loss_mask is not None and len(rec.loss_mask) != len(rec.response_ids):
            raise UserError(
                f"{where}: 'loss_mask' has {len(rec.loss_mask)} entries but 'response_ids' has "
                f"{len(rec.response_ids)}; expected one per token"
            )
        if rec.loss_mask is not None and not any(rec.loss_mask):
            raise f.fail("loss_mask", "at least one 1 (a model token)")
        return rec

    def to_json(self) -> dict:
        out = {"format_version": FORMAT_VERSION}
        for f in dataclasses.fields(self):
            if f.name not in ("extra", "routed_experts") and not (
                f.name in _OPTIONAL_KEYS and getattr(self, f.name) is None
            ):
                out[f.name] = getattr(self, f.name)
        if self.routed_experts is not None:
            from rlx.models.routing import encode_routes  # torch: not at import (rlx --help stays fast)

            out["routed_experts"] = encode_routes(self.routed_experts)
            out["routed_experts_shape"] = list(self.routed_experts.shape)
        out.update(self.extra)
        return out


def _read_routes(f: _Fields, response_len: int):
    """The line's routed_experts as int16 [R, layers, k] (validated against routed_experts_shape), or None."""
    if "routed_experts" not in f.obj:
        return None
    shape = f.get(
        "routed_experts_shape", f"[{response_len}, layers, k] (positive integers)",
        lambda v: isinstance(v, list) and len(v) == 3 and all(_is_count(x) and x > 0 for x in v)
        and v[0] == response_len,
    )  # fmt: skip
    text = f.get("routed_experts", "a base64 string", lambda v: isinstance(v, str))
    from rlx.models.routing import decode_routes

    try:
        return decode_routes(text, tuple(shape))
    except ValueError as e:
        raise f.fail("routed_experts", f"base64 of int16 of shape {shape} ({e})") from None


def _is_tools(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, dict) for t in value)


def _is_spans(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(pair, list) and len(pair) == 2 and all(_is_count(v) for v in pair) for pair in value
    )


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _multi_turn_fields(f: _Fields) -> dict:
    """loss_mask, messages, num_turns, env_reward, image_refs where the line has them (a multi-turn sample)."""
    is_count = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0  # noqa: E731
    return {
        "loss_mask": f.get(
            "loss_mask", "a list of 0 and 1", lambda v: isinstance(v, list) and all(x in (0, 1) for x in v)
            and not any(isinstance(x, bool) for x in v), required=False,
        ),
        "messages": f.get("messages", "a list of chat messages {role, ...}", _is_messages, required=False),
        "num_turns": f.get("num_turns", "a non-negative integer", is_count, required=False),
        "env_reward": f.get(
            "env_reward", "a finite number",
            lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v), required=False,
        ),
        "image_refs": f.get(
            "image_refs", "a list of image references (strings)",
            lambda v: isinstance(v, list) and all(isinstance(x, str) and x for x in v), required=False,
        ),
    }  # fmt: skip


def read_rollouts(path: str | Path) -> list[RolloutRecord]:
    """Read and validate rollouts.jsonl: at least one record, unique sample ids."""
    name = "<stdin>" if str(path) == "-" else str(path)
    lines = read_jsonl(path)
    if not lines:
        raise UserError(f"{name}: no rollouts (the file is empty)")
    records, seen = [], {}
    for number, obj in lines:
        record = RolloutRecord.from_json(obj, f"{name}:{number}")
        if record.id in seen:
            raise UserError(
                f"{name}:{number}: duplicate sample id {record.id!r} (first seen on line {seen[record.id]})"
            )
        seen[record.id] = number
        records.append(record)
    return records


def write_records(path: str | Path, records: list) -> None:
    """Write any list of records (each with `to_json`) as JSONL, atomically."""
    write_jsonl(path, (r.to_json() for r in records))


@dataclass(kw_only=True)
class ScoreRecord:
    """One line of scores.jsonl: the reward of one sample and how it was made."""

    id: str
    """Sample id, as in rollouts.jsonl."""
    prompt_id: str
    """Prompt id (the advantage group)."""
    reward: float
    """The scalar reward used for training (weighted sum of components, before any KL penalty)."""
    rewards: dict
    """Per-reward-function details: {name: {"score": float, ...the function's other entries}}."""
    advantage: float
    """The sequence-level advantage assigned to every response token."""
    response_length: int
    """Number of response tokens."""
    reward_error: str | None = None
    """Why the reward function failed for this sample (only with --on-reward-error zero)."""
    is_greedy_baseline: bool = False
    """A ReMax greedy baseline: scored for the baseline, not trained on."""
    filtered: bool | None = None
    """With dynamic sampling (filter_groups): true when the sample's group was left out of the batch."""

    def to_json(self) -> dict:
        out = {"format_version": FORMAT_VERSION}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None and not (f.name == "is_greedy_baseline" and not value):
                out[f.name] = value
        return out
