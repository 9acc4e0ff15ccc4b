"""torchrun worker of tests/distributed/test_distributed.py: the weights an FSDP2-sharded model hands a rollout engine
(bucketed all-gathers, rows split unevenly over 3 ranks) equal the unsharded model's state dict, name for name; and
the native engine's replica filled from the shards by bucket equals the unsharded model, as filled one by one."""

import torch

from rlx.models.tiny import tiny_llama_config
from rlx.parallel.dist import exit_process, setup
from rlx.parallel.fsdp import apply_fsdp, gathered_weights
from rlx.rollout.native.replica import build_replica, fill_replica

ctx = setup("cpu")
torch.manual_seed(0)
from transformers import AutoModelForCausalLM  # noqa: E402

# 37-token vocabulary, 2 layers: every row count (37, 32, 16, 64, ...) splits unevenly or evenly over 3 ranks
model = AutoModelForCausalLM.from_config(tiny_llama_config(37, num_heads=2, num_kv_heads=1))
expected = {name: tensor.clone() for name, tensor in model.state_dict().items()}
apply_fsdp(model, ctx, torch.float32)
for bucket_bytes in (1, 4096, 1 << 30):  # a tensor per bucket, a few, all in one
    got = list(gathered_weights(model, bucket_bytes))
    assert [n for n, _ in got] == list(expected), [n for n, _ in got]
    for name, tensor in got:
        assert tensor.shape == expected[name].shape and torch.equal(tensor, expected[name]), name
for bucket_bytes in (0, 1, 4096, 1 << 30):  # one parameter at a time (0), then by bucket
    replica, _ = build_replica(model, torch.device("cpu"), torch.bfloat16, False)
    fill_replica(replica, model, bucket_bytes=bucket_bytes)
    for name, param in replica.named_parameters():
        assert param.dtype == torch.bfloat16 and torch.equal(param, expected[name].bfloat16()), (bucket_bytes, name)
if ctx.is_main:
    print("gathered weights equal", flush=True)
exit_process()
