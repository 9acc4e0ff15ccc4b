"""Subprocess of tests/unit/test_memory.py (a fresh process, its own TORCHINDUCTOR_CACHE_DIR): one graph compiled on
a cold cache, then again after a dynamo reset; prints the cold phase's cache misses and hits, then the warm one's hits
and misses."""

import torch

from rlx.observe.memory import measure_phase


def f(x):
    return torch.sin(x) * 2 + 1


with measure_phase("cold") as cold:
    torch.compile(f)(torch.ones(8))
torch._dynamo.reset()
with measure_phase("warm") as warm:
    torch.compile(f)(torch.ones(8))
print(
    cold["compile/cold_cache_misses"],
    cold["compile/cold_cache_hits"],
    warm["compile/warm_cache_hits"],
    warm["compile/warm_cache_misses"],
)
