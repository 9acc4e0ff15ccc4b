"""torchrun worker of tests/unit/test_lora.py: LoRA actor and critic train steps under FSDP2 on 2 ranks equal one
process; frozen base weights keep their dtype and values; so does an MoE actor with adapters on its experts
(lora.target_parameters, tests/unit/test_lora_experts.py)."""

import torch

from rlx.algorithms.config import LossConfig
from rlx.logprobs import packed_response_logprobs
from rlx.models.lora import adapters_disabled
from rlx.models.lora_merge import merged_weights
from rlx.models.lora_state import adapter_state
from rlx.models.value import build_value_model
from rlx.parallel.dist import exit_process, setup
from rlx.training.actor import ActorTrainer
from rlx.training.config import OptimConfig, TrainConfig
from rlx.training.critic import CriticTrainer
from tests.unit.test_lora import inputs, make_batch, plain, with_lora
from tests.unit.test_lora_experts import plain_moe, with_experts

ctx = setup("cpu")
cpu, targets = torch.device("cpu"), ["q_proj", "v_proj", "down_proj"]
batch = make_batch(with_lora(plain()))


def frozen(model):
    """name -> (dtype of this rank's storage, full value) of each frozen parameter."""
    out = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            local = param.to_local() if hasattr(param, "to_local") else param
            value = param.full_tensor() if hasattr(param, "full_tensor") else param
            out[name] = (local.dtype, value.detach().clone())
    return out


def check_frozen(model, before, dtype):
    after = frozen(model)
    assert after.keys() == before.keys()
    for name, (stored, value) in after.items():
        assert stored == dtype and torch.equal(value, before[name][1]), name


def train_actor(dtype, distributed, build=lambda dtype: with_lora(plain(), dtype=dtype, target_modules=targets),
                keep_gathered=False):  # fmt: skip
    model = build(dtype)
    before = frozen(model)
    cfg = TrainConfig(
        optim=OptimConfig(lr=1e-2),
        micro_batch_size=1,
        loss=LossConfig(kl_loss_coef=0.1),
        use_packing=True,
        keep_gathered=keep_gathered,
    )
    trainer = ActorTrainer(model, cfg, cpu, dtype, ctx if distributed else None)
    with torch.no_grad(), adapters_disabled(model):  # the sharded model's first forward: the reference
        ref, _ = packed_response_logprobs(model, **inputs(), temperature=1.0, dtype=trainer.dtype)
    for step in range(2):
        trainer.train_step(batch, step)
    check_frozen(model, before, dtype)
    return ref * inputs()["response_mask"], adapter_state(model), merged_weights(model)


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


ref, sharded, merged = train_actor(torch.float32, True)
ref1, single, merged1 = train_actor(torch.float32, False)
initial = adapter_state(with_lora(plain(), target_modules=targets))
assert len(sharded) == 12 and all(not torch.equal(sharded[k], initial[k]) for k in sharded)  # all trained
diff = max(max_diff(sharded, single), max_diff(merged, merged1), (ref - ref1).abs().max().item())
assert diff <= 1e-6, diff
_, kept, _ = train_actor(torch.float32, True, keep_gathered=True)  # layers gathered over the micro-batches
assert max_diff(kept, sharded) == 0.0
_, bf16, _ = train_actor(torch.bfloat16, True)  # frozen bf16 shards beside float32 adapter shards
assert all(torch.isfinite(t).all() and t.dtype == torch.float32 for t in bf16.values())

# an MoE with adapters on q_proj and every expert weight (PEFT's ParamWrappers inside FSDP's layer units)
moe = lambda dtype: with_experts(plain_moe(), dtype=dtype)  # noqa: E731
ref, sharded, merged = train_actor(torch.float32, True, moe)
ref1, single, merged1 = train_actor(torch.float32, False, moe)
initial = adapter_state(moe(torch.float32))
assert len(sharded) == 12 and all(not torch.equal(sharded[k], initial[k]) for k in sharded)  # experts' too
moe_diff = max(max_diff(sharded, single), max_diff(merged, merged1), (ref - ref1).abs().max().item())
assert moe_diff <= 1e-5, moe_diff
_, kept, _ = train_actor(torch.float32, True, moe, keep_gathered=True)
assert max_diff(kept, sharded) == 0.0
_, bf16, _ = train_actor(torch.bfloat16, True, moe)
assert all(torch.isfinite(t).all() and t.dtype == torch.float32 for t in bf16.values())

critic = with_lora(build_value_model(plain(), seed=0), dtype=torch.bfloat16, target_modules=targets)
before = frozen(critic)
critic_cfg = TrainConfig(role="critic", optim=OptimConfig(lr=1e-2), micro_batch_size=1)
CriticTrainer(critic, critic_cfg, cpu, torch.bfloat16, ctx).train_step(batch, 0)
check_frozen(critic, before, torch.bfloat16)
assert all(torch.isfinite(t).all() for t in adapter_state(critic).values())
print(f"rank {ctx.rank}: 2 ranks == 1 rank within {diff:.2e} (MoE experts: {moe_diff:.2e})", flush=True)
exit_process(0)
