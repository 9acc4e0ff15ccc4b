"""Exact mode on CUDA, through its Triton kernels (rlx/kernels/exact_triton.py): the kernels' per-row results do not
depend on the batch in bfloat16, and the native engine's rollout logprobs equal the training forward's, bit for bit,
at rollout batch sizes 1, 3 and 17 and in padded and packed micro-batches (bfloat16 autocast, as on a GPU run)."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from rlx.models.tiny import build_char_tokenizer, tiny_llama_config
from rlx.rollout.config import NativeConfig, RolloutConfig, SamplingParams
from tests.conftest import make_engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("triton") is None, reason="needs CUDA and triton"
    ),
]


def test_every_matmul_tile_set_gives_the_same_bits():
    """`matmul_tiles` picks tiles by the call's rows: a row must get the same bits from each of its tile sets (and
    the bench's other candidates), so a 1-row decode call and a 20,000-row train call agree."""
    from rlx.kernels import exact_triton as et

    torch.manual_seed(0)
    sets = [et.NARROW_TILES, et.SMALL_TILES, et.MEDIUM_TILES, et.LARGE_TILES, (16, 64, 64, 4, 4), et.SPLIT_LARGE_TILES,
            et.SPLIT_SMALL_TILES, et.SPLIT_WIDE_TILES, et.DECODE_WIDE_TILES]  # fmt: skip
    # K 4,864 and 3,584 cut into 2 chunks, 18,944 into 4 (`split_k`): 300 rows or fewer as separate programs
    for outputs, depth in ((4864, 896), (896, 4864), (128, 896), (14336, 1024), (3584, 3584), (3584, 18944)):
        x = torch.randn(20000, depth, device="cuda").bfloat16()
        w = (torch.randn(outputs, depth, device="cuda") / depth**0.5).bfloat16()
        full = et.exact_matmul(x, w)  # the rule's tiles for 20,000 rows
        for tiles in sets:
            assert torch.equal(et.exact_matmul(x, w, tiles=tiles), full), (outputs, depth, tiles)
        for count in (1, 64, 300, 3000):  # the rule's tiles for these counts
            assert torch.equal(et.exact_matmul(x[-count:], w), full[-count:]), (outputs, depth, count)
    assert et.matmul_tiles(14336, 1024, 20000) == et.LARGE_TILES and et.matmul_tiles(896, 4864, 300) == et.SMALL_TILES
    assert et.matmul_tiles(896, 4864, 64) == et.NARROW_TILES  # the counts above take the narrow tiles too
    x, bias, residual = torch.randn(3000, 4864, device="cuda"), torch.randn(896, device="cuda"), torch.randn(3000, 896)
    w = (torch.randn(896, 4864, device="cuda") / 4864**0.5).bfloat16()
    full = et.exact_matmul(x, w, bias.bfloat16(), residual=residual.cuda())  # float32 x rounded in the loads
    for count in (1, 64, 300):
        part = et.exact_matmul(x[-count:], w, bias.bfloat16(), residual=residual[-count:].cuda())
        assert torch.equal(part, full[-count:]), count
    assert not any(counts.any() for counts in et._COUNTS.values())  # each tile's count left at zero


def test_triton_kernels_are_batch_invariant_in_bfloat16():
    from rlx.kernels.exact import KEY_BLOCK
    from rlx.kernels.exact_triton import exact_attention, exact_matmul, exact_rms_norm_pair, packed_positions

    torch.manual_seed(0)
    x = torch.randn(300, 896, device="cuda").bfloat16()
    for outputs in (4864, 896, 128):  # the wide tiles and the narrow ones (NARROW_N)
        w, bias = torch.randn(outputs, 896, device="cuda").bfloat16(), torch.randn(outputs, device="cuda").bfloat16()
        full = exact_matmul(x, w, bias)
        for count, first in ((1, 0), (1, 200), (3, 77), (17, 130), (129, 171)):
            assert torch.equal(exact_matmul(x[first : first + count], w, bias), full[first : first + count]), count
        want = torch.nn.functional.linear(x, w, bias).float()
        torch.testing.assert_close(full.float(), want, atol=0.5, rtol=2e-2)
        # a float32 input rounded inside the kernel (the engine's generation) is the trainer's cast, bit for bit
        wide = torch.randn(300, 896, device="cuda")
        assert torch.equal(exact_matmul(wide, w, bias), exact_matmul(wide.bfloat16(), w, bias))
        # a float32 residual added in the kernel (a decoder layer's o / down projection) is the eager add, bit for
        # bit, whatever the rows (and so the tiles)
        residual = torch.randn(300, outputs, device="cuda")
        summed = exact_matmul(x, w, bias, residual=residual)
        assert summed.dtype == torch.float32 and torch.equal(summed, residual + full)
        for count, first in ((1, 0), (17, 130), (129, 171)):
            rows = slice(first, first + count)
            assert torch.equal(exact_matmul(x[rows], w, bias, residual=residual[rows]), summed[rows]), count
    # RMSNorm also written in bfloat16 (a decoder layer's norms feeding linears) is its float32 result's cast
    norm, low = exact_rms_norm_pair(wide, torch.randn(896, device="cuda"), 1e-6, torch.bfloat16)
    assert low.dtype == torch.bfloat16 and torch.equal(low, norm.bfloat16())
    # attention: 17 sequences packed, then the last 3 alone and from a paged cache (decode of each last token)
    lengths = torch.tensor([1, 31, 32, 33, 64, 65, 100, 63, 2, 250, 129, 40, 3, 128, 5, 77, 300])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).cuda()
    q = torch.randn(int(lengths.sum()), 14, 64, device="cuda").bfloat16()
    k, v = (torch.randn(q.shape[0], 2, 64, device="cuda").bfloat16() for _ in range(2))
    starts, keys = packed_positions(cu, q.shape[0])
    out = exact_attention(q, k, v, keys, 0.125, starts=starts)
    tail = slice(int(cu[14]), int(cu[17]))
    starts3, keys3 = packed_positions(cu[14:] - cu[14], tail.stop - tail.start)
    alone = exact_attention(q[tail], k[tail], v[tail], keys3, 0.125, starts=starts3)
    assert torch.equal(alone, out[tail])
    block_size = 16
    tables = torch.arange(3 * 20, device="cuda", dtype=torch.int32).flip(0).view(3, 20)  # blocks in reverse order
    k_cache, v_cache = (torch.zeros(60, block_size, 2, 64, device="cuda").bfloat16() for _ in range(2))
    for row, seq in enumerate(range(14, 17)):
        n, pos = int(lengths[seq]), torch.arange(int(lengths[seq]), device="cuda")
        slots = tables[row].long()[pos // block_size] * block_size + pos % block_size
        k_cache.view(-1, 2, 64)[slots] = k[cu[seq] : cu[seq] + n]
        v_cache.view(-1, 2, 64)[slots] = v[cu[seq] : cu[seq] + n]
    last = cu[15:] - 1
    decode = exact_attention(q[last], k_cache, v_cache, lengths[14:].cuda(), 0.125, rows=torch.arange(3, device="cuda"),
                             block_tables=tables)  # fmt: skip
    assert torch.equal(decode, out[last])
    # the decode kernel writing the step's keys itself (their slots emptied first), int32 lengths as prepared
    slots = torch.stack([tables[row].long()[(int(lengths[seq]) - 1) // block_size] * block_size
                         + (int(lengths[seq]) - 1) % block_size for row, seq in enumerate(range(14, 17))])  # fmt: skip
    k_gap, v_gap = k_cache.clone(), v_cache.clone()
    k_gap.view(-1, 2, 64)[slots] = v_gap.view(-1, 2, 64)[slots] = 0
    written = exact_attention(q[last], k_gap, v_gap, lengths[14:].cuda().int(), 0.125,
                              rows=torch.arange(3, device="cuda"), block_tables=tables,
                              new_kv=(k[last], v[last], slots))  # fmt: skip
    assert torch.equal(written, decode) and torch.equal(k_gap, k_cache) and torch.equal(v_gap, v_cache)
    assert KEY_BLOCK == 64  # the lengths above straddle its blocks (63/64/65, 128/129)


def _logprobs(model, exact: bool) -> dict[str, torch.Tensor]:
    from rlx.logprobs import packed_response_logprobs, response_logprobs
    from rlx.models.exact import exact_forward
    from tests.stages.test_exact import NEW_TOKENS, _requests, _tensors

    out, tokens = {}, None
    tokenizer = build_char_tokenizer()
    for batch, at in ((1, 0), (3, 1), (17, 9)):
        sampling = SamplingParams(max_new_tokens=NEW_TOKENS)
        cfg = RolloutConfig(engine="native", exact=exact, precision="bfloat16", device="cuda", kv_cache_gib=0.05,
                            sampling=sampling, native=NativeConfig(block_size=4))  # fmt: skip
        engine = make_engine(model, tokenizer, cfg, device="cuda")
        requests = _requests(batch, at)
        generated = engine.generate_tokens(requests, dataclasses.replace(cfg.sampling, seed=3))
        assert engine._runner.graphs, "decode ran eagerly: exact mode with triton replays CUDA graphs"
        out[f"rollout/{batch}"] = torch.tensor(generated[at].logprobs, dtype=torch.float32)
        tokens = tokens or generated[at].response_ids
        assert generated[at].response_ids == tokens or not exact
    for compute in (response_logprobs, packed_response_logprobs):
        for batch in (1, 3, 17):
            others = [i for i in range(len(requests)) if i != at][: batch - 1]
            rows = others[: len(others) // 2] + [at] + others[len(others) // 2 :]
            tensors = {k: t.cuda() for k, t in _tensors(requests, generated, rows).items()}
            with torch.no_grad(), exact_forward(model) if exact else torch.no_grad():
                logp, _ = compute(model, **tensors, temperature=1.0, dtype=torch.bfloat16)
            out[f"{compute.__name__}/{batch}"] = logp[rows.index(at), : len(generated[at].response_ids)].float().cpu()
            if batch == 3 and exact:  # the train step's forward: autograd on (its inputs cast, not the kernel)
                with torch.enable_grad(), exact_forward(model):
                    logp, _ = compute(model, **tensors, temperature=1.0, dtype=torch.bfloat16)
                assert logp.requires_grad
                trained = logp[rows.index(at), : len(generated[at].response_ids)]
                out[f"{compute.__name__}/grad"] = trained.detach().float().cpu()
    return out


def _sharp_model():
    """The tiny Llama of the rollout-vs-trainer checks on CUDA, in eval mode (initializer range 0.2: peaked logits,
    so sampled tokens are not ties)."""
    from transformers import AutoModelForCausalLM

    config = tiny_llama_config(len(build_char_tokenizer()), hidden_size=256, num_heads=4, num_kv_heads=2,
                               intermediate_size=512)  # fmt: skip
    config.initializer_range = 0.2
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").cuda().eval()


def test_exact_rollout_logprobs_equal_the_trainers_through_triton():
    model = _sharp_model()
    exact = _logprobs(model, exact=True)
    reference = exact["rollout/1"]
    for name, logp in exact.items():
        assert torch.equal(logp, reference), (name, (logp - reference).abs().max())
    plain = _logprobs(model, exact=False)
    assert any(not torch.equal(logp, plain["rollout/17"]) for logp in plain.values()), "the test could not fail"


def test_exact_multi_turn_cached_turns_equal_the_trainers_through_triton():
    """A second turn reading its first turn's blocks from the engine's cache (a multi-turn episode's stream) gets the
    logprobs of the same context generated fresh (checked inside `cached_second_turn`) and of the trainer's packed
    forward over it, bit for bit, in bfloat16 through the Triton kernels."""
    from rlx.logprobs import packed_response_logprobs
    from rlx.models.exact import exact_forward
    from tests.stages.test_exact import NEW_TOKENS, _tensors, cached_second_turn

    model = _sharp_model()
    sampling = SamplingParams(max_new_tokens=NEW_TOKENS)
    cfg = RolloutConfig(engine="native", exact=True, precision="bfloat16", device="cuda", kv_cache_gib=0.05,
                        sampling=sampling, native=NativeConfig(block_size=4))  # fmt: skip
    request, second = cached_second_turn(make_engine(model, build_char_tokenizer(), cfg, device="cuda"), cfg.sampling)
    tensors = {k: t.cuda() for k, t in _tensors([request], [second], [0]).items()}
    with torch.no_grad(), exact_forward(model):
        logp, _ = packed_response_logprobs(model, **tensors, temperature=1.0, dtype=torch.bfloat16)
    trained = logp[0, : len(second.response_ids)].float().cpu()
    assert torch.equal(trained, torch.tensor(second.logprobs, dtype=torch.float32))


def test_exact_training_gradients_follow_the_float32_forward():
    """A training loss through exact mode's Triton path (matmul, attention and log-probabilities, each with its own
    backward) on a left-padded batch under bfloat16 autocast: its value and gradients those of the default forward in
    float32, up to bfloat16 rounding; in float32, those of the default forward to float32 rounding.

    (The reference is float32 because the default bf16 forward is the further one from it here: on an H100, cosine
    0.963 for some MLP gradients of this left-padded batch against >= 0.9999 for exact mode's.)"""
    import contextlib

    from transformers import AutoModelForCausalLM

    from rlx.logprobs import logprobs_from_logits
    from rlx.models.exact import exact_forward

    config = tiny_llama_config(len(build_char_tokenizer()), hidden_size=256, num_heads=4, num_kv_heads=2,
                               intermediate_size=512)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").cuda()
    ids = torch.randint(3, config.vocab_size, (3, 40), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :9] = 0

    def loss_and_grads(exact: bool, bf16: bool):
        model.zero_grad()
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        with autocast, exact_forward(model) if exact else contextlib.nullcontext():
            logits = model(input_ids=ids, attention_mask=mask).logits
            logp, entropy = logprobs_from_logits(logits[:, :-1], ids[:, 1:], 0.9, with_entropy=True)
            weights = mask[:, 1:].float()
            loss = -((logp + 0.1 * entropy) * weights).sum() / weights.sum()
        loss.backward()
        return loss.detach().float(), [p.grad.float().flatten() for p in model.parameters()]

    reference_loss, reference = loss_and_grads(exact=False, bf16=False)
    for bf16, loss_tol, min_cosine in ((True, 2e-3, 0.999), (False, 1e-5, 0.99999)):
        loss, grads = loss_and_grads(exact=True, bf16=bf16)
        torch.testing.assert_close(loss, reference_loss, rtol=loss_tol, atol=loss_tol)
        for got, want in zip(grads, reference):
            assert torch.nn.functional.cosine_similarity(got, want, dim=0) > min_cosine, bf16


def test_exact_multi_turn_reads_cached_turns_alike_through_triton():
    """A second turn whose context begins with the first turn (its blocks cached in the stream) gets, bit for bit,
    the logprobs of the same context generated fresh and of the packed training forward over it, on CUDA in
    bfloat16 (the CPU test of tests/stages/test_exact.py, through the Triton kernels and the decode graphs)."""
    from rlx.logprobs import packed_response_logprobs
    from rlx.models.exact import exact_forward
    from tests.stages.test_exact import NEW_TOKENS, _tensors, cached_second_turn

    model = _sharp_model()
    sampling = SamplingParams(max_new_tokens=NEW_TOKENS)
    cfg = RolloutConfig(engine="native", exact=True, precision="bfloat16", device="cuda", kv_cache_gib=0.05,
                        sampling=sampling, native=NativeConfig(block_size=4))  # fmt: skip
    request, second = cached_second_turn(make_engine(model, build_char_tokenizer(), cfg, device="cuda"), sampling)
    tensors = {k: t.cuda() for k, t in _tensors([request], [second], [0]).items()}
    with torch.no_grad(), exact_forward(model):
        logp, _ = packed_response_logprobs(model, **tensors, temperature=1.0, dtype=torch.bfloat16)
    trained = logp[0, : len(second.response_ids)].float().cpu()
    assert torch.equal(trained, torch.tensor(second.logprobs, dtype=torch.float32))
