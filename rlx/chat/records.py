"""Multi-turn samples as rollouts.jsonl records: the single-turn fields plus the trajectory fields.

`prompt_ids` is the opening prompt and `response_ids` every later token (model and inserted, in
order); `loss_mask`, `rollout_logprobs` (0 where the mask is 0), `messages`, `num_turns` and
`env_reward` ride along (and an MoE model's `routed_experts` over the whole response, inserted tokens' rows as
the next turn's engine read them), and `response` is the text of the last assistant turn (the final answer
rule rewards grade). `finish_reason` is one of stop | length | max_turns | env_done.
"""

from __future__ import annotations

from rlx.chat.trajectory import Trajectory
from rlx.formats.records import MULTI_TURN_FINISH, PromptRecord, RolloutRecord
from rlx.models.fingerprint import tokenizer_fingerprint

FINISH_REASONS = MULTI_TURN_FINISH


def trajectory_record(
    prompt: PromptRecord,
    sample_index: int,
    trajectory: Trajectory,
    *,
    finish_reason: str,
    response: str,
    temperature: float,
    env_reward: float,
    extra: dict | None = None,
    image_refs: list[str] | None = None,
    tools: list[dict] | None = None,
    tokenizer=None,
) -> RolloutRecord:
    """The record of one multi-turn sample (`extra`: more fields, e.g. env_error or segments; `image_refs`: its
    images in token order, None without; `tools`: the tools offered to the model, None without; `tokenizer`: the
    tokenizer that made the ids, whose fingerprint the record keeps)."""
    if finish_reason not in FINISH_REASONS:
        raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {finish_reason!r}")
    return RolloutRecord(
        id=f"{prompt.id}/{sample_index}",
        prompt_id=prompt.id,
        sample_index=sample_index,
        prompt=prompt.prompt,
        response=response,
        prompt_ids=trajectory.prompt_ids,
        response_ids=trajectory.response_ids,
        rollout_logprobs=trajectory.rollout_logprobs,
        finish_reason=finish_reason,
        temperature=temperature,
        data_source=prompt.data_source,
        ground_truth=prompt.ground_truth,
        extra={**{k: v for k, v in prompt.extra.items() if k != "tools"}, **(extra or {})},
        loss_mask=trajectory.loss_mask,
        messages=trajectory.messages,
        num_turns=trajectory.num_turns,
        env_reward=float(env_reward),
        image_refs=image_refs,
        tools=tools,
        tokenizer=tokenizer_fingerprint(tokenizer) if tokenizer is not None else None,
        routed_experts=trajectory.routed_experts(),
    )
