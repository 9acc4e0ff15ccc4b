"""Subprocess of tests/unit/test_exact_triton.py (TRITON_INTERPRET=1): exact mode end to end through its Triton
kernels on the CPU, as it runs on CUDA (`use_triton` patched to say yes in every module that asks): the native
engine attends through the Triton attention kernel, its prefill and decode and the trainer's padded and packed
forwards call the fused `silu_mul` and `rotary` kernels (rlx/kernels/exact_fused.py) in every layer, and the engine's
logprobs of a probe sequence in a rollout batch of 3 equal the training forward's, padded and packed, bit for bit
(batch invariance itself: exact_triton_check.py); a training loss's gradients through the kernels follow the
default forward's. Prints 'ok'."""

import torch

import rlx.logprobs
import rlx.models.exact
import rlx.rollout.native.runner
import rlx.rollout.sampling
from rlx.models.exact import exact_forward
from tests.stages.test_exact import _generate, _trainer_logprobs, wiring_loss_and_grads, wiring_model

for module in (rlx.logprobs, rlx.models.exact, rlx.rollout.native.runner, rlx.rollout.sampling):
    module.use_triton = lambda tensor: True

calls = {"attention": [], "silu_mul": [], "rotary": []}
_attention = rlx.rollout.native.runner.exact_attention
rlx.rollout.native.runner.exact_attention = lambda *a, **k: calls["attention"].append(1) or _attention(*a, **k)


def counted(name: str):
    kernel = getattr(rlx.models.exact, name)

    def call(*args):
        calls[name].append(args[0].shape[-2] if name == "rotary" else args[0].shape[:-1].numel())  # tokens
        return kernel(*args)

    return call


for name in ("silu_mul", "rotary"):
    setattr(rlx.models.exact, name, counted(name))


def take_calls() -> dict[str, list[int]]:
    taken = {name: list(tokens) for name, tokens in calls.items()}
    for tokens in calls.values():
        tokens.clear()
    return taken


model = wiring_model()
layers = model.config.num_hidden_layers
at = 1
# temperature 0.7, not 1: the kernels divide by the temperature themselves (no float32 copy of the logits), and 1
# takes the same path (no kernel special-cases it); each temperature costs ~20 s in the interpreter
temperature = 0.7
requests, generated = _generate(model, True, 3, at, temperature)
engine = take_calls()
assert engine["attention"], "the engine did not attend through the Triton kernel"
assert len(engine["silu_mul"]) == len(engine["rotary"]) > layers, engine  # prefill and decode steps, every layer
# decode steps (a token for each running sequence of the 3) and a prefill (every prompt token at once)
assert min(engine["rotary"]) <= 3 < max(engine["rotary"]), engine
reference = torch.tensor(generated[at].logprobs, dtype=torch.float32)
for packed in (False, True):
    with exact_forward(model):
        trained = _trainer_logprobs(model, requests, generated, at, 3, packed, temperature)
    assert torch.equal(trained, reference), ("trainer", packed, (trained - reference).abs().max())
    trainer = take_calls()
    assert len(trainer["silu_mul"]) == len(trainer["rotary"]) == layers, (packed, trainer)

ids = torch.randint(3, model.config.vocab_size, (2, 20))
mask = torch.ones_like(ids)
mask[1, :5] = 0


def loss_and_grads(exact: bool):
    return wiring_loss_and_grads(model, ids, mask, exact, temperature=0.9, entropy_coef=0.1)


exact_loss, exact_grads = loss_and_grads(True)
taken = take_calls()
assert len(taken["silu_mul"]) == len(taken["rotary"]) == layers, taken
loss, grads = loss_and_grads(False)
assert not any(take_calls().values())  # outside the block: the model's own MLP and rotary
assert (exact_loss - loss).abs() < 1e-4, (exact_loss, loss)
assert all((a - b).abs().max() < 1e-4 for a, b in zip(exact_grads, grads))
print("ok")
