"""Per-rank CPU seconds of the step's per-sample host work (records + rewards) at a world size, before vs after
each rank does only its share (issue 34), simulated in one process.

    python bench/shared_cpu_work.py                        # 1024 samples x 256 tokens, world 4, 5 repeats
    python bench/shared_cpu_work.py --world 8 --samples 2048

The work after generation, as one rank of a synchronous `rlx ppo` step at world W does it:
  before  gather every rank's Generated (pickle this rank's share, unpickle W shares), then decode every sample
          into a RolloutRecord (to_record) and run the reward function on every sample
  after   cut and decode this rank's share (finish_generated), gather (Generated, text) pairs, build every record
          from them (no decode), run the reward function on this rank's share (compute_reward_share) and gather
          the W RewardShares (pickle one, unpickle W)
The gathers are simulated by their host work (one pickle.dumps of this rank's part, W pickle.loads); the wire time
is not counted. Samples: the character tokenizer of rlx/models/tiny.py, random response ids, a length reward from
a file (as `--reward FILE:score` loads it). Figures: CPU seconds (time.process_time) of the median repeat.
"""

from __future__ import annotations

import argparse
import pickle
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rlx.formats.records import PromptRecord  # noqa: E402
from rlx.models.fingerprint import tokenizer_fingerprint  # noqa: E402
from rlx.models.tiny import build_char_tokenizer  # noqa: E402
from rlx.parallel.dist import shard_range  # noqa: E402
from rlx.rollout.base import finish_generated  # noqa: E402
from rlx.rollout.config import SamplingParams  # noqa: E402
from rlx.rollout.prompts import PromptEncoder  # noqa: E402
from rlx.rollout.requests import Generated, build_requests, to_record  # noqa: E402
from rlx.scoring.config import ScoreConfig  # noqa: E402
from rlx.scoring.score import Rewards, compute_reward_share, compute_rewards  # noqa: E402


def gathered(part, world: int) -> list:
    """The host work of an all_gather_object of `part` (every rank's part the same size): one dumps, W loads."""
    blob = pickle.dumps(part)
    return [pickle.loads(blob) for _ in range(world)]


def before(requests, generated, tokenizer, cfg: ScoreConfig, world: int, rank: int) -> None:
    mine = list(shard_range(len(requests), rank, world))
    for _ in gathered((mine, [generated[i] for i in mine]), world):
        pass
    records = [to_record(r, g, tokenizer, 1.0) for r, g in zip(requests, generated)]
    compute_rewards(records, cfg)


def after(requests, generated, tokenizer, cfg: ScoreConfig, world: int, rank: int) -> None:
    mine = list(shard_range(len(requests), rank, world))
    finished = finish_generated([generated[i] for i in mine], tokenizer, ())
    shares = gathered((mine, finished), world)  # rank 0's share W times: the shares' sizes are alike
    results = [item for _, part in shares for item in part][: len(requests)]
    fingerprint = tokenizer_fingerprint(tokenizer)
    records = [
        to_record(r, g, tokenizer, 1.0, response=text, fingerprint=fingerprint)
        for r, (g, text) in zip(requests, results)
    ]
    parts = gathered(compute_reward_share([records[i] for i in mine], cfg, None), world)
    Rewards(torch.tensor([s for p in parts for s in p.scores]), [d for p in parts for d in p.details],
            [e for p in parts for e in p.errors])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--tokens", type=int, default=256, help="response tokens per sample")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    tokenizer = build_char_tokenizer()
    prompts = [PromptRecord(id=f"p{i}", prompt=f"{i}+{i}=") for i in range(args.samples // args.n)]
    requests = build_requests(prompts, PromptEncoder(tokenizer, None), SamplingParams(n=args.n))
    rng = random.Random(0)
    ids = [i for i in range(len(tokenizer)) if i not in tokenizer.all_special_ids]
    generated = [
        Generated([rng.choice(ids) for _ in range(args.tokens)], [-1.0] * args.tokens, "length") for _ in requests
    ]
    with tempfile.TemporaryDirectory() as folder:
        reward = Path(folder) / "length_reward.py"
        reward.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                          "    return float(len(solution_str))\n")  # fmt: skip
        cfg = ScoreConfig(reward=[f"{reward}:score"])
        for name, run in (("before", before), ("after", after)):
            seconds = []
            for _ in range(args.repeats):
                start = time.process_time()
                run(requests, generated, tokenizer, cfg, args.world, rank=0)
                seconds.append(time.process_time() - start)
            print(
                f"{name}: {statistics.median(seconds):.3f} CPU s per rank "
                f"(world {args.world}, {len(requests)} samples x {args.tokens} tokens; "
                f"repeats {', '.join(f'{s:.3f}' for s in seconds)})"
            )


if __name__ == "__main__":
    main()
