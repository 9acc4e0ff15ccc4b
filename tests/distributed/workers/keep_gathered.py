"""torchrun worker of tests/distributed/test_distributed.py (CPU, gloo, 2 ranks): train.keep_gathered. A tiny Qwen2
under FSDP2 runs the trainer's micro-batch loop (three micro-batches, then a scored forward of three) with the layers
kept gathered and without: the same gradients, and the kept run all-gathers each unit once per phase."""

import copy

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Qwen2Config

from rlx.parallel.dist import exit_process, setup
from rlx.parallel.fsdp import apply_fsdp, full_tensor, kept_gathered

ctx = setup("cpu")
calls = {"n": 0}


def counting(original):
    def counted(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    return counted


for name in ("all_gather_single", "all_gather_into_tensor"):  # FSDP2's all-gather (torch 2.13; earlier)
    if hasattr(dist, name):
        setattr(dist, name, counting(getattr(dist, name)))
config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
torch.manual_seed(0)
base = AutoModelForCausalLM.from_config(config)
inputs = [torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(ctx.rank * 10 + i)) for i in range(3)]


def run(keep: bool) -> tuple[dict, int, int]:
    model = apply_fsdp(copy.deepcopy(base), ctx, torch.float32)
    calls["n"] = 0
    with kept_gathered(model, keep):
        for i, ids in enumerate(inputs):
            model.set_requires_gradient_sync(i == len(inputs) - 1)
            if keep:
                model.set_reshard_after_backward(i == len(inputs) - 1)
            model(input_ids=ids).logits.float().pow(2).mean().backward()
    train_calls, calls["n"] = calls["n"], 0
    grads = {n: full_tensor(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad(), kept_gathered(model, keep):
        for ids in inputs:
            model(input_ids=ids)
    # kept: all resharded at the end (FSDP2 registers the sharded DTensors again; gathered, plain tensors)
    assert not keep or all(type(p).__name__ == "DTensor" for p in model.parameters()), "parameters left gathered"
    return grads, train_calls, calls["n"]


kept, kept_train, kept_score = run(True)
plain, plain_train, plain_score = run(False)
assert plain.keys() == kept.keys() and len(plain) > 10
for name, grad in plain.items():
    assert torch.equal(grad, kept[name]), name
units = config.num_hidden_layers + 1  # the decoder layers and the root
assert kept_train == units and kept_score == units, (kept_train, kept_score)
# without: each micro-batch gathers the layers for its forward and again for its backward (the root stays gathered)
assert plain_train >= 6 * config.num_hidden_layers and plain_score >= 3 * config.num_hidden_layers, (
    plain_train, plain_score)  # fmt: skip
print(f"rank {ctx.rank}: kept gathered, all-gathers {kept_train}/{kept_score} against {plain_train}/{plain_score}",
      flush=True)  # fmt: skip
exit_process(0)
