"""Packed rows with "rlx_varlen" attention equal per-sequence and padded forwards, for every family."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.masking_utils import create_causal_mask

from rlx.models.attention import (
    PACKED_ATTENTION,
    enable_packed_attention,
    next_token_targets,
    pack,
    select_kernel,
    unpack,
    varlen_attention,
)

FAMILIES = ("llama", "qwen2", "qwen3", "apertus")
SEQUENCES = [[1, 5, 6, 7, 8, 9], [1, 10, 11, 12], [1, 3, 4, 5, 6, 7, 8, 9, 10]]
ATOL = 1e-5


def tiny_config(family: str, num_kv_heads: int = 2, **overrides):
    """hidden 64, 2 layers, 4 query heads of 16, vocab 19, for one decoder family of transformers."""
    import transformers

    classes = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "apertus": "ApertusConfig"}
    kwargs = dict(
        vocab_size=19, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=num_kv_heads, head_dim=16, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    kwargs.update(overrides)
    return getattr(transformers, classes[family])(**kwargs)


def tiny_model(family: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    config = tiny_config(family, **overrides)
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config).eval()


def per_sequence_logits(model, sequences) -> list[torch.Tensor]:
    """Reference: each sequence alone, no padding, transformers' sdpa attention."""
    model.set_attn_implementation("sdpa")
    return [model(input_ids=torch.tensor([s], device=model.device)).logits[0] for s in sequences]


def padded_logits(model, sequences, left: bool = False) -> list[torch.Tensor]:
    """One right- (or left-) padded batch with an attention mask; the valid rows of each sample."""
    width = max(map(len, sequences))
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for i, s in enumerate(sequences):
        cols = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, cols], mask[i, cols] = torch.tensor(s), 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False).logits
    return [row[m.bool()] for row, m in zip(logits, mask)]


def packed_logits(model, sequences, with_cu_seqlens: bool = False) -> list[torch.Tensor]:
    packed = pack(sequences)
    if with_cu_seqlens:
        logits = model(**packed.model_inputs()).logits
    else:  # transformers' own packed format: positions restart per sample
        logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False).logits
    return unpack(logits, packed.lengths)


def assert_close(got: list[torch.Tensor], want: list[torch.Tensor], atol: float = ATOL):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, (i, g.shape, w.shape)
        assert torch.allclose(g, w, atol=atol), (i, (g - w).abs().max().item())


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_forward_equals_per_sequence_and_padded(family):
    model = tiny_model(family)
    want = per_sequence_logits(model, SEQUENCES)
    # transformers' sdpa reads the packing from the positions too (with a dense [T, T] mask)
    assert_close(packed_logits(model, SEQUENCES), want)
    assert_close(padded_logits(model, SEQUENCES), want)
    enable_packed_attention(model)
    assert model.config._attn_implementation == PACKED_ATTENTION
    assert_close(packed_logits(model, SEQUENCES), want)
    assert_close(packed_logits(model, SEQUENCES, with_cu_seqlens=True), want)
    assert_close(padded_logits(model, SEQUENCES), want)
    assert_close(padded_logits(model, SEQUENCES, left=True), want)


def _grads(model, logits_fn, weights) -> dict[str, torch.Tensor]:
    model.zero_grad()
    logits = logits_fn()
    sum(((lg * w).sum() for lg, w in zip(logits, weights))).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_packed_gradients_equal_per_sequence(family):
    model = tiny_model(family)
    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(len(s), 19, generator=g) for s in SEQUENCES]
    want = _grads(model, lambda: per_sequence_logits(model, SEQUENCES), weights)
    enable_packed_attention(model)
    got = _grads(model, lambda: packed_logits(model, SEQUENCES, with_cu_seqlens=True), weights)
    for name in want:
        assert torch.allclose(got[name], want[name], atol=ATOL), (name, (got[name] - want[name]).abs().max().item())


def test_no_leakage_between_packed_samples():
    """Changing sample 1 leaves samples 2 and 3 (which come after it in the row) exactly as they were."""
    model = tiny_model("llama")
    enable_packed_attention(model)
    before = packed_logits(model, SEQUENCES)
    changed = [[1, 12, 11, 10, 9, 8], *SEQUENCES[1:]]
    after = packed_logits(model, changed)
    assert not torch.allclose(before[0], after[0])
    assert torch.equal(before[1], after[1]) and torch.equal(before[2], after[2])


def test_sliding_window_is_kept_within_each_sample():
    model = tiny_model("qwen2", use_sliding_window=True, sliding_window=3, layer_types=["sliding_attention"] * 2)
    want = per_sequence_logits(model, SEQUENCES)
    enable_packed_attention(model)
    assert_close(packed_logits(model, SEQUENCES, with_cu_seqlens=True), want)
    full = tiny_model("qwen2")  # the window matters: without it the logits differ
    assert not torch.allclose(per_sequence_logits(full, SEQUENCES)[2], want[2], atol=1e-3)


def test_no_dense_mask_is_built_for_packed_rows():
    model = tiny_model("llama")
    enable_packed_attention(model)
    packed = pack(SEQUENCES)
    embeds = model.get_input_embeddings()(packed.input_ids)
    mask = create_causal_mask(model.config, embeds, None, None, position_ids=packed.position_ids)
    assert mask is None
    model.set_attn_implementation("sdpa")  # transformers' sdpa builds [1, 1, T, T]
    dense = create_causal_mask(model.config, embeds, None, None, position_ids=packed.position_ids)
    assert dense.shape[-2:] == (packed.total_len, packed.total_len)


def test_varlen_attention_gqa_matches_dense_block_mask():
    """The kernel alone: query/key/value [N, H, D] against dense attention with a block-diagonal causal mask."""
    g = torch.Generator().manual_seed(0)
    cu_seqlens = torch.tensor([0, 3, 7, 12], dtype=torch.int32)
    q, k, v = torch.randn(12, 4, 8, generator=g), torch.randn(12, 2, 8, generator=g), torch.randn(12, 2, 8, generator=g)
    sample = torch.repeat_interleave(torch.arange(3), cu_seqlens.diff().long())
    allowed = (sample[:, None] == sample[None, :]) & torch.ones(12, 12, dtype=torch.bool).tril()
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1),
        attn_mask=allowed,
    ).transpose(0, 1)  # fmt: skip
    assert select_kernel(q, 0.0) == "sdpa"  # CPU
    got = varlen_attention(q, k, v, cu_seqlens, 5)
    assert torch.allclose(got, dense, atol=1e-6)


@pytest.mark.parametrize("causal, window", [(True, None), (True, 3), (False, None)])
def test_sdpa_backward_matches_autograd(causal, window):
    """The closed-form backward that compiled layers use equals autograd through the per-sample loop (GQA)."""
    from rlx.models.attention import _sdpa_loop, _sdpa_loop_backward

    g = torch.Generator().manual_seed(0)
    cu_seqlens = torch.tensor([0, 3, 7, 7, 12], dtype=torch.int32)
    inputs = [torch.randn(12, h, 8, generator=g, requires_grad=True) for h in (4, 2, 2)]
    out = _sdpa_loop(*inputs, cu_seqlens, 0.3, 0.0, causal, window)
    grad = torch.randn(out.shape, generator=g)
    want = torch.autograd.grad(out, inputs, grad)
    got = _sdpa_loop_backward(grad, *(t.detach() for t in inputs), cu_seqlens, 0.3, causal, window)
    for name, a, b in zip("qkv", got, want):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5), (name, (a - b).abs().max().item())


def _compiled_step(model, sequences, weights):
    """A no-grad packed forward, then one with gradients; the logits of both and the gradients."""
    from rlx.parallel.ulysses import sequence_parallel_forward

    packed = pack(sequences).to(model.device)
    with torch.no_grad():
        scored = unpack(sequence_parallel_forward(model, packed), packed.lengths)
    model.zero_grad()
    logits = unpack(sequence_parallel_forward(model, packed), packed.lengths)
    sum(((lg * w.to(lg)).sum() for lg, w in zip(logits, weights))).backward()
    return scored, {n: p.grad.float() for n, p in model.named_parameters()}


def _assert_one_graph_per_phase(model, sequences, atol):
    """Compiled decoder layers with the training path's attention ("rlx_ulysses" without a group): one graph
    without grad (score) and one with (train), no graph break, the same values as eagerly; a new packing (other
    lengths, more samples) reuses both graphs."""
    import copy

    from torch._dynamo.utils import counters

    from rlx.parallel.fsdp import decoder_layers
    from rlx.parallel.ulysses import enable_ulysses_attention

    enable_ulysses_attention(model)
    compiled = copy.deepcopy(model)
    for layer in decoder_layers(compiled):
        layer.forward = torch.compile(layer.forward, dynamic=True)
    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(1)
    for batch in (sequences, [s[:-1] for s in sequences] + [[1, 2, 3]]):
        weights = [torch.randn(len(s), model.config.vocab_size, generator=g) for s in batch]
        want_logits, want_grads = _compiled_step(model, batch, weights)
        got_logits, got_grads = _compiled_step(compiled, batch, weights)
        assert_close([t.float() for t in got_logits], [t.float() for t in want_logits], atol=atol)
        for name, want in want_grads.items():
            error = (got_grads[name] - want).abs().max().item()
            assert error <= atol * max(1.0, want.abs().max().item()), (name, error)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 2


def test_compiled_packed_layer_is_one_graph_per_phase():
    """On the CPU the per-sample loop and its backward are operators under torch.compile (GQA, a sliding window)."""
    model = tiny_model("qwen2", use_sliding_window=True, sliding_window=3, layer_types=["sliding_attention"] * 2)
    _assert_one_graph_per_phase(model.train(), SEQUENCES, ATOL)


def test_compiled_training_layers_keep_one_graph_for_every_length():
    """apply_parallelism's compile turns off Inductor's size-guarded fusion choice (a recompilation at the first
    small micro-batch on GPUs: the RMSNorm backward's mix-order reduction)."""
    from torch._inductor import config

    from rlx.parallel.apply import ParallelPlan, apply_parallelism
    from rlx.parallel.dist import DistContext

    if not hasattr(config.triton, "mix_order_reduction_non_strict_mode"):
        pytest.skip("this torch's Inductor has no mix-order reduction")
    config.triton.mix_order_reduction_non_strict_mode = False
    apply_parallelism(tiny_model("llama"), DistContext(device=torch.device("cpu")), ParallelPlan(compile=True))
    assert config.triton.mix_order_reduction_non_strict_mode


def test_pack_unpack_and_targets():
    packed = pack([[4, 5, 6], [7], [8, 9]])
    assert packed.input_ids.tolist() == [[4, 5, 6, 7, 8, 9]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 0, 1]]
    assert packed.cu_seqlens.tolist() == [0, 3, 4, 6] and packed.cu_seqlens.dtype == torch.int32
    assert packed.max_len == 3 and packed.lengths == [3, 1, 2] and packed.total_len == 6
    assert next_token_targets(packed).tolist() == [[5, 6, -100, -100, 9, -100]]
    values = torch.arange(12.0).view(1, 6, 2)
    parts = unpack(values, packed.lengths)
    assert [p.shape for p in parts] == [(3, 2), (1, 2), (2, 2)] and torch.equal(torch.cat(parts), values[0])
    assert [p.tolist() for p in unpack(packed.input_ids[0], packed.lengths)] == [[4, 5, 6], [7], [8, 9]]
    with pytest.raises(ValueError, match="6 tokens"):
        unpack(values, [3, 2])
    with pytest.raises(ValueError):
        pack([[1], []])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["torch_varlen", "flash_attn"])
def test_cuda_kernels_match_the_loop(backend, monkeypatch):
    """bfloat16 on CUDA: a varlen kernel against the per-sample loop, forward and backward (GQA, window)."""
    from rlx.models import attention

    if backend == "flash_attn" and attention.flash_attn_varlen_func is None:
        pytest.skip("flash-attn is not installed")
    if backend == "torch_varlen" and attention.varlen_attn is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    g = torch.Generator(device="cuda").manual_seed(0)
    cu_seqlens = torch.tensor([0, 100, 164, 400, 401], dtype=torch.int32, device="cuda")
    shapes = [(401, 8, 64), (401, 2, 64), (401, 2, 64)]
    inputs = [torch.randn(s, generator=g, device="cuda", dtype=torch.bfloat16) for s in shapes]
    for window in (None, 4):  # a small window: an off-by-one in its convention would show
        results = {}
        for name in (backend, "sdpa"):
            monkeypatch.setenv(attention.KERNEL_ENV, name)
            q, k, v = (t.detach().requires_grad_() for t in inputs)
            out = varlen_attention(q, k, v, cu_seqlens, 236, scale=0.125, sliding_window=window)
            out.float().square().sum().backward()
            results[name] = [out.float(), q.grad.float(), k.grad.float(), v.grad.float()]
        for got, want in zip(results[backend], results["sdpa"]):
            error = ((got - want).norm() / want.norm()).item()
            assert error < 2e-2, (backend, window, error)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_model_packed_matches_per_sequence():
    """A bfloat16 model on CUDA through the auto-selected backend: packed logits ~ per-sequence sdpa logits."""
    model = tiny_model("qwen3").to("cuda", torch.bfloat16)
    sequences = [[(7 * i + j) % 16 + 3 for j in range(n)] for i, n in enumerate([70, 5, 130, 33])]
    want = [w.float() for w in per_sequence_logits(model, sequences)]
    enable_packed_attention(model)
    packed = pack(sequences).to("cuda")
    got = [g.float() for g in unpack(model(**packed.model_inputs()).logits, packed.lengths)]
    for g, w in zip(got, want):
        assert ((g - w).norm() / w.norm()).item() < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_compiled_packed_layer_is_one_graph_per_phase():
    """bfloat16 on CUDA through the auto-selected varlen kernel: compiled layers stay one graph per phase."""
    model = tiny_model("qwen3").to("cuda", torch.bfloat16).train()
    sequences = [[(7 * i + j) % 16 + 3 for j in range(n)] for i, n in enumerate([70, 5, 130, 33])]
    _assert_one_graph_per_phase(model, sequences, 3e-2)
