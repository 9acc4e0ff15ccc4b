"""Subprocess of tests/unit/test_kernels.py (TRITON_INTERPRET=1 must be set before triton is imported): the Triton
logprob + entropy kernels against a float64 reference, for each variant named in argv (fused, cublas; both passes,
chosen per call through RLX_LOGPROB_FWD / RLX_LOGPROB_BWD), in one process. Prints `VARIANT WORST_ERROR` lines."""

import os
import sys

from rlx.kernels.logprob_entropy import naive_logprob_entropy
from rlx.kernels.triton_logprob import TritonLogprobEntropy
from tests.unit.test_kernels import problem, run

for variant in sys.argv[1:]:
    os.environ["RLX_LOGPROB_FWD"] = os.environ["RLX_LOGPROB_BWD"] = variant
    worst = 0.0
    for temperature in (1.0, 0.6):
        hidden, weight, targets, up = problem(n=37, h=32, v=300)
        h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
        want = run(lambda h, w, t, tau=temperature: naive_logprob_entropy(h, w, t, tau), h64, w64, targets, up)
        got = run(
            lambda h, w, t, tau=temperature: TritonLogprobEntropy.apply(h, w, t, tau, -100, None),
            hidden,
            weight,
            targets,
            up,
        )
        worst = max(worst, *[(a.double() - b.double()).abs().max().item() for a, b in zip(got, want)])
        assert (got[0][[3, 7]] == 0).all(), variant
    print(variant, worst, flush=True)
