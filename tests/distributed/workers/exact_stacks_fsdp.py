"""torchrun worker of tests/distributed/test_distributed.py: exact mode's trainer-side q/k/v and gate/up stacks
(rlx/models/exact.py) on an FSDP2-sharded model, the CUDA dispatch patched on over gloo (plain F.linear in place of
the Triton matmul): each module's forward pre-hook finds the unsharded parameters FSDP put in place, so every set runs
as one linear call (and each layer's o and down projections find theirs to take the residual stream), and the loss
and gradients equal those of the same model unstacked. Prints 'stacks equal'."""

import torch

from rlx.kernels import exact_fused
from rlx.models import exact as exact_module
from rlx.models.tiny import tiny_llama_config
from rlx.parallel.dist import exit_process, setup
from rlx.parallel.fsdp import apply_fsdp

ctx = setup("cpu")
torch.manual_seed(0)
from transformers import AutoModelForCausalLM  # noqa: E402

config = tiny_llama_config(37, num_heads=2, num_kv_heads=1)
config.attention_bias = True  # q/k/v biases (Qwen2's layout): stacked with the weights
model = AutoModelForCausalLM.from_config(config)
apply_fsdp(model, ctx, torch.float32)
calls = []
exact_module.use_triton = lambda tensor: True
exact_module.exact_rms_norm = exact_module.rms_norm
exact_module.silu_mul, exact_module.rotary = exact_fused.silu_mul_reference, exact_fused.rotary_reference
folded = []


def linear(x, w, b=None, residual=None):
    calls.append(w)
    folded.append(residual is not None)
    out = torch.nn.functional.linear(x, w, b)
    return out if residual is None else residual + out


exact_module.exact_linear = linear
ids = torch.tensor([[3, 4, 5, 6, 7, 8]]) + ctx.rank


def loss_and_grads():
    model.zero_grad()
    calls.clear()
    folded.clear()
    with exact_module.exact_forward(model, attention=False):
        loss = model(input_ids=ids).logits.square().mean()
    loss.backward()
    assert folded.count(True) == 2 * model.config.num_hidden_layers  # each layer's o and down take the residual
    return loss.detach(), [p.grad.full_tensor().clone() for p in model.parameters()], len(calls)


layers = model.config.num_hidden_layers
loss, grads, stacked_calls = loss_and_grads()
exact_module.projection_sets = lambda model: []
want_loss, want_grads, alone_calls = loss_and_grads()
assert (stacked_calls, alone_calls) == (layers * 4 + 1, layers * 7 + 1), (stacked_calls, alone_calls)
torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-7)
for got, want in zip(grads, want_grads):
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
if ctx.is_main:
    print("stacks equal", flush=True)
exit_process()
