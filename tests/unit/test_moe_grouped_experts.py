"""MoE experts train as grouped GEMMs. Under expert parallelism (rlx/parallel/experts.py) a rank's local experts: the
grouped GEMMs equal the per-expert loop, values and gradients, in float32, bf16 and under autocast, with experts that
get no rows; an EP rank's received rows (grouped by source rank) come back in their order; shapes the grouped kernel
cannot take run the loop. Without EP: rlx's MoE models run transformers' grouped_mm experts, not its eager loop."""

from __future__ import annotations

import pytest
import torch

from rlx.kernels.grouped_experts import grouped_mm_trains
from rlx.parallel.experts import ExpertShard, _run_local_experts, run_sorted_experts

SIZES = [0, 7, 0, 13, 5, 0, 15, 0]  # rows per expert: experts 0, 2, 5 and 7 get none
IDLE = [0, 2, 5, 7]


def build_experts(num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' Qwen3-MoE experts module (fused gate_up [E, 2I, H], down [E, H, I]) with seeded weights."""
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = AutoConfig.for_model(
        "qwen3_moe", hidden_size=hidden, moe_intermediate_size=intermediate, num_experts=num_experts
    )
    experts = Qwen3MoeExperts(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in experts.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return experts.to(dtype)


def outputs_and_grads(experts, rows: torch.Tensor, sizes: list[int], impl: str):
    """run_sorted_experts' output and the gradients of a random projection of it (rows, gate_up, down)."""
    rows = rows.detach().clone().requires_grad_()
    out = run_sorted_experts(experts, experts.gate_up_proj, experts.down_proj, rows, torch.tensor(sizes), impl)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((out.float() * probe).sum(), (rows, experts.gate_up_proj, experts.down_proj))
    return out, *grads


@pytest.mark.parametrize(
    ("weight_dtype", "autocast", "tolerance"),
    [(torch.float32, False, 1e-5), (torch.bfloat16, False, 3e-2), (torch.float32, True, 3e-2)],
    ids=["float32", "bf16", "float32-weights-bf16-autocast"],
)
def test_grouped_gemms_equal_the_per_expert_loop(weight_dtype, autocast, tolerance):
    experts = build_experts(len(SIZES), 32, 16, weight_dtype)
    rows = torch.randn(sum(SIZES), 32, generator=torch.Generator().manual_seed(2))  # float32 activations
    rows = rows if autocast else rows.to(weight_dtype)
    compute_dtype = torch.bfloat16 if autocast else weight_dtype
    if hasattr(torch.nn.functional, "grouped_mm"):  # torch >= 2.10: 'auto' takes the grouped kernel here
        assert grouped_mm_trains(rows.device, compute_dtype, experts.gate_up_proj, experts.down_proj)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        grouped = outputs_and_grads(experts, rows, SIZES, "grouped")
        loop = outputs_and_grads(experts, rows, SIZES, "loop")
    assert grouped[0].dtype == rows.dtype and grouped[0].shape == rows.shape
    for got, want in zip(grouped, loop, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        scale = want.float().abs().max()
        assert scale > 0 and (got.float() - want.float()).abs().max() <= tolerance * scale, (got - want).abs().max()
    gate_up_grad, down_grad = grouped[2], grouped[3]
    assert not gate_up_grad[IDLE].any() and not down_grad[IDLE].any()  # no rows: a zero gradient
    assert all(down_grad[e].any() for e in range(len(SIZES)) if e not in IDLE)


def test_no_rows_gives_zero_gradients_and_a_plain_sum_backpropagates():
    """An EP rank no token was sent to still gives (zero) weight gradients and a gradient path to its (empty)
    received rows (the all-to-all's backward runs on every rank); `out.sum()`'s broadcast gradient goes through the
    grouped kernel's backward."""
    experts = build_experts(4, 32, 16, torch.float32)
    empty = torch.zeros(0, 32, requires_grad=True)
    out = run_sorted_experts(experts, experts.gate_up_proj, experts.down_proj, empty, torch.zeros(4, dtype=torch.long))
    grads = torch.autograd.grad(out.sum(), (empty, experts.gate_up_proj, experts.down_proj))
    assert out.shape == (0, 32) and grads[0].shape == (0, 32)
    assert grads[1].shape == (4, 32, 32) and grads[2].shape == (4, 32, 16) and not grads[1].any() and not grads[2].any()
    rows = torch.randn(6, 32)
    out = run_sorted_experts(experts, experts.gate_up_proj, experts.down_proj, rows, torch.tensor([2, 0, 4, 0]))
    out.sum().backward()
    assert experts.down_proj.grad[[0, 2]].any() and not experts.down_proj.grad[[1, 3]].any()


def test_received_rows_come_back_in_their_order():
    """A rank of an EP group of 2 holding experts 4..7 of 8: rows grouped by source rank, then by local expert, each
    come back as its own expert's MLP (gradients to the weights scaled by 1/2, see rlx/parallel/experts.py)."""
    experts = build_experts(4, 32, 16, torch.float32)
    counts = torch.tensor([[2, 0, 3, 1], [0, 4, 0, 2]])  # [source rank, local expert]
    shard = ExpertShard(group=None, degree=2, rank=1, num_experts=8)
    rows = torch.randn(int(counts.sum()), 32, generator=torch.Generator().manual_seed(3))
    out = _run_local_experts(experts, shard, rows, counts)
    expert_of = torch.arange(4).repeat(2).repeat_interleave(counts.flatten())
    for row, expert in zip(range(rows.shape[0]), expert_of.tolist(), strict=True):
        gate_up = torch.nn.functional.linear(rows[row], experts.gate_up_proj[expert])
        want = torch.nn.functional.linear(experts._apply_gate(gate_up), experts.down_proj[expert])
        assert torch.allclose(out[row], want, atol=1e-5), row
    (grad,) = torch.autograd.grad(out.sum(), experts.down_proj)
    (unscaled,) = torch.autograd.grad(run_sorted_experts(experts, experts.gate_up_proj, experts.down_proj,
                                                         rows[expert_of.argsort(stable=True)], counts.sum(0)).sum(),
                                      experts.down_proj)  # fmt: skip
    assert torch.allclose(grad, unscaled / 2, atol=1e-6)


@pytest.mark.parametrize(("dtype", "intermediate"), [(torch.float32, 6), (torch.bfloat16, 4)])
def test_rows_the_grouped_kernel_cannot_take_run_the_loop(dtype, intermediate):
    """Rows of 24 (float32) or 8 (bf16) bytes break grouped_mm's 16-byte stride rule: 'auto' runs the loop."""
    experts = build_experts(3, 32, intermediate, dtype)
    assert not grouped_mm_trains(torch.device("cpu"), dtype, experts.gate_up_proj, experts.down_proj)
    rows = torch.randn(9, 32, generator=torch.Generator().manual_seed(4)).to(dtype)
    auto = outputs_and_grads(experts, rows, [4, 0, 5], "auto")
    loop = outputs_and_grads(experts, rows, [4, 0, 5], "loop")
    assert all(torch.equal(a, b) for a, b in zip(auto, loop, strict=True))
    with pytest.raises(ValueError, match="local experts impl 'padded'"):
        run_sorted_experts(experts, experts.gate_up_proj, experts.down_proj, rows, torch.tensor([4, 0, 5]), "padded")


def test_under_torch_compile_only_bf16_takes_the_grouped_kernel(monkeypatch):
    """torch.compile's grouped_mm refuses float32: a compiled layer with float32 experts runs the loop."""
    experts = build_experts(3, 32, 16, torch.float32)
    weights = (experts.gate_up_proj, experts.down_proj)
    cpu = torch.device("cpu")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not grouped_mm_trains(cpu, torch.float32, *weights)
    assert grouped_mm_trains(cpu, torch.bfloat16, *weights) == hasattr(torch.nn.functional, "grouped_mm")


@pytest.mark.skipif(not hasattr(torch.nn.functional, "grouped_mm"), reason="torch < 2.10: no CPU grouped_mm")
def test_one_process_moe_runs_transformers_grouped_gemms(monkeypatch):
    """ep_degree 1: an MoE model built as rlx builds one from a checkpoint (`from_config`) keeps transformers' default
    `grouped_mm` experts: each layer's forward runs torch's grouped GEMM twice (gate/up, down), not a per-expert loop,
    and the experts get gradients."""
    from rlx.models.loading import init_random_model
    from rlx.models.moe import tiny_moe_config
    from rlx.models.tiny import build_char_tokenizer

    calls = []
    grouped_mm = torch.nn.functional.grouped_mm
    monkeypatch.setattr(torch.nn.functional, "grouped_mm", lambda *a, **k: calls.append(1) or grouped_mm(*a, **k))
    model = init_random_model(tiny_moe_config(len(build_char_tokenizer())), seed=0)
    assert model.config._experts_implementation == "grouped_mm"
    ids = torch.randint(3, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(5))
    model(input_ids=ids).logits.square().mean().backward()
    assert len(calls) == 2 * model.config.num_hidden_layers
    assert all(layer.mlp.experts.down_proj.grad.any() for layer in model.model.layers)


@pytest.mark.skipif(not hasattr(torch.nn.functional, "grouped_mm"), reason="torch < 2.10: no CPU grouped_mm")
def test_one_process_autocast_runs_the_experts_in_autocasts_dtype(monkeypatch):
    """A lone process trains float32 weights under autocast: after `apply_parallelism` its experts' grouped GEMMs
    take bf16 operands (transformers' own forward casts the tokens to float32), the MoE output equals the per-expert
    loop under the same autocast (F.linear in bf16) to bf16 rounding, gradients reach the float32 experts, and without
    autocast the model's forward is bit for bit transformers' own."""
    from rlx.models.loading import init_random_model
    from rlx.models.moe import tiny_moe_config
    from rlx.models.tiny import build_char_tokenizer
    from rlx.parallel.apply import ParallelPlan, apply_parallelism
    from rlx.parallel.dist import DistContext

    model = init_random_model(tiny_moe_config(len(build_char_tokenizer()), hidden_size=64), seed=0)
    ids = torch.randint(3, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    apply_parallelism(model, DistContext(device=torch.device("cpu")), ParallelPlan())
    assert model.config._experts_implementation == "rlx_autocast_experts"
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, plain)  # no autocast: transformers' own grouped_mm forward
    dtypes = []
    grouped_mm = torch.nn.functional.grouped_mm
    monkeypatch.setattr(
        torch.nn.functional, "grouped_mm", lambda a, b, **k: dtypes.append((a.dtype, b.dtype)) or grouped_mm(a, b, **k)
    )
    experts = model.model.layers[0].mlp.experts
    hidden = torch.randn(12, 64, generator=torch.Generator().manual_seed(2))
    top_k_index = torch.randint(0, experts.gate_up_proj.shape[0], (12, 2), generator=torch.Generator().manual_seed(3))
    top_k_index[:, 1] = (top_k_index[:, 0] + 1) % experts.gate_up_proj.shape[0]  # two different experts per token
    top_k_weights = torch.rand(12, 2, generator=torch.Generator().manual_seed(4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = experts(hidden, top_k_index, top_k_weights)
        loop = type(experts).forward.__wrapped__(experts, hidden, top_k_index, top_k_weights)
    assert dtypes == [(torch.bfloat16, torch.bfloat16)] * 2
    torch.testing.assert_close(ours.float(), loop.float(), rtol=2e-2, atol=2e-2)
    float32 = experts(hidden, top_k_index, top_k_weights)  # outside autocast: transformers' float32 forward
    assert (ours.float() - loop.float()).abs().max() < (ours.float() - float32).abs().max()
    ours.float().square().sum().backward()
    assert experts.gate_up_proj.grad.dtype == torch.float32 and experts.down_proj.grad.any()
