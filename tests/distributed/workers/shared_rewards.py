"""torchrun worker of tests/distributed/test_shared_rewards.py (argv: MODE FOLDER [MODEL]): every rank holds the same
records, as the synchronous `rlx ppo` ranks do.

- rewards: compute_rewards of the records with `replicas` (each rank scores a share), the reward function
  FOLDER/reward_fn.py:score (it logs each call); rank 0 pickles (records, rewards) to FOLDER/rewards.pkl.
- raise: the same with on_reward_error 'raise' and a function that fails on one sample of rank 1's share; every
  rank must stop with the same one-line error (reporting prints it).
- generate: the hf engine on the tiny model MODEL (stop strings on); rank 0 pickles the records to
  FOLDER/records.pkl, each rank writes its count of tokenizer.decode calls to FOLDER/decodes<rank>.
"""

import pickle
import sys
from pathlib import Path

import typer

from rlx.commands._common import reporting
from rlx.formats.records import PromptRecord, RolloutRecord
from rlx.parallel.dist import exit_process, setup
from rlx.scoring.config import ScoreConfig
from rlx.scoring.score import compute_rewards

PROMPTS = [PromptRecord(id=f"q{i}", prompt=f"{i}+{i}=", ground_truth=str(2 * i)) for i in range(5)]
SAMPLING = dict(n=3, max_new_tokens=8, temperature=1.0, seed=3, stop=("5",))
"""The generate mode's prompts and sampling settings (the test generates them again in one process)."""


def sample_records(count: int) -> list[RolloutRecord]:
    """`count` single-turn records whose responses differ in length (the reward function reads them)."""
    return [
        RolloutRecord(
            id=f"p{i // 2}/{i % 2}",
            prompt_id=f"p{i // 2}",
            sample_index=i % 2,
            prompt=f"{i}+1=",
            response="7" * (i % 5),
            prompt_ids=[4, 5],
            response_ids=[6] * (1 + i % 5),
            rollout_logprobs=[-1.0] * (1 + i % 5),
            finish_reason="stop",
            temperature=1.0,
            ground_truth=str(i),
        )  # fmt: skip
        for i in range(count)
    ]


def score(folder: Path, ctx, on_reward_error: str) -> None:
    records = sample_records(7)
    cfg = ScoreConfig(
        reward=[f"{folder / 'reward_fn.py'}:score"], on_reward_error=on_reward_error, max_reward_error_fraction=0.5
    )
    rewards = compute_rewards(records, cfg, replicas=ctx)
    if ctx.is_main:
        (folder / "rewards.pkl").write_bytes(pickle.dumps((records, rewards)))


def counting_decodes(tokenizer):
    """`tokenizer` with its `decode` calls counted (in `tokenizer.num_decodes`): the per-sample host work."""
    decode = tokenizer.decode
    tokenizer.num_decodes = 0

    def counted(*args, **kwargs):
        tokenizer.num_decodes += 1
        return decode(*args, **kwargs)

    tokenizer.decode = counted
    return tokenizer


def generate(folder: Path, model_dir: str, ctx) -> None:
    from transformers import AutoModelForCausalLM

    from rlx.models.tiny import build_char_tokenizer
    from rlx.rollout.base import build_engine
    from rlx.rollout.config import RolloutConfig, SamplingParams

    model = AutoModelForCausalLM.from_pretrained(model_dir).requires_grad_(False)
    tokenizer = counting_decodes(build_char_tokenizer())
    engine = build_engine(RolloutConfig(), model, tokenizer, ctx)
    records = engine.generate(PROMPTS, SamplingParams(**SAMPLING), progress=False).records
    (folder / f"decodes{ctx.rank}").write_text(str(tokenizer.num_decodes))
    if ctx.is_main:
        (folder / "records.pkl").write_bytes(pickle.dumps(records))


if __name__ == "__main__":
    mode, folder = sys.argv[1], Path(sys.argv[2])
    code = 0
    try:
        with reporting("test"):
            ctx = setup("cpu")
            if mode == "generate":
                generate(folder, sys.argv[3], ctx)
            else:
                score(folder, ctx, "raise" if mode == "raise" else "zero")
    except typer.Exit as e:
        code = e.exit_code
    exit_process(code)
