"""Fused logprob + entropy: chunked PyTorch and Triton (interpreter on CPU, CUDA when present) equal
the naive formula in values and gradients; vocab-parallel equals the full vocabulary; the model path
gives the same logprobs and updates as the naive head."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlx.kernels.logprob_entropy import (
    ChunkedLogprobEntropy,
    logprob_entropy,
    naive_logprob_entropy,
    resolve_impl,
)
from tests.conftest import WORKERS, run_script, run_torchrun

HAS_TRITON = __import__("importlib").util.find_spec("triton") is not None


def problem(n=37, h=24, v=301, dtype=torch.float32, seed=0, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * scale).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * scale).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    targets[[3, 7]] = -100  # ignored positions
    upstream = torch.randn(2, n, generator=g, dtype=torch.float64)
    return hidden, weight, targets, upstream


def run(fn, hidden, weight, targets, upstream):
    hidden.grad = weight.grad = None
    logprob, entropy = fn(hidden, weight, targets)
    ((logprob.double() * upstream[0]).sum() + (entropy.double() * upstream[1]).sum()).backward()
    return logprob.detach(), entropy.detach(), hidden.grad.clone(), weight.grad.clone()


def assert_matches(got, want, atol):
    for name, a, b in zip(("logprob", "entropy", "dhidden", "dweight"), got, want):
        assert (a.double() - b.double()).abs().max() <= atol, (name, (a.double() - b.double()).abs().max())


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk", [7, 64, 1000])
def test_chunked_equals_naive_float32(temperature, chunk):
    hidden, weight, targets, up = problem()
    want = run(lambda h, w, t: naive_logprob_entropy(h, w, t, temperature), hidden, weight, targets, up)
    got = run(
        lambda h, w, t: ChunkedLogprobEntropy.apply(h, w, t, temperature, -100, chunk), hidden, weight, targets, up
    )
    assert_matches(got, want, 1e-5)
    assert (got[0][[3, 7]] == 0).all() and (got[1][[3, 7]] == 0).all()
    assert torch.allclose(
        want[1][:3],
        -(
            torch.softmax((hidden @ weight.T).detach()[:3] / temperature, -1)
            * torch.log_softmax((hidden @ weight.T).detach()[:3] / temperature, -1)
        ).sum(-1),
        atol=1e-5,
    )


def test_chunked_gradcheck_float64():
    hidden, weight, targets, _ = problem(n=9, h=6, v=23, dtype=torch.float64)
    fn = lambda h, w: ChunkedLogprobEntropy.apply(h, w, targets, 0.8, -100, 5)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (hidden, weight))


def test_bfloat16_tolerance():
    """bf16 inputs: within 2e-2 of the float32 computation on the same (rounded) inputs (documented)."""
    hidden, weight, targets, up = problem(dtype=torch.bfloat16)
    h32 = hidden.detach().float().requires_grad_()
    w32 = weight.detach().float().requires_grad_()
    want = run(lambda h, w, t: naive_logprob_entropy(h, w, t), h32, w32, targets, up)
    got = run(lambda h, w, t: logprob_entropy(h, w, t, impl="chunked", chunk=50), hidden, weight, targets, up)
    assert_matches(got, want, 2e-2)


def test_impl_resolution():
    assert resolve_impl("auto", torch.device("cpu")) == "naive"
    with pytest.raises(ValueError, match="valid: auto, naive, chunked, triton"):
        resolve_impl("fast", torch.device("cpu"))


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_triton_kernels_in_the_interpreter():
    """The Triton kernels themselves (not a fallback), run by Triton's interpreter on the CPU, against a
    float64 reference: fused matmul kernels, and the cuBLAS-logits + Triton-elementwise variant (both in one
    subprocess: TRITON_INTERPRET must be set before triton is imported)."""
    out = run_script(
        Path(__file__).parent / "workers" / "triton_logprob_check.py", {"TRITON_INTERPRET": "1"}, "fused", "cublas"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    worst = dict(line.split() for line in out.stdout.strip().splitlines()[-2:])
    assert worst.keys() == {"fused", "cublas"} and all(float(v) < 1e-5 for v in worst.values()), worst


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs CUDA and triton")
@pytest.mark.parametrize("variant", ["fused", "cublas"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_on_gpu(dtype, variant, monkeypatch):
    """Relative error ||got - want|| / ||want|| (METHOD.md): float32 within 1e-5 of the float32 formula;
    bfloat16 within 1e-2 of the reference with the same logits precision."""
    monkeypatch.setenv("RLX_LOGPROB_FWD", variant)
    monkeypatch.setenv("RLX_LOGPROB_BWD", variant)
    hidden, weight, targets, up = problem(n=300, h=256, v=5000, dtype=dtype)
    hidden, weight = (hidden.detach().cuda().requires_grad_(), weight.detach().cuda().requires_grad_())
    targets, up = targets.cuda(), up.cuda()
    # the cuBLAS variant rounds logits like the model's head (compare with naive on the same inputs);
    # the fused variant keeps float32 logits (compare with float32 math)
    reference_dtype = dtype if variant == "cublas" else torch.float32
    h2 = hidden.detach().to(reference_dtype).requires_grad_()
    w2 = weight.detach().to(reference_dtype).requires_grad_()
    want = run(lambda h, w, t: naive_logprob_entropy(h, w, t, 0.7), h2, w2, targets, up)
    got = run(lambda h, w, t: logprob_entropy(h, w, t, 0.7, impl="triton"), hidden, weight, targets, up)
    rtol = 1e-5 if dtype == torch.float32 else 1e-2
    for name, x, y in zip(("logprob", "entropy", "dhidden", "dweight"), got, want):
        error = ((x.double() - y.double()).norm() / y.double().norm()).item()
        assert error < rtol, (name, error)


def _model_logprobs(model, impl, batch_seed=0):
    from rlx.logprobs import response_logprobs

    g = torch.Generator().manual_seed(batch_seed)
    prompt = torch.randint(3, 19, (3, 4), generator=g)
    response = torch.randint(3, 19, (3, 5), generator=g)
    prompt_mask = torch.ones_like(prompt, dtype=torch.bool)
    response_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    model.zero_grad()
    logp, ent = response_logprobs(model, prompt, prompt_mask, response, response_mask, 0.9, torch.float32, True, impl)
    ((logp * response_mask).sum() + 0.3 * (ent * response_mask).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return logp * response_mask, ent * response_mask, grads


@pytest.mark.parametrize("tie", [True, False])
def test_model_path_equals_the_naive_head(tie):
    from transformers import AutoModelForCausalLM

    from rlx.models.tiny import tiny_llama_config

    config = tiny_llama_config(19)
    config.tie_word_embeddings = tie
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    lp_n, ent_n, g_n = _model_logprobs(model, "naive")
    lp_c, ent_c, g_c = _model_logprobs(model, "chunked")
    assert torch.allclose(lp_n, lp_c, atol=1e-5) and torch.allclose(ent_n, ent_c, atol=1e-5)
    for name in g_n:
        assert torch.allclose(g_n[name], g_c[name], atol=1e-5), name


@pytest.mark.parametrize("world,impls", [(2, ["chunked", "triton"]), (4, ["chunked"])], ids=["2", "4"])
def test_vocab_parallel_equals_the_full_vocabulary(world, impls):
    """Each implementation over `world` vocabulary shards; the implementations of one world share a launch."""
    env = {"TRITON_INTERPRET": "1"} if "triton" in impls else {}  # the Triton kernels on the CPU
    out = run_torchrun(world, WORKERS / "vocab_parallel.py", *impls, timeout=300, env=env)
    assert all(f"rank {rank}: {impl} ok" in out.stdout for rank in range(world) for impl in impls), out.stdout
