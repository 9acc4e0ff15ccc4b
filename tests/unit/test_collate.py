"""`collate`: rollouts padded into the batch layout (prompts left-padded, responses right-padded, a multi-turn
sample's environment tokens out of its loss mask), equal to a row-by-row reference at any mix of lengths."""

from __future__ import annotations

import random

import torch

from rlx.formats.batch import collate
from rlx.formats.records import RolloutRecord


def _reference(rollouts: list[RolloutRecord], pad_id: int) -> dict[str, torch.Tensor]:
    b, p = len(rollouts), max(len(r.prompt_ids) for r in rollouts)
    r_len = max(len(r.response_ids) for r in rollouts)
    out = {
        "prompt_ids": torch.full((b, p), pad_id), "prompt_mask": torch.zeros((b, p), dtype=torch.bool),
        "response_ids": torch.full((b, r_len), pad_id), "response_mask": torch.zeros((b, r_len), dtype=torch.bool),
        "loss_mask": torch.zeros((b, r_len), dtype=torch.bool), "rollout_logprobs": torch.zeros((b, r_len)),
    }  # fmt: skip
    for row, rec in enumerate(rollouts):
        n_p, n_r = len(rec.prompt_ids), len(rec.response_ids)
        out["prompt_ids"][row, p - n_p :] = torch.tensor(rec.prompt_ids)
        out["prompt_mask"][row, p - n_p :] = True
        out["response_ids"][row, :n_r] = torch.tensor(rec.response_ids, dtype=torch.long)
        out["response_mask"][row, :n_r] = True
        out["loss_mask"][row, :n_r] = torch.tensor(rec.trained_mask, dtype=torch.bool)
        out["rollout_logprobs"][row, :n_r] = torch.tensor(rec.rollout_logprobs, dtype=torch.float32)
    return out


def test_collate_equals_the_row_by_row_layout():
    rng = random.Random(0)
    rollouts = []
    for i in range(37):
        n_p, n_r = rng.randint(1, 20), rng.choice([0, 1, rng.randint(2, 30)])
        mask = [rng.randint(0, 1) for _ in range(n_r)] if i % 3 == 0 else None  # multi-turn: environment tokens
        rollouts.append(
            RolloutRecord(
                id=f"s{i}",
                prompt_id=f"p{i // 4}",
                sample_index=i % 4,
                prompt="",
                response="",
                prompt_ids=[rng.randrange(1, 500) for _ in range(n_p)],
                response_ids=[rng.randrange(1, 500) for _ in range(n_r)],
                rollout_logprobs=[-rng.random() * 5 for _ in range(n_r)],
                finish_reason="stop",
                temperature=1.0,
                loss_mask=mask,
            )  # fmt: skip
        )
    got, want = collate(rollouts, pad_id=7), _reference(rollouts, pad_id=7)
    assert set(got) == set(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype, key
        assert torch.equal(got[key], tensor), key
