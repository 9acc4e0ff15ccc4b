"""Subprocess of tests/unit/test_exact_triton.py (TRITON_INTERPRET=1): exact mode end to end through its Triton
kernels on the CPU, as it runs on CUDA (`use_triton` patched to say yes in every module that asks): the native
engine's logprobs of a probe sequence in a rollout batch of 3 equal the training forward's, padded and packed, bit for
bit (batch invariance itself: exact_triton_check.py); and a training loss's gradients through the kernels follow
the default forward's. Prints 'ok'."""

import torch

import rlx.logprobs
import rlx.models.exact
import rlx.rollout.native.runner
import rlx.rollout.sampling
from rlx.models.exact import exact_forward
from tests.stages.test_exact import _generate, _trainer_logprobs, wiring_loss_and_grads, wiring_model

for module in (rlx.logprobs, rlx.models.exact, rlx.rollout.native.runner, rlx.rollout.sampling):
    module.use_triton = lambda tensor: True

calls = []
_attention = rlx.rollout.native.runner.exact_attention
rlx.rollout.native.runner.exact_attention = lambda *a, **k: calls.append(1) or _attention(*a, **k)


model = wiring_model()
at = 1
# temperature 0.7, not 1: the kernels divide by the temperature themselves (no float32 copy of the logits), and 1
# takes the same path (no kernel special-cases it); each temperature costs ~20 s in the interpreter
for temperature in (0.7,):
    requests, generated = _generate(model, True, 3, at, temperature)
    reference = torch.tensor(generated[at].logprobs, dtype=torch.float32)
    for packed in (False, True):
        with exact_forward(model):
            trained = _trainer_logprobs(model, requests, generated, at, 3, packed, temperature)
        assert torch.equal(trained, reference), ("trainer", temperature, packed, (trained - reference).abs().max())
assert calls, "the engine did not attend through the Triton kernel"

ids = torch.randint(3, model.config.vocab_size, (2, 20))
mask = torch.ones_like(ids)
mask[1, :5] = 0


def loss_and_grads(exact: bool):
    return wiring_loss_and_grads(model, ids, mask, exact, temperature=0.9, entropy_coef=0.1)


exact_loss, exact_grads = loss_and_grads(True)
loss, grads = loss_and_grads(False)
assert (exact_loss - loss).abs() < 1e-4, (exact_loss, loss)
assert all((a - b).abs().max() < 1e-4 for a, b in zip(exact_grads, grads))
print("ok")
