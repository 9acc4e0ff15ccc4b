"""Subprocess of tests/unit/test_exact_fused.py (TRITON_INTERPRET=1): exact mode end to end through its fused
elementwise kernels (rlx/kernels/exact_fused.py) on the CPU, as on CUDA (`use_triton` patched to say yes in every
module that asks): the native engine's prefill and decode and the trainer's padded and packed forwards each call
`silu_mul` and `rotary` in every layer, and the engine's logprobs of a probe sequence in a rollout batch of 3 equal
the trainer's bit for bit; a training loss's gradients through the kernels follow the default forward's. Prints
'ok'."""

import torch

import rlx.logprobs
import rlx.models.exact
import rlx.rollout.native.runner
import rlx.rollout.sampling
from rlx.models.exact import exact_forward
from tests.stages.test_exact import _generate, _trainer_logprobs, wiring_loss_and_grads, wiring_model

for module in (rlx.logprobs, rlx.models.exact, rlx.rollout.native.runner, rlx.rollout.sampling):
    module.use_triton = lambda tensor: True

calls = {"silu_mul": [], "rotary": []}


def counted(name: str):
    kernel = getattr(rlx.models.exact, name)

    def call(*args):
        calls[name].append(args[0].shape[-2] if name == "rotary" else args[0].shape[:-1].numel())  # tokens
        return kernel(*args)

    return call


for name in calls:
    setattr(rlx.models.exact, name, counted(name))


def take_calls() -> dict[str, list[int]]:
    taken = {name: list(tokens) for name, tokens in calls.items()}
    for tokens in calls.values():
        tokens.clear()
    return taken


model = wiring_model()
layers = model.config.num_hidden_layers
at = 1
requests, generated = _generate(model, True, 3, at)
engine = take_calls()
assert len(engine["silu_mul"]) == len(engine["rotary"]) > layers, engine  # prefill and decode steps, every layer
assert 1 in engine["rotary"] and max(engine["rotary"]) > 1, engine  # decode steps of one token and a prefill
reference = torch.tensor(generated[at].logprobs, dtype=torch.float32)
for packed in (False, True):
    with exact_forward(model):
        trained = _trainer_logprobs(model, requests, generated, at, 3, packed)
    assert torch.equal(trained, reference), ("trainer", packed, (trained - reference).abs().max())
    trainer = take_calls()
    assert len(trainer["silu_mul"]) == len(trainer["rotary"]) == layers, (packed, trainer)

ids = torch.randint(3, model.config.vocab_size, (2, 12))
mask = torch.ones_like(ids)
mask[1, :4] = 0


def loss_and_grads(exact: bool):
    return wiring_loss_and_grads(model, ids, mask, exact)


exact_loss, exact_grads = loss_and_grads(True)
assert all(len(tokens) == layers for tokens in take_calls().values())
loss, grads = loss_and_grads(False)
assert not any(take_calls().values())  # outside the block: the model's own MLP and rotary
assert (exact_loss - loss).abs() < 1e-4, (exact_loss, loss)
assert all((a - b).abs().max() < 1e-4 for a, b in zip(exact_grads, grads))
print("ok")
