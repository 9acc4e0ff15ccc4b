"""Exact mode's Triton kernels (rlx/kernels/exact_triton.py), run by Triton's interpreter on the CPU: per-row
results bit-identical at batch 1, 3 and 17, from packed rows, padded rows and a paged cache (prefill and decode),
close to the PyTorch reference; gradients close to the reference's (the RMSNorm backward kernel's in bfloat16 too);
and the attention kernel compiled for an H100 (no GPU needed): its paged and contiguous variants the same
floating-point instructions. The interpreter runs float32 only where there are dots (its bfloat16 dots are wrong);
tests/gpu/test_exact_cuda.py checks bfloat16 and the engine against the trainer on CUDA."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.conftest import run_script

HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_exact_triton_kernels_in_the_interpreter():
    out = run_script(Path(__file__).parent / "workers" / "exact_triton_check.py", {"TRITON_INTERPRET": "1"}, "float32")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "ok"


RMS_NORM_BACKWARD_CASES = [
    "x float32, weight float32",
    "x bfloat16, weight float32",
    "x bfloat16, weight bfloat16",
    "x float32, weight bfloat16",
    "3-D x, a non-contiguous upstream gradient",
    "an upstream gradient of stride 0 (a sum's)",
    "x's gradient alone",
    "weight's gradient alone",
    "rows not a multiple of the rows per program",
    "no rows",
]


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_exact_rms_norm_backward_kernel_in_the_interpreter():
    """`exact_rms_norm`'s gradients of x and of the weight from its Triton backward close to autograd's through the
    PyTorch formula, in x's and the weight's dtypes (float32 and bfloat16 each), for 3-D inputs, non-contiguous
    upstream gradients, one gradient wanted of the two, a last program short of rows, and no rows; the same bits
    when run again. Every case must report in."""
    out = run_script(Path(__file__).parent / "workers" / "exact_rms_backward_check.py", {"TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines() == [*RMS_NORM_BACKWARD_CASES, "ok"], out.stdout


def test_exact_mode_uses_triton_on_cuda_only():
    import torch

    from rlx.kernels.exact_triton import use_triton

    assert not use_triton(torch.zeros(1))
    assert use_triton(torch.empty(1, device="meta")) is False


@pytest.mark.skipif(
    not HAS_TRITON or importlib.util.find_spec("triton.backends.nvidia") is None, reason="triton's CUDA backend absent"
)
def test_paged_and_contiguous_attention_compile_to_the_same_arithmetic():
    """Compiled for an H100 on the CPU: the engine's (paged) and the trainer's (contiguous) attention kernels run the
    same floating-point instruction sequence, in bfloat16 and float32."""
    out = run_script(Path(__file__).parent / "workers" / "exact_triton_ptx.py")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line.split() for line in out.stdout.strip().splitlines()]
    assert [(dtype, verdict) for dtype, _, verdict in lines] == [("bf16", "same"), ("fp32", "same")], out.stdout
    assert all(int(count) > 50 for _, count, _ in lines)  # the dots, exponentials and reductions were found


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_exact_mode_end_to_end_through_the_triton_kernels_in_the_interpreter():
    """The CUDA wiring on the CPU (`use_triton` patched on, the interpreter running the kernels): the engine attends
    through the Triton kernel, the engine's prefill and decode and the trainer's padded and packed forwards call the
    fused elementwise kernels in every layer, the native engine's logprobs equal the trainer's padded and packed
    forwards bit for bit, and training gradients follow the default forward's."""
    out = run_script(Path(__file__).parent / "workers" / "exact_triton_wiring.py", {"TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "ok"


def test_exact_casts_hold_the_linear_weights_in_the_compute_dtype_at_fixed_addresses():
    """The native engine's cast copies (exact mode on CUDA): every linear weight and bias in bfloat16, the same bits
    as the cast `exact_linear` would make; recast in place after the weights change; and exact_forward's linear
    layers are handed them."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlx.kernels import exact_fused, exact_triton
    from rlx.models import exact as exact_module
    from rlx.models.tiny import build_char_tokenizer, tiny_llama_config
    from rlx.rollout.native.runner import ExactCasts

    torch.manual_seed(0)
    config = tiny_llama_config(len(build_char_tokenizer()), hidden_size=32, num_heads=4, num_kv_heads=2,
                               intermediate_size=64, num_layers=1)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    casts = ExactCasts(model, torch.bfloat16, releasable=False)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    params = {id(m.weight) for m in linears} | {id(m.bias) for m in linears if m.bias is not None}
    assert len(casts.params) == len(params)
    for param, copy in zip(casts.params, casts.copies):
        assert copy.dtype == torch.bfloat16 and torch.equal(copy, param.to(torch.bfloat16))
    proj = model.model.layers[0].mlp.down_proj
    address = casts.by_id[id(proj.weight)].data_ptr()
    with torch.no_grad():
        proj.weight.add_(1.0)
    casts.refresh()
    assert casts.by_id[id(proj.weight)].data_ptr() == address
    assert torch.equal(casts.by_id[id(proj.weight)], proj.weight.to(torch.bfloat16))

    seen = []
    original = exact_module.exact_linear
    try:  # the CUDA dispatch on the CPU: record which weight each linear call gets
        exact_module.use_triton = lambda tensor: True
        exact_module.exact_linear = lambda x, w, b=None, residual=None: (
            seen.append(w) or _linear(x, w.float(), b, residual)
        )
        exact_module.exact_rms_norm = exact_module.rms_norm
        exact_module.silu_mul, exact_module.rotary = exact_fused.silu_mul_reference, exact_fused.rotary_reference
        with torch.no_grad(), exact_module.exact_forward(model, attention=False, casts=casts.by_id):
            model(input_ids=torch.tensor([[3, 4, 5]]))
    finally:
        exact_module.use_triton = exact_triton.use_triton
        exact_module.exact_linear = original
        exact_module.exact_rms_norm = exact_triton.exact_rms_norm
        exact_module.silu_mul, exact_module.rotary = exact_fused.silu_mul, exact_fused.rotary
    assert any(w is casts.by_id[id(proj.weight)] for w in seen) and all(w.dtype == torch.bfloat16 for w in seen)


def _rms_norm_pair_reference(x, weight, eps, low_dtype):
    from rlx.kernels.exact import rms_norm

    out = rms_norm(x, weight, eps)
    return out, out.to(low_dtype)


def test_exact_casts_stack_projections_that_read_the_same_input(monkeypatch):
    """The engine's q/k/v and gate/up copies are views into one stacked weight (refreshed through the views), and
    exact_forward runs each stack as one linear call whose columns are the members' outputs: the logits equal the
    unstacked forward's. A projection behind an adapter (not a plain Linear) stays alone."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlx.models import exact as exact_module
    from rlx.models.tiny import build_char_tokenizer, tiny_llama_config
    from rlx.rollout.native.runner import ExactCasts

    torch.manual_seed(0)
    config = tiny_llama_config(len(build_char_tokenizer()), hidden_size=32, num_heads=4, num_kv_heads=2,
                               intermediate_size=64, num_layers=2)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    casts = ExactCasts(model, torch.bfloat16, releasable=False)
    attention, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    stack = casts.stacks[id(attention.q_proj.weight)]
    assert stack is casts.stacks[id(attention.v_proj.weight)] and stack.sizes == (32, 16, 16)
    assert casts.stacks[id(mlp.gate_proj.weight)].sizes == (64, 64) and id(mlp.down_proj.weight) not in casts.stacks
    assert len(casts.stacks) == 2 * 5
    for param, copy in zip(casts.params, casts.copies):
        assert torch.equal(copy, param.to(torch.bfloat16))
    with torch.no_grad():
        attention.k_proj.weight.add_(1.0)
    casts.refresh()
    assert torch.equal(stack.weight[32:48], attention.k_proj.weight.to(torch.bfloat16))

    calls = _cuda_dispatch(monkeypatch)
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        with exact_module.exact_forward(model, attention=False, casts=casts.by_id):
            alone = model(input_ids=ids).logits
        assert len(calls) == 2 * 7 + 1
        calls.clear()
        with exact_module.exact_forward(model, attention=False, casts=casts.by_id, stacks=casts.stacks):
            stacked = model(input_ids=ids).logits
    assert len(calls) == 2 * 4 + 1 and any(w is stack.weight for w in calls)
    assert torch.allclose(stacked, alone, atol=1e-2), (stacked - alone).abs().max()

    class Adapted(torch.nn.Linear):  # e.g. a LoRA-wrapped projection: its own forward, so no stack
        pass

    adapted = Adapted(32, 32, bias=attention.q_proj.bias is not None)
    adapted.load_state_dict(attention.q_proj.state_dict())
    attention.q_proj = adapted
    fewer = ExactCasts(model, torch.bfloat16, releasable=False)
    assert id(adapted.weight) not in fewer.stacks and id(attention.k_proj.weight) not in fewer.stacks
    assert id(model.model.layers[0].self_attn.q_proj.weight) in fewer.stacks  # the other layer's set
    assert id(mlp.gate_proj.weight) in fewer.stacks


def test_a_bfloat16_models_merged_projections_are_stacked_without_copies(monkeypatch):
    """A model already in the compute dtype (`rlx rollout --exact` on bfloat16 weights) has nothing to cast; once the
    engine lays its q/k/v and gate/up out as rows of merged tensors (`merge_projections`, a model nothing trains),
    ExactCasts stacks each set as that tensor (no copy), and each set runs as one linear call with the logits of the
    unstacked forward. Without the merged layout nothing is stacked."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlx.models import exact as exact_module
    from rlx.models.tiny import build_char_tokenizer, tiny_llama_config
    from rlx.rollout.native.fused import merge_projections
    from rlx.rollout.native.runner import ExactCasts

    torch.manual_seed(0)
    config = tiny_llama_config(len(build_char_tokenizer()), hidden_size=32, num_heads=4, num_kv_heads=2,
                               intermediate_size=64, num_layers=2)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).requires_grad_(False)
    assert ExactCasts(model, torch.bfloat16, releasable=False).stacks == {}
    calls = _cuda_dispatch(monkeypatch)
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad(), exact_module.exact_forward(model, attention=False, casts={}):
        alone = model(input_ids=ids).logits
    assert len(calls) == 2 * 7 + 1
    assert merge_projections(model)
    casts = ExactCasts(model, torch.bfloat16, releasable=False)
    attention = model.model.layers[1].self_attn
    stack = casts.stacks[id(attention.k_proj.weight)]
    assert casts.params == [] and len(casts.stacks) == 2 * 5 and stack.sizes == (32, 16, 16)
    assert stack.weight.data_ptr() == attention.q_proj.weight.data_ptr()  # the merged tensor itself
    assert torch.equal(stack.weight[32:48], attention.k_proj.weight)
    calls.clear()
    with torch.no_grad(), exact_module.exact_forward(model, attention=False, casts=casts.by_id, stacks=casts.stacks):
        stacked = model(input_ids=ids).logits
    assert len(calls) == 2 * 4 + 1
    assert torch.equal(stacked, alone)


def test_the_trainers_projections_are_stacked_at_call_time(monkeypatch):
    """Without the engine's cast stacks (a train step's forward), exact mode on CUDA concatenates each module's
    q/k/v and gate/up weights as the module runs and makes one linear call of them (one matmul and one cast of the
    input a set instead of one a projection); the logits and every parameter's gradient are the unstacked
    forward's."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlx.models import exact as exact_module
    from rlx.models.tiny import build_char_tokenizer, tiny_llama_config

    torch.manual_seed(0)
    config = tiny_llama_config(len(build_char_tokenizer()), hidden_size=32, num_heads=4, num_kv_heads=2,
                               intermediate_size=64, num_layers=2)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    calls = _cuda_dispatch(monkeypatch)
    ids = torch.tensor([[3, 4, 5, 6, 7]])

    def forward_and_grads():
        model.zero_grad()
        calls.clear()
        with exact_module.exact_forward(model, attention=False):
            logits = model(input_ids=ids).logits
        logits.square().mean().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters()], len(calls)

    stacked, stacked_grads, stacked_calls = forward_and_grads()
    model.train()  # checkpointed layers, as rlx/parallel/apply.py sets them: recomputed stacked in the backward too
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": exact_module.checkpoint_contexts}
    )
    recomputed, recomputed_grads, recomputed_calls = forward_and_grads()
    model.gradient_checkpointing_disable()
    model.eval()
    monkeypatch.setattr(exact_module, "projection_sets", lambda model: [])
    alone, alone_grads, alone_calls = forward_and_grads()
    assert (stacked_calls, recomputed_calls, alone_calls) == (2 * 4 + 1, 2 * (2 * 4) + 1, 2 * 7 + 1)
    for logits, grads in ((stacked, stacked_grads), (recomputed, recomputed_grads)):
        torch.testing.assert_close(logits, alone, rtol=1e-5, atol=1e-6)
        for got, want in zip(grads, alone_grads):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_a_norm_read_by_one_stacked_matmul_hands_it_the_16_bit_copy_under_gradients(monkeypatch):
    """In a train step's forward under a 16-bit autocast (CUDA's dispatch), a decoder layer's norm whose output one
    stacked matmul alone reads hands it the norm kernel's 16-bit copy (no cast of a float32 output in the matmul), and
    the gradients are those of the cast; a norm read by unstacked projections keeps its float32 output."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlx.models import exact as exact_module
    from rlx.models.tiny import build_char_tokenizer, tiny_llama_config

    torch.manual_seed(0)
    config = tiny_llama_config(len(build_char_tokenizer()), hidden_size=32, num_heads=4, num_kv_heads=2,
                               intermediate_size=64, num_layers=2)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    layers = model.model.layers
    norms = {id(m) for layer in layers for m in (layer.input_layernorm, layer.post_attention_layernorm)}
    assert exact_module.stacked_norms(model) == norms
    _cuda_dispatch(monkeypatch)
    seen = []
    for layer in layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    ids = torch.tensor([[3, 4, 5, 6, 7]])

    def grads():
        model.zero_grad()
        seen.clear()
        with exact_module.exact_forward(model, attention=False), torch.autocast("cpu", torch.bfloat16):
            model(input_ids=ids).logits.float().square().mean().backward()
        return [p.grad.clone() for p in model.parameters()], list(seen)

    stacked, stacked_dtypes = grads()
    monkeypatch.setattr(exact_module, "projection_sets", lambda model: [])
    assert exact_module.stacked_norms(model) == frozenset()
    alone, alone_dtypes = grads()
    assert stacked_dtypes == [torch.bfloat16] * 4 and alone_dtypes == [torch.float32] * 4
    for got, want in zip(stacked, alone):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-4)


def test_matmul_tiles_follow_the_rows_in_bfloat16_and_the_width_alone_otherwise():
    import torch

    from rlx.kernels import exact_triton as et

    assert et.matmul_tiles(151936, 896, 1) == et.matmul_tiles(4864, 896, 64) == et.SMALL_TILES  # decode steps
    # few rows whose narrow tiles fit the device's SMs (132 on an H100): the narrow tiles
    assert et.matmul_tiles(3584, 18944, 64) == et.matmul_tiles(896, 4864, 256) == et.NARROW_TILES
    assert et.matmul_tiles(3584, 18944, 64, sms=100) == et.SMALL_TILES  # 112 programs on a smaller device
    assert et.matmul_tiles(3584, 3584, 256) == et.SMALL_TILES and et.matmul_tiles(18944, 3584, 256) == et.MEDIUM_TILES
    assert et.matmul_tiles(4864, 896, 16384) == et.MEDIUM_TILES and et.matmul_tiles(3584, 3584, 4096) == et.LARGE_TILES
    for rows in (1, 256, 30000):  # float32 (IEEE dots): the tiles of the weight's width, whatever the rows
        assert et.matmul_tiles(4864, 896, rows, torch.float32) == et.MEDIUM_TILES
        assert et.matmul_tiles(896, 896, rows, torch.float32) == et.SMALL_TILES
        assert et.matmul_tiles(4864, 896, rows, torch.float16) == et.MEDIUM_TILES


def test_matmul_plan_splits_long_k_at_decode_rows_into_programs_that_fit_the_device():
    """A weight whose K `split_k` cuts: at a decode step's rows the chunks run as separate programs where some tile
    set's programs fit twice the SMs (the one with the most), else (and at train rows) a program walks them, with
    tiles that hold two accumulators; K 896 is never cut."""
    import torch

    from rlx.kernels import exact_triton as et

    assert et.matmul_plan(896, 4864, 256) == (et.NARROW_TILES, 2, True)  # 4 x 28 tiles x 2 chunks = 224 programs
    assert et.matmul_plan(3584, 18944, 64) == (et.SPLIT_SMALL_TILES, 4, True)  # narrow: 448 programs, too many
    assert et.matmul_plan(3584, 18944, 256) == (et.SPLIT_WIDE_TILES, 4, True)
    assert et.matmul_plan(3584, 3584, 256) == (et.SMALL_TILES, 2, False)  # none fits: walked
    assert et.matmul_plan(18944, 3584, 64) == (et.SMALL_TILES, 2, False)
    assert et.matmul_plan(896, 4864, 16384) == (et.SPLIT_LARGE_TILES, 2, False)
    assert et.matmul_plan(3584, 3584, 16384) == (et.SPLIT_LARGE_TILES, 2, False)
    assert et.matmul_plan(4864, 896, 256) == (et.matmul_tiles(4864, 896, 256), 1, False)
    assert et.matmul_plan(18944, 3584, 256) == (et.SPLIT_LARGE_TILES, 2, False)  # medium tiles, walked
    assert et.matmul_tiles(9728, 896, 256) == et.DECODE_WIDE_TILES and et.matmul_tiles(9728, 896, 64) == et.SMALL_TILES
    assert et.matmul_plan(896, 4864, 256, torch.float32) == (et.SMALL_TILES, 2, False)


def _linear(x, weight, bias=None, residual=None):
    """`exact_linear`'s contract in PyTorch (the residual added after the product, as eager)."""
    import torch

    out = torch.nn.functional.linear(x, weight, bias)
    return out if residual is None else residual + out


def _cuda_dispatch(monkeypatch) -> list:
    """exact_forward as on CUDA (`use_triton` says yes) with the kernels' PyTorch formulas in their place; the weight
    of each linear call recorded in the returned list."""
    from rlx.kernels import exact_fused
    from rlx.models import exact as exact_module

    calls = []
    monkeypatch.setattr(exact_module, "use_triton", lambda tensor: True)
    monkeypatch.setattr(exact_module, "exact_rms_norm", exact_module.rms_norm)
    monkeypatch.setattr(exact_module, "exact_rms_norm_pair", _rms_norm_pair_reference)
    monkeypatch.setattr(exact_module, "silu_mul", exact_fused.silu_mul_reference)
    monkeypatch.setattr(exact_module, "rotary", exact_fused.rotary_reference)
    monkeypatch.setattr(
        exact_module, "exact_linear", lambda x, w, b=None, residual=None: calls.append(w) or _linear(x, w, b, residual)
    )
    return calls
