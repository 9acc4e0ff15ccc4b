"""Exact mode's fused elementwise kernels (rlx/kernels/exact_fused.py: the MLP's SiLU-and-multiply and rotary) and
how rlx/models/exact.py plugs them in. The kernels run in Triton's interpreter on the CPU (workers/exact_fused_check.py:
close to the PyTorch formulas, gradients too, each row's bits the same in any batch; compiled for sm_90, the same
rounding instructions however Triton specialises them: workers/exact_fused_ptx.py); exact_forward replaces each
supported family's MLP forward and its modeling module's `apply_rotary_pos_emb` where the Triton kernels run, and
only there, and restores them (nested blocks included); the engine and the trainer both run them and still agree
bit for bit (workers/exact_triton_wiring.py, run by tests/unit/test_exact_triton.py). tests/gpu/test_exact_cuda.py
checks the engine against the trainer on CUDA, where these kernels run in bfloat16."""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path

import pytest
import torch

from tests.conftest import run_script

HAS_TRITON = importlib.util.find_spec("triton") is not None
SMALL = dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)  # fmt: skip


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_fused_kernels_in_the_interpreter():
    out = run_script(Path(__file__).parent / "workers" / "exact_fused_check.py", {"TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "ok"


@pytest.mark.skipif(
    not HAS_TRITON or importlib.util.find_spec("triton.backends.nvidia") is None, reason="triton's CUDA backend absent"
)
def test_fused_kernels_round_alike_however_triton_specialises_them():
    """Compiled for an H100 on the CPU, without alignment hints, with them (contiguous or strided rows) and for a
    decode step (one token a sequence): the same rounding instructions, forward and backward, in each dtype."""
    out = run_script(Path(__file__).parent / "workers" / "exact_fused_ptx.py")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line.split() for line in out.stdout.strip().splitlines()]
    assert len(lines) == 10 and all(verdict == "same" for *_, verdict in lines), out.stdout
    assert all(int(count) >= 48 for _, _, count, _ in lines)  # the multiplies, fmas and conversions were found


def _family_model(family: str, **overrides):
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    config = {
        "llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
        "mistral": lambda **kw: MistralConfig(sliding_window=None, **kw),
    }[family](**SMALL, **overrides)  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def _cuda_dispatch(monkeypatch) -> list[str]:
    """exact_forward as on CUDA (`use_triton` says yes), the fused ops' PyTorch formulas standing in for the kernels
    (recording each call) and the matmul and RMSNorm plain: the wiring without the interpreter."""
    from rlx.kernels import exact_fused
    from rlx.models import exact as exact_module

    calls = []
    monkeypatch.setattr(exact_module, "use_triton", lambda tensor: True)
    monkeypatch.setattr(exact_module, "exact_linear", _linear)
    monkeypatch.setattr(exact_module, "exact_rms_norm", exact_module.rms_norm)
    monkeypatch.setattr(
        exact_module, "silu_mul", lambda *a: calls.append("silu_mul") or exact_fused.silu_mul_reference(*a)
    )
    monkeypatch.setattr(exact_module, "rotary", lambda *a: calls.append("rotary") or exact_fused.rotary_reference(*a))
    return calls


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_exact_forward_plugs_the_fused_ops_in_and_restores_them(family, monkeypatch):
    """Each supported family's modeling module defines the `apply_rotary_pos_emb` its attention calls, equal to
    `rotary_reference` bit for bit (fails when transformers changes it). On the CPU's dispatch exact_forward leaves
    the MLPs and rotary alone; on CUDA's, every layer runs `silu_mul` and `rotary` inside the block, nested blocks
    too, with the model's own logits; on exit the MLPs' forward and the module's function are the upstream ones."""
    from rlx.kernels.exact_fused import rotary_reference
    from rlx.models import exact as exact_module

    model = _family_model(family)
    layers, ids = model.config.num_hidden_layers, torch.tensor([[3, 4, 5, 6, 7]])
    modeling = sys.modules[type(model.model.layers[0].self_attn).__module__]
    upstream, mlps = modeling.apply_rotary_pos_emb, [layer.mlp for layer in model.model.layers]
    assert exact_module.rotary_modules(model) == [modeling] and exact_module.silu_mlps(model) == mlps
    q, k, cos, sin = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    assert all(torch.equal(a, b) for a, b in zip(upstream(q, k, cos, sin), rotary_reference(q, k, cos, sin)))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        with exact_module.exact_forward(model, attention=False):  # the CPU's scheme: nothing replaced
            assert modeling.apply_rotary_pos_emb is upstream and not any("forward" in m.__dict__ for m in mlps)

    calls = _cuda_dispatch(monkeypatch)
    with torch.no_grad(), exact_module.exact_forward(model, attention=False):
        with exact_module.exact_forward(model, attention=False):
            inner = model(input_ids=ids).logits
        assert isinstance(modeling.apply_rotary_pos_emb, exact_module._ExactRotary)  # the outer block's still
        got = model(input_ids=ids).logits
        other = []  # a thread outside any exact block: the upstream function, nothing recorded
        elsewhere = threading.Thread(target=lambda: other.append(modeling.apply_rotary_pos_emb(q, k, cos, sin)))
        elsewhere.start()
        elsewhere.join()
    assert len(other) == 1 and all(torch.equal(a, b) for a, b in zip(other[0], upstream(q, k, cos, sin)))
    assert sorted(calls) == ["rotary"] * 2 * layers + ["silu_mul"] * 2 * layers
    assert modeling.apply_rotary_pos_emb is upstream and not any("forward" in m.__dict__ for m in mlps)
    assert torch.equal(inner, got)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_exact_layers_fold_their_residual_adds_into_the_o_and_down_projections(family, monkeypatch):
    """On CUDA's dispatch each decoder layer runs `_exact_layer`: its o and down projections are handed the residual
    stream (one linear call each takes it) and the logits and gradients are those of the model's own layer forward
    in the same exact block, bit for bit (fails when transformers changes the layer's forward). A layer whose o
    projection is not a plain Linear (an adapter's) keeps its own forward."""
    from rlx.models import exact as exact_module

    model = _family_model(family)
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    _cuda_dispatch(monkeypatch)
    folded = []

    def linear(x, weight, bias=None, residual=None):
        folded.append(residual is not None)
        return _linear(x, weight, bias, residual)

    monkeypatch.setattr(exact_module, "exact_linear", linear)

    def run(layers_replaced: bool):
        model.zero_grad()
        if not layers_replaced:
            monkeypatch.setattr(exact_module, "decoder_layers", lambda m: [])
        with exact_module.exact_forward(model, attention=False):
            logits = model(input_ids=ids).logits
        logits.pow(2).mean().backward()
        monkeypatch.setattr(exact_module, "decoder_layers", decoder_layers)
        return logits.detach(), [p.grad.clone() for p in model.parameters()]

    decoder_layers = exact_module.decoder_layers
    assert decoder_layers(model) == list(model.model.layers)
    want, want_grads = run(layers_replaced=False)
    assert not any(folded)
    got, got_grads = run(layers_replaced=True)
    assert folded.count(True) == 2 * model.config.num_hidden_layers
    assert torch.equal(got, want)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert not any("forward" in layer.__dict__ for layer in model.model.layers)  # restored on exit

    class Adapted(torch.nn.Linear):  # e.g. a LoRA-wrapped projection: the layer keeps its own forward
        pass

    first = model.model.layers[0]
    adapted = Adapted(first.self_attn.o_proj.in_features, first.self_attn.o_proj.out_features, bias=False)
    first.self_attn.o_proj = adapted
    assert decoder_layers(model) == list(model.model.layers)[1:]


def test_exact_forward_leaves_other_activations_alone(monkeypatch):
    """An MLP whose activation is not SiLU keeps its own forward on CUDA's dispatch (rotary is still replaced)."""
    from rlx.models import exact as exact_module

    model = _family_model("llama", hidden_act="gelu_pytorch_tanh")
    assert exact_module.silu_mlps(model) == []
    calls = _cuda_dispatch(monkeypatch)
    with torch.no_grad(), exact_module.exact_forward(model, attention=False):
        model(input_ids=torch.tensor([[3, 4, 5]]))
    assert calls == ["rotary"] * model.config.num_hidden_layers


def _linear(x, weight, bias=None, residual=None):
    """`exact_linear`'s contract in PyTorch (the residual added after the product, as eager)."""
    import torch

    out = torch.nn.functional.linear(x, weight, bias)
    return out if residual is None else residual + out
