"""Which prompts a step uses: a cyclic walk over prompts.jsonl, optionally reshuffled every epoch.

`rlx ppo` and `rlx rollout --data-position/--num-prompts/--shuffle-seed` share this, so a shell
pipeline picks exactly the prompts the driver picks.
"""

from __future__ import annotations

import torch

from rlx.engine.records import PromptRecord
from rlx.utils.device import derive_seed


def take_prompts(
    records: list[PromptRecord], position: int, count: int, shuffle_seed: int | None = None
) -> list[PromptRecord]:
    """`count` prompts starting at absolute `position` of the endless epoch sequence.

    Epoch e visits every record once, in file order or (with `shuffle_seed`) in a permutation
    seeded by (shuffle_seed, e).
    """
    n = len(records)
    out, orders = [], {}
    for pos in range(position, position + count):
        epoch, offset = divmod(pos, n)
        if shuffle_seed is None:
            out.append(records[offset])
            continue
        if epoch not in orders:
            gen = torch.Generator().manual_seed(derive_seed("data", shuffle_seed, epoch))
            orders[epoch] = torch.randperm(n, generator=gen).tolist()
        out.append(records[orders[epoch][offset]])
    return out
