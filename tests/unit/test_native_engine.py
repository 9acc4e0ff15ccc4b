"""The native rollout engine: block manager and scheduler by hand, then the engine against the hf engine."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch

from rlx.formats.records import PromptRecord
from rlx.rollout.config import NativeConfig, RolloutConfig, SamplingParams
from rlx.rollout.native.blocks import BlockManager, Sequence, Status
from rlx.rollout.native.cohort import Cohort
from rlx.rollout.native.inputs import DecodeStaging, bucketed, prefill_rows
from rlx.rollout.native.scheduler import Scheduler
from tests.conftest import cli_ok, flat_config, generate, make_engine, read_jsonl, rollout_args

CPU = torch.device("cpu")


def test_blocks_share_full_prompt_blocks_and_return_when_unused():
    blocks = BlockManager(num_blocks=10, block_size=4)
    a, b = Sequence(0, list(range(10)), 4), Sequence(1, list(range(10)), 4)
    blocks.allocate(a)
    blocks.allocate(b)
    # 10 tokens: blocks [0-3] and [4-7] are full and before the last token: shared; [8-9] is each one's own
    assert a.block_table[:2] == b.block_table[:2] and a.block_table[2] != b.block_table[2]
    assert 0 not in a.block_table + b.block_table  # block 0 is scratch
    assert (a.num_computed, b.num_computed) == (0, 8)  # b reuses what a computes
    assert blocks.num_free == 9 - 4
    assert blocks.slot(b, 9) == b.block_table[2] * 4 + 1
    blocks.release(a)
    assert blocks.num_free == 9 - 3  # the shared blocks stay with b
    c = Sequence(2, list(range(8)) + [99, 98], 4)
    blocks.allocate(c)
    assert c.block_table[:2] == b.block_table[:2] and c.num_computed == 8
    d = Sequence(3, [5] + list(range(1, 10)), 4)  # other first block: nothing shared after it either
    blocks.allocate(d)
    assert d.num_computed == 0 and not set(d.block_table) & set(b.block_table)
    for s in (b, c, d):
        blocks.release(s)
    # nobody holds a block: all are free again, the cached ones kept findable until a new block is needed
    assert blocks.num_free == 9 and set(blocks.cached.values()) == set(blocks.evictable)


def test_a_hash_collision_never_shares_another_prompts_block():
    """Token ids 0 and 2**61 - 1 hash alike in CPython (ints hash modulo 2**61 - 1), so blocks of them collide in
    any hash of the token ids; the cache compares the ids themselves and keeps the two prompts apart."""
    other = 2**61 - 1
    assert hash((0, 0, 0, 0)) == hash((other, other, other, other))
    blocks = BlockManager(num_blocks=10, block_size=4)
    a, b = Sequence(0, [0, 0, 0, 0, 5], 4), Sequence(1, [other] * 4 + [5], 4)
    blocks.allocate(a)
    blocks.allocate(b)
    assert a.block_table[0] != b.block_table[0] and b.num_computed == 0
    c = Sequence(2, [0, 0, 0, 0, 6], 4)  # the same first block as a: shared
    blocks.allocate(c)
    assert c.block_table[0] == a.block_table[0] and c.num_computed == 4
    d = Sequence(3, [other] * 4 + [0, 0, 0, 0, 7], 4)  # a block after b's: keyed by its predecessor, not a's chain
    blocks.allocate(d)
    assert d.block_table[0] == b.block_table[0] and d.block_table[1] not in a.block_table + c.block_table


def test_block_aligned_prompt_leaves_its_last_token_to_compute():
    blocks = BlockManager(num_blocks=6, block_size=4)
    a, b = Sequence(0, list(range(8)), 2), Sequence(1, list(range(8)), 2)
    blocks.allocate(a)
    blocks.allocate(b)
    assert b.num_computed == 4 and a.block_table[0] == b.block_table[0] and a.block_table[1] != b.block_table[1]
    b.output_ids.append(1)
    assert blocks.ensure_slot(b) and len(b.block_table) == 3


def test_prefill_rows_follow_each_token_s_block_and_skip_the_cached_prefix():
    blocks = BlockManager(num_blocks=40, block_size=4)
    seqs = [Sequence(0, list(range(10)), 2), Sequence(1, list(range(100, 109)), 2), Sequence(2, [5, 6, 7], 2)]
    seqs[2].output_ids += [8, 9]  # a preempted sequence recomputes its outputs too
    seqs.append(Sequence(3, list(range(13)), 2))  # shares seq 0's first two full blocks: computed from position 8
    for seq in seqs:
        blocks.allocate(seq)
    assert seqs[3].num_computed == 8 and seqs[0].num_computed == 0
    width = max(len(s.block_table) for s in seqs)
    tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs], dtype=torch.int32)
    rows = prefill_rows(seqs, tables, blocks.block_size)
    expect = [
        (row, pos, seq.token_ids[pos]) for row, seq in enumerate(seqs) for pos in range(seq.num_computed, len(seq))
    ]
    assert rows.q_rows.tolist() == [row for row, _, _ in expect]
    assert rows.positions.tolist() == [pos for _, pos, _ in expect]
    assert rows.tokens.tolist() == [token for _, _, token in expect]
    assert rows.slots.tolist() == [blocks.slot(seqs[row], pos) for row, pos, _ in expect]
    assert rows.q_cols.tolist() == [pos - seqs[row].num_computed for row, pos, _ in expect]
    assert rows.keep.tolist() == [9, 18, 23, 28] and rows.query_lens.tolist() == [10, 9, 5, 5]
    assert rows.starts.tolist() == [seq.num_computed for seq in seqs] == [0, 0, 0, 8]


def test_prefill_shapes_come_in_four_buckets_a_doubling(tiny, monkeypatch):
    """A prefill's padded attention shapes (longest new-token run, block-table width) are rounded up to 4, 5, 6 or 7
    times a power of two (at most 25% more), so they repeat across steps; the padding changes no token."""
    sizes = [bucketed(n) for n in range(1, 2049)]
    assert sizes[:8] == list(range(1, 9)) and [bucketed(n) for n in (9, 51, 57, 129, 1000)] == [10, 56, 64, 160, 1024]
    assert all(n <= b <= 1.25 * n and bucketed(b) == b for n, b in zip(range(1, 2049), sizes))
    assert len(set(sizes[64:128])) == 4  # 65..128: 80, 96, 112, 128
    model, tokenizer = tiny
    cfg = flat_config(RolloutConfig, engine="native", chat_template="off", n=3, max_new_tokens=10, temperature=0,
                      block_size=2)  # fmt: skip
    texts = ["12+7=19, 3*4=12, 5+6", "9-5=4, 20+13="]  # 21 tokens: padded to 24 (11 blocks of 2: 12)
    prompts = [PromptRecord(id=f"q{i}", prompt=text) for i, text in enumerate(texts)]
    padded = generate(make_engine(model, tokenizer, cfg), prompts, cfg)
    seen = []
    monkeypatch.setattr("rlx.rollout.native.runner.bucketed", lambda n: seen.append(n) or n)
    exact_shapes = generate(make_engine(model, tokenizer, cfg), prompts, cfg)
    assert any(bucketed(n) != n for n in seen), seen  # the padded run did pad
    assert [r.response_ids for r in padded] == [r.response_ids for r in exact_shapes]
    for a, b in zip(padded, exact_shapes):
        assert torch.allclose(torch.tensor(a.rollout_logprobs), torch.tensor(b.rollout_logprobs), atol=1e-5)


def run_to_end(scheduler: Scheduler, new_tokens: int) -> list[str]:
    """Drive the scheduler with a fake model that appends token 7; return the step kinds."""
    kinds = []
    while not scheduler.done:
        step = scheduler.schedule()
        kinds.append(step.kind)
        for seq in step.seqs:
            seq.num_computed = len(seq)
            seq.output_ids.append(7)
            if len(seq.output_ids) == new_tokens:
                scheduler.finish(seq, "length")
    return kinds


def test_scheduler_refills_finished_slots_and_respects_limits():
    blocks = BlockManager(num_blocks=64, block_size=4)
    scheduler = Scheduler(blocks, max_num_seqs=2, max_prefill_tokens=100)
    seqs = [Sequence(i, [1, 2, 3], 3) for i in range(3)]
    for s in seqs:
        scheduler.add(s)
    kinds = run_to_end(scheduler, 3)
    assert kinds == ["prefill", "decode", "decode", "prefill", "decode", "decode"]
    assert all(s.status is Status.FINISHED and len(s.output_ids) == 3 for s in seqs)
    assert blocks.num_free == 63


def test_scheduler_preempts_the_newest_when_blocks_run_out_and_recomputes_it():
    blocks = BlockManager(num_blocks=5, block_size=2)  # 4 usable blocks of 2 slots
    scheduler = Scheduler(blocks, max_num_seqs=8, max_prefill_tokens=100)
    seqs = [Sequence(0, [1, 2, 3], 4), Sequence(1, [4, 5, 6], 4)]
    for s in seqs:
        scheduler.add(s)
    kinds = run_to_end(scheduler, 4)
    assert scheduler.preemptions >= 1 and kinds.count("prefill") >= 2
    assert all(s.output_ids == [7, 7, 7, 7] for s in seqs) and blocks.num_free == 4


def test_schedule_ahead_plans_the_next_decode_from_lengths_or_leaves_it_to_the_synchronous_path():
    blocks = BlockManager(num_blocks=6, block_size=2)  # 5 usable blocks
    scheduler = Scheduler(blocks, max_num_seqs=2, max_prefill_tokens=100)
    a, b, c = Sequence(0, [1, 2, 3], 4), Sequence(1, [4, 5], 2), Sequence(2, [6], 4)
    for s in (a, b, c):
        scheduler.add(s)
    assert scheduler.schedule().seqs == [a, b]  # prefill; c waits for a free place
    for s in (a, b):  # the host has read the prefill's tokens
        s.num_computed = len(s)
        s.output_ids.append(7)
    step = scheduler.schedule()
    assert step.kind == "decode" and [len(s.block_table) for s in (a, b)] == [2, 2]
    # while that decode's tokens are on the device: b is at its last token and a needs a third block
    ahead = scheduler.schedule_ahead(step.seqs)
    assert ahead.kind == "decode" and ahead.seqs == [a] and len(a.block_table) == 3 and blocks.num_free == 0
    scheduler.finish(b, "length")  # a place is free and c fits: a prefill is due, the synchronous path decides
    assert scheduler.schedule_ahead([a]) is None and len(a.block_table) == 3
    d = Sequence(3, [1] * 7, 4)  # needs 4 blocks: no prefill possible, but a's next block is missing
    scheduler.waiting[0] = d
    a.output_ids.append(7)
    a.output_ids.append(7)  # 6 tokens, the pending one at position 6 needs a fourth block
    blocks.free.clear()
    blocks.evictable.clear()  # b's cached prompt block too
    assert scheduler.schedule_ahead([a]) is None


def _decoding_batch():
    """Six sequences one decode step in (the host holds its tokens but one step ahead is pending): lengths across
    block boundaries, one at its last token, one finished, one with an mRoPE offset."""
    blocks = BlockManager(num_blocks=40, block_size=4)
    scheduler = Scheduler(blocks, max_num_seqs=8, max_prefill_tokens=1000)
    seqs = [Sequence(i, list(range(10 * i, 10 * i + n)), m) for i, (n, m) in enumerate(
        [(3, 9), (7, 9), (5, 3), (8, 9), (2, 2), (6, 9)])]  # fmt: skip
    seqs[5].position_offset = 11
    for s in seqs:
        scheduler.add(s)
    assert scheduler.schedule().kind == "prefill"
    for s in seqs:
        s.num_computed = len(s)
        s.output_ids.append(1)
    step = scheduler.schedule()
    for s in step.seqs:
        s.num_computed = len(s)
        s.output_ids.append(2)
    scheduler.finish(seqs[4], "length")  # read back at its last token; seqs[2] is at its last (3 of 3 pending)
    return scheduler, step.seqs


def test_a_cohort_plans_and_stages_the_step_ahead_as_the_sequences_do():
    """The decode step run ahead from a cohort's arrays (cohort.py): the sequences, blocks and the CUDA graph's staged
    inputs (positions, slots, context lengths, source rows, block tables) that schedule_ahead and fill give."""
    by_seqs, by_arrays = _decoding_batch(), _decoding_batch()
    held = [len(s.block_table) for s in by_seqs[1]]
    ahead = by_seqs[0].schedule_ahead(by_seqs[1])
    cohort = Cohort(by_arrays[1], block_size=4, max_blocks=6)
    keep = cohort.continuing()
    planned = cohort.take(np.flatnonzero(keep))
    assert planned.reserve_next(by_arrays[0].blocks)
    assert [s.index for s in planned.seqs] == [s.index for s in ahead.seqs] == [0, 1, 3, 5]
    assert [s.block_table for s in planned.seqs] == [s.block_table for s in ahead.seqs]
    assert [len(s.block_table) for s in by_seqs[1]] != held  # blocks taken for the step ahead
    staged = DecodeStaging(top=8, max_blocks=6, pinned=False), DecodeStaging(top=8, max_blocks=6, pinned=False)
    rows = [by_seqs[1].index(s) for s in ahead.seqs]
    staged[0].fill(ahead.seqs, 8, 4, rows)
    staged[1].fill_ahead(planned, 8, np.flatnonzero(keep))
    assert torch.equal(staged[0].meta, staged[1].meta) and torch.equal(staged[0].tables, staged[1].tables)
    # the step read back: the planned cohort takes its sequences' new lengths from the step it ran ahead of
    stop_ids = np.array([2])
    finished = cohort.read_back(np.array([5, 2, 6, 7, 8, 9]), np.linspace(-1, 0, 6), stop_ids)
    assert finished == [(1, True), (2, False)]  # a stop token; the last token (row 4 had finished already)
    planned.pull()
    assert planned.lengths.tolist() == [len(s) for s in planned.seqs] and planned.live.tolist() == [1, 0, 1, 1]
    assert by_arrays[1][4].output_ids == [1, 2] and by_arrays[1][3].output_ids == [1, 2, 7]


def test_a_sequence_larger_than_the_cache_is_refused():
    scheduler = Scheduler(BlockManager(num_blocks=3, block_size=2), max_num_seqs=8, max_prefill_tokens=100)
    with pytest.raises(ValueError, match="does not fit"):
        scheduler.add(Sequence(0, list(range(4)), 2))


PROMPTS = [PromptRecord(id=f"p{i}", prompt=text) for i, text in enumerate(["1+2=", "3*4=", "12+7=", "9-5=", "0+0="])]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from rlx.models.tiny import build_char_tokenizer, tiny_llama_config

    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_llama_config(len(tokenizer), max_positions=128))
    return model, tokenizer


def test_the_engine_leaves_a_sharded_model_where_it_is(tiny, monkeypatch):
    """A sharded model (FSDP; with CPU offload its shards live on the CPU) is not moved to the rollout device: the
    engine's replica is gathered from the shards. A plain model is moved (tests/gpu/test_offload_cuda.py runs the
    offloaded case on a GPU, where moving it made FSDP refuse the model at its first forward)."""
    import copy

    import rlx.rollout.native.engine as native

    cfg = RolloutConfig(engine="native")
    for sharded in (True, False):
        model, moved = copy.deepcopy(tiny[0]), []
        real_to = model.to
        model.to = lambda *args, moved=moved, real_to=real_to, **kwargs: moved.append(args) or real_to(*args, **kwargs)
        monkeypatch.setattr(native, "is_sharded", lambda m, sharded=sharded: sharded)
        engine = make_engine(model, tiny[1], cfg)
        assert (moved == []) is sharded and engine.use_replica is sharded


@pytest.mark.parametrize(
    "settings",
    [
        dict(n=3, max_new_tokens=12, temperature=0),
        dict(n=4, max_new_tokens=12, temperature=1.0, seed=5),
        dict(n=4, max_new_tokens=12, temperature=0.7, top_k=6, top_p=0.9, seed=2, remax_baseline=True),
        # a tiny cache and few sequences at once: continuous batching, refills and preemption
        dict(n=4, max_new_tokens=30, temperature=1.0, seed=1, max_num_seqs=3, block_size=2, kv_cache_gib=2e-5),
    ],
)
def test_native_equals_the_hf_engine(tiny, settings):
    model, tokenizer = tiny
    cfg = flat_config(RolloutConfig, engine="native", chat_template="off", **settings)
    ours = generate(make_engine(model, tokenizer, cfg), PROMPTS, cfg)
    theirs = generate(make_engine(model, tokenizer, dataclasses.replace(cfg, engine="hf")), PROMPTS, cfg)
    assert [r.id for r in ours] == [r.id for r in theirs]
    assert [r.response_ids for r in ours] == [r.response_ids for r in theirs]
    assert [r.finish_reason for r in ours] == [r.finish_reason for r in theirs]
    for a, b in zip(ours, theirs):
        assert torch.allclose(torch.tensor(a.rollout_logprobs), torch.tensor(b.rollout_logprobs), atol=1e-5)


def _family_model(family: str, vocab: int):
    """A tiny decoder of `family` ('llama': no biases; 'qwen2': q/k/v biases; 'qwen3': per-head q/k norms)."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

    from rlx.models.tiny import tiny_llama_config

    base = tiny_llama_config(vocab, max_positions=128).to_dict()
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings", "pad_token_id", "bos_token_id",
            "eos_token_id")  # fmt: skip
    config = {"llama": lambda **kw: tiny_llama_config(vocab, max_positions=128), "qwen2": Qwen2Config,
              "qwen3": functools.partial(Qwen3Config, head_dim=16)}[family](**{k: base[k] for k in keep})  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_merged_projections_decode_as_the_model_s_layers(tiny, family):
    """A model nothing trains (no parameter requires grad) gets its q/k/v and gate/up weights laid out as rows of
    merged tensors (same Parameters, same values) and decodes through one GEMM per group (fused.py); it samples
    what the same weights sample through the Hugging Face layers (a trainer's module: left as it is)."""
    import copy

    _, tokenizer = tiny
    model = _family_model(family, len(tokenizer))
    owned = copy.deepcopy(model).requires_grad_(False)
    before = {name: id(p) for name, p in owned.named_parameters()}
    cfg = RolloutConfig(
        engine="native",
        chat_template="off",
        kv_cache_gib=2e-5,
        sampling=SamplingParams(n=4, max_new_tokens=24, temperature=1.0, seed=2),
        native=NativeConfig(max_num_seqs=6, block_size=2),
    )
    engine = make_engine(owned, tokenizer, cfg)
    ours = generate(engine, PROMPTS, cfg)
    trainer = make_engine(model, tokenizer, cfg)
    theirs = generate(trainer, PROMPTS, cfg)
    assert engine._runner.fused is not None and trainer._runner.fused is None
    assert {name: id(p) for name, p in owned.named_parameters()} == before
    attn = owned.model.layers[0].self_attn
    assert attn.k_proj.weight.untyped_storage().data_ptr() == attn.q_proj.weight.untyped_storage().data_ptr()
    for name, p in model.named_parameters():
        assert torch.equal(p, owned.get_parameter(name)), name
    assert [r.response_ids for r in ours] == [r.response_ids for r in theirs]
    for a, b in zip(ours, theirs):
        assert torch.allclose(torch.tensor(a.rollout_logprobs), torch.tensor(b.rollout_logprobs), atol=1e-5)


def test_decoding_ahead_of_the_host_changes_no_token(tiny):
    """Steps queued before the host reads the previous step's tokens (EOS stops, refills, preemption) give the
    synchronous path's tokens; logprobs may differ by float32 rounding (discarded rows change the batch)."""
    model, tokenizer = tiny
    runs = {}
    for overlap in (False, True):
        cfg = RolloutConfig(
            engine="native",
            chat_template="off",
            kv_cache_gib=4e-5,
            sampling=SamplingParams(n=8, max_new_tokens=40, temperature=1.5, seed=1),
            native=NativeConfig(max_num_seqs=5, block_size=2, overlap=overlap),
        )
        result = make_engine(model, tokenizer, cfg).generate(PROMPTS, cfg.sampling, progress=False)
        runs[overlap] = (result.records, result.stats)
    (sync, sync_stats), (ahead, ahead_stats) = runs[False], runs[True]
    assert sync_stats.steps_ahead == 0 and ahead_stats.steps_ahead > 50
    assert ahead_stats.preemptions > 0 and {r.finish_reason for r in ahead} == {"stop", "length"}
    assert [r.response_ids for r in ahead] == [r.response_ids for r in sync]
    assert [r.finish_reason for r in ahead] == [r.finish_reason for r in sync]
    for a, b in zip(ahead, sync):
        assert torch.allclose(torch.tensor(a.rollout_logprobs), torch.tensor(b.rollout_logprobs), atol=1e-5)


def test_rollout_command_with_the_native_engine(tmp_path, tiny_ckpt, prompts_file):
    cli_ok(*rollout_args(tiny_ckpt, prompts_file, tmp_path / "hf.jsonl", "--seed", "3"))
    cli_ok(*rollout_args(tiny_ckpt, prompts_file, tmp_path / "native.jsonl", "--seed", "3", "--engine", "native"))
    hf, native = read_jsonl(tmp_path / "hf.jsonl"), read_jsonl(tmp_path / "native.jsonl")
    assert [r["response_ids"] for r in hf] == [r["response_ids"] for r in native]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run with RLX_TEST_GPU=1)")
@pytest.mark.parametrize("graphs,merged", [(True, False), (False, False), (True, True)])
def test_native_equals_the_hf_engine_on_cuda(tiny, graphs, merged):
    """fp32 on the GPU, with and without CUDA graphs for decode (the Triton paged kernel), through the model's
    layers or (a model nothing trains) through merged projections compiled inside the graphs (fused.py)."""
    import copy

    model, tokenizer = tiny
    cuda = torch.device("cuda")
    model = copy.deepcopy(model).to(cuda).requires_grad_(not merged)
    cfg = RolloutConfig(
        engine="native",
        chat_template="off",
        precision="float32",
        sampling=SamplingParams(n=4, max_new_tokens=20, seed=3),
        native=NativeConfig(cuda_graphs=graphs),
    )
    cfg.native.max_num_seqs = 8  # fewer sequences than requests: graphs of several sizes replay, slots refill
    engine = make_engine(model, tokenizer, cfg, cuda)
    result = engine.generate(PROMPTS, cfg.sampling, progress=False)
    assert (engine._runner.fused is not None) == merged
    ours = result.records
    theirs = generate(make_engine(model, tokenizer, dataclasses.replace(cfg, engine="hf"), cuda), PROMPTS, cfg)
    assert result.stats.steps_ahead > 0  # decode steps overlapped with the host's bookkeeping
    same = sum(a.response_ids == b.response_ids for a, b in zip(ours, theirs))
    assert same >= len(ours) - 1  # TF32-free fp32, but kernels differ: allow one near-tie to flip
    for a, b in zip(ours, theirs):
        if a.response_ids == b.response_ids:
            assert torch.allclose(torch.tensor(a.rollout_logprobs), torch.tensor(b.rollout_logprobs), atol=1e-4)


def test_ppo_with_the_native_engine_equals_hf(tmp_path):
    from tests.conftest import REPO

    recipe = REPO / "recipes" / "quickstart.toml"
    for engine in ("hf", "native"):
        cli_ok("ppo", recipe, "--out", tmp_path / engine, "--set", "steps=4", "--set", f"rollout.engine={engine}")
    hf, native = (read_jsonl(tmp_path / e / "metrics.jsonl") for e in ("hf", "native"))
    assert [m["reward/mean"] for m in hf] == [m["reward/mean"] for m in native]
    assert [m["response_length/mean"] for m in hf] == [m["response_length/mean"] for m in native]


def test_ppo_on_two_fsdp_ranks_generates_with_a_gathered_replica(tmp_path):
    """Under FSDP each rank generates its share with a replica gathered from the shards before every rollout:
    the same samples, rewards and weights as one process with the hf engine (stale weights would change the
    rollouts from step 2 on)."""
    from tests.conftest import REPO, max_diff, run_torchrun

    recipe = REPO / "recipes" / "quickstart.toml"
    small = ["--set", "steps=3", "--set", "data.prompts_per_step=6", "--set", "rollout.sampling.n=4"]
    cli_ok("ppo", recipe, "--out", tmp_path / "one", *small, "--set", "rollout.engine=hf")
    run_torchrun(2, "-m", "rlx", "ppo", recipe, "--out", tmp_path / "two", *small, "--set", "rollout.engine=native")
    one, two = (read_jsonl(tmp_path / d / "metrics.jsonl") for d in ("one", "two"))
    for key in ("reward/mean", "response_length/mean"):
        assert [m[key] for m in one] == [m[key] for m in two], key
    assert all(m["perf/rollout_tokens_per_s"] > 0 for m in two)
    final = tmp_path / "one" / "checkpoints" / "step_000003", tmp_path / "two" / "checkpoints" / "step_000003"
    assert max_diff(*final) < 1e-5
    steps = [read_jsonl(tmp_path / d / "step_000003" / "rollouts.jsonl") for d in ("one", "two")]
    assert [r["response_ids"] for r in steps[0]] == [r["response_ids"] for r in steps[1]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run with RLX_TEST_GPU=1)")
@pytest.mark.parametrize("merged", [True, False])
def test_capture_ladder_compiles_the_decoder_layer_once(tiny, merged):
    """The decode CUDA graphs of every batch size share one compiled decoder layer (no recompilation from sizes
    that happened to be equal at the first trace), through merged projections (the replica's, fused.py) or the
    model's layers (rollout.native.merged_projections off). The head may compile twice here: Inductor guards this tiny
    model's head on the batch being >= 64; on the 0.5B shape the ladder compiles 2 graphs in all (bench/RESULTS.md).
    """
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from rlx.rollout.native import fused, runner

    model, tokenizer = tiny
    cuda = torch.device("cuda")
    cfg = RolloutConfig(
        engine="native",
        chat_template="off",
        precision="bfloat16",
        sampling=SamplingParams(n=4, max_new_tokens=8, seed=3),
    )
    cfg.native.merged_projections = merged
    cfg.native.max_num_seqs = 64  # the ladder 2, 4, 8, 16, 32, 64
    torch._dynamo.reset()
    prompts = [PromptRecord(id=f"q{i}", prompt=p.prompt) for i, p in enumerate(PROMPTS * 8)]
    result = make_engine(model.to(cuda), tokenizer, cfg, cuda).generate(prompts, cfg.sampling, progress=False)
    model.to(CPU)
    assert len(result.records) == len(prompts) * 4
    step = fused.fused_layer_step if merged else runner._layer_step
    assert len(_debug_get_cache_entry_list(step.__code__)) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run with RLX_TEST_GPU=1)")
def test_gpu_sampler_draws_what_the_float64_rule_draws():
    """The Triton draw (both engines on CUDA) against the float64 reference on the same scaled logits, and the
    native engine's fused path (bf16 logits, 1 / temperature in the kernel) against the hf engine's call."""
    from rlx.rollout.sampling import draw_tokens, draw_tokens_torch, sample_next, sample_uniforms

    torch.manual_seed(0)
    logits = (torch.randn(64, 151936, device="cuda") * 3).bfloat16()
    u = sample_uniforms(1, [f"p/{i}" for i in range(64)], 1)[:, 0]
    scaled = logits.float() / 0.7  # what the hf engine passes to draw_tokens
    ours = draw_tokens(scaled, u)
    assert (ours == draw_tokens_torch(scaled, u)).float().mean() >= 62 / 64  # float32 vs float64: rare near-ties
    tokens, logprobs = sample_next(logits, u, None, 0.7)
    assert torch.equal(tokens, ours)
    want = torch.log_softmax(scaled, -1).gather(-1, tokens[:, None])[:, 0]
    assert torch.allclose(logprobs, want, atol=1e-4)
    greedy = torch.arange(64, device="cuda") % 2 == 0
    mixed, _ = sample_next(logits, u, greedy, 0.7)
    assert torch.equal(mixed, torch.where(greedy, logits.argmax(-1), ours))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run with RLX_TEST_GPU=1)")
def test_the_captured_draw_equals_the_eager_draw_bit_for_bit():
    """A plain decode step's draw replayed as a CUDA graph (sampler.SamplingGraphs) gives the eager path's tokens and
    logprobs exactly, at two temperatures (an input of the graph, not captured into it) and with a batch smaller
    than the graph's (padded rows)."""
    from rlx.kernels.exact_triton import inverse_temperature
    from rlx.rollout.native.sampler import SamplingGraphs
    from rlx.rollout.sampling import sample_next, sample_uniforms

    torch.manual_seed(0)
    cuda = torch.device("cuda")
    logits = {g: (torch.randn(g, 151936, device=cuda) * 3).bfloat16() for g in (16, 32)}
    graphs = SamplingGraphs([16, 32], cuda)
    for g in (32, 16):
        graphs.capture(g, logits[g], None)
    u = sample_uniforms(1, [f"p/{i}" for i in range(32)], 1)[:, 0]
    for temperature, g, b in ((0.7, 32, 32), (1.0, 16, 16), (0.7, 16, 11)):
        draws = torch.zeros(g, dtype=torch.float64).pin_memory()
        draws[:b] = u[:b]
        graphs.replay(g, draws, inverse_temperature(temperature))
        torch.cuda.synchronize()
        tokens, logprobs = sample_next(logits[g][:b], u[:b].to(cuda), None, temperature)
        assert torch.equal(graphs.out[:b].long(), tokens) and torch.equal(graphs.tokens[:b], tokens)
        assert torch.equal(graphs.out[g : g + b], logprobs.double())
    assert graphs.replays == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run with RLX_TEST_GPU=1)")
def test_the_engine_replays_the_captured_draw_and_samples_as_without_it(tiny):
    """bf16 decode with CUDA graphs: the plain steps' draws are replayed graphs, and the rollouts (tokens, logprobs)
    equal those of the same engine drawing eagerly, bit for bit."""
    import copy

    model, tokenizer = tiny
    cuda = torch.device("cuda")
    model = copy.deepcopy(model).to(cuda)
    cfg = RolloutConfig(engine="native", chat_template="off", sampling=SamplingParams(n=4, max_new_tokens=20, seed=3))
    cfg.native.max_num_seqs = 8
    engine = make_engine(model, tokenizer, cfg, cuda)
    captured = engine.generate(PROMPTS, cfg.sampling, progress=False).records
    sampling = engine._runner.sampling
    replays = sampling.replays if sampling is not None else 0
    assert replays > 10
    engine._runner.sampling = None  # the next stream draws eagerly
    eager = engine.generate(PROMPTS, cfg.sampling, progress=False).records
    assert sampling.replays == replays
    assert [r.response_ids for r in captured] == [r.response_ids for r in eager]
    assert [r.rollout_logprobs for r in captured] == [r.rollout_logprobs for r in eager]


def test_a_persistent_engine_follows_weight_updates_and_keeps_its_cache(tiny):
    """Across 'training steps' the engine keeps one KV cache (its own counter says so) and a bf16 replica it
    refills in place; after each update it generates exactly what a fresh engine on the new weights generates."""
    import copy

    from rlx.rollout.base import ModuleWeights

    model, tokenizer = tiny
    live = copy.deepcopy(model)
    cfg = RolloutConfig(
        engine="native",
        chat_template="off",
        precision="bfloat16",
        sampling=SamplingParams(n=3, max_new_tokens=10, seed=4),
    )
    engine = make_engine(live, tokenizer, cfg)
    assert engine.use_replica  # float32 trainer weights, bf16 rollouts
    # the replica decodes through merged projections (fused.py), refilled in place through its Parameters below
    for step in range(3):
        with torch.no_grad():  # what an optimizer step does to the live module
            for p in live.parameters():
                p.add_(0.05 * torch.randn_like(p))
        engine.sleep()
        engine.update_weights(ModuleWeights(live))
        ours = generate(engine, PROMPTS, cfg)
        fresh = generate(make_engine(copy.deepcopy(live).to(torch.bfloat16), tokenizer, cfg), PROMPTS, cfg)
        assert [r.response_ids for r in ours] == [r.response_ids for r in fresh], step
        assert [r.rollout_logprobs for r in ours] == [r.rollout_logprobs for r in fresh], step
    assert engine.cache_builds == 1 and engine.replica_fills == 3 and engine._runner.fused is not None
    assert generate(engine, PROMPTS, cfg) == ours and engine.replica_fills == 3  # no update since: no refill
    counters = engine.counters()  # the weight sync's time and size, as `rlx ppo` logs them (rollout/replica_*)
    bf16_bytes = sum(p.numel() for p in live.parameters()) * 2
    assert counters["replica_fill_s"] > 0 and 0 < counters["replica_gb"] * 2**30 <= bf16_bytes


def test_a_kept_cache_takes_the_next_steps_slightly_longer_prompts(tiny):
    """Prompt lengths vary from step to step: the cache is built with headroom, so a next call whose prompts are
    a few tokens longer reuses it (and its decode graphs) instead of building a bigger one."""
    model, tokenizer = tiny
    cfg = RolloutConfig(
        engine="native",
        chat_template="off",
        sampling=SamplingParams(n=4, max_new_tokens=30, seed=2),
        native=NativeConfig(block_size=4),
    )
    engine = make_engine(model, tokenizer, cfg)
    generate(engine, PROMPTS, cfg)
    longer = [dataclasses.replace(p, prompt=p.prompt + "1+1") for p in PROMPTS]
    out = generate(engine, longer, cfg)
    assert engine.cache_builds == 1
    assert [r.response_ids for r in out] == [r.response_ids for r in generate(make_engine(model, tokenizer, cfg),
                                                                               longer, cfg)]  # fmt: skip


def run_stream(engine, requests, sampling, on_step=None) -> dict:
    """Generated per request key through one stream; `on_step(stream)` runs between steps (may submit more)."""
    stream = engine.open_stream(sampling, 64, 4)
    out = {}
    try:
        for request in requests:
            stream.submit(request.key, request)
        while stream.has_work:
            for key, generated in stream.step():
                out[key] = generated
            if on_step is not None:
                on_step(stream)
    finally:
        stream.close()
    return out


@pytest.mark.parametrize("engine_name", ["native", "hf"])
def test_a_requests_own_seed_replaces_the_streams(tiny, engine_name):
    """TokenRequest.seed: a request carrying seed 7 in a stream seeded 3 draws what it draws in a stream seeded 7
    (an asynchronous rollout rank runs several steps, each with its seed, in one stream)."""
    from rlx.rollout.requests import TokenRequest

    model, tokenizer = tiny
    cfg = RolloutConfig(engine=engine_name, chat_template="off", sampling=SamplingParams(max_new_tokens=12, seed=3))
    engine = make_engine(model, tokenizer, cfg)
    ids = tokenizer("12+7=")["input_ids"]
    own = run_stream(engine, [TokenRequest("a", ids, 12, seed=7)], cfg.sampling)["a"]
    other = run_stream(engine, [TokenRequest("a", ids, 12)], dataclasses.replace(cfg.sampling, seed=7))["a"]
    plain = run_stream(engine, [TokenRequest("a", ids, 12)], cfg.sampling)["a"]
    assert own == other and own != plain


def test_an_open_stream_continues_under_new_weights(tiny):
    """async.partial_rollouts = 'continue': weights updated under an open stream. A request in flight keeps the
    tokens it had (those of the old weights) and goes on with the new ones; a request submitted after the update,
    with the same prompt, is exactly what a fresh engine on the new weights generates (the replica was refilled
    in place and the prompt's cached keys and values of the old weights were not reused)."""
    import copy

    from rlx.rollout.base import ModuleWeights
    from rlx.rollout.requests import TokenRequest

    model, tokenizer = tiny
    cfg = RolloutConfig(
        engine="native",
        chat_template="off",
        precision="bfloat16",
        sampling=SamplingParams(max_new_tokens=16, seed=4),
        native=NativeConfig(block_size=4),
    )
    live = copy.deepcopy(model)
    old = copy.deepcopy(live).to(torch.bfloat16)
    engine = make_engine(live, tokenizer, cfg)
    ids = tokenizer("12+7=3*4=9-5=")["input_ids"]  # 13 tokens: three full blocks to cache
    first, second = TokenRequest("a", ids, 16), TokenRequest("b", ids, 16)
    switched = {}

    def update_after_4_tokens(stream):
        if not switched and stream.progress().get("a", 0) >= 4:
            switched["at"] = stream.progress()["a"]
            with torch.no_grad():
                for p in live.parameters():
                    p.add_(0.05 * torch.randn_like(p))
            engine.update_weights(ModuleWeights(live))
            stream.weights_changed()
            stream.submit("b", second)

    ours = run_stream(engine, [first], cfg.sampling, update_after_4_tokens)
    at = switched["at"]
    before = run_stream(make_engine(old, tokenizer, cfg), [first], cfg.sampling)["a"]
    after = run_stream(make_engine(copy.deepcopy(live).to(torch.bfloat16), tokenizer, cfg), [second],
                       cfg.sampling)["b"]  # fmt: skip
    assert 4 <= at < len(ours["a"].response_ids)
    assert ours["a"].response_ids[:at] == before.response_ids[:at]
    assert ours["a"].logprobs[:at] == before.logprobs[:at]
    assert ours["a"].logprobs[at:] != before.logprobs[at : len(ours["a"].logprobs)]  # the new weights sampled
    assert ours["b"] == after


def test_forgotten_blocks_are_never_shared_again():
    """BlockManager.forget_cached (new weights): no later sequence finds the cached prompt blocks, and blocks held
    at that moment are freed, not cached, when released."""
    blocks = BlockManager(num_blocks=10, block_size=4)
    a = Sequence(0, list(range(10)), 4)
    blocks.allocate(a)
    done = Sequence(1, [9] * 9, 4)
    blocks.allocate(done)
    blocks.release(done)  # its first two blocks: cached, evictable
    blocks.forget_cached()
    assert blocks.num_free == 9 - 3 and not blocks.cached
    b = Sequence(2, list(range(10)), 4)
    blocks.allocate(b)
    assert b.num_computed == 0 and not set(b.block_table) & set(a.block_table)
    a.num_computed = 10
    blocks.release(a)
    c = Sequence(3, list(range(10)), 4)
    blocks.allocate(c)
    assert c.block_table[:2] == b.block_table[:2]  # b's blocks (new weights) are shared; a's were not cached
    assert not set(c.block_table) & {blk for blk in range(10) if blk in blocks.stale}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run with RLX_TEST_GPU=1)")
def test_sleep_on_cuda_keeps_the_graphs_and_releases_the_memory(tiny):
    """With rollout.sleep on CUDA the KV cache and the bf16 replica give their memory back between rollouts and take
    it again at the same addresses (rlx.utils.vmm): the decode graphs are captured once, and after each update the
    engine generates what a fresh engine on the new weights generates."""
    import copy

    from rlx.rollout.base import ModuleWeights

    model, tokenizer = tiny
    cuda = torch.device("cuda")
    live = copy.deepcopy(model).to(cuda)
    cfg = RolloutConfig(
        engine="native",
        chat_template="off",
        precision="bfloat16",
        sleep=True,
        sampling=SamplingParams(n=3, max_new_tokens=10, seed=4),
    )
    assert not make_engine(live, tokenizer, dataclasses.replace(cfg, sleep=None), cuda).releasable  # kept by default
    engine = make_engine(live, tokenizer, cfg, cuda)
    assert engine.releasable and engine.use_replica
    first = generate(engine, PROMPTS, cfg)
    runner = engine._runner
    addresses = runner.kv[0][0].data_ptr(), next(engine._replica.parameters()).data_ptr()
    for step in range(2):
        with torch.no_grad():
            for p in live.parameters():
                p.add_(0.05 * torch.randn_like(p))
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        freed = engine.sleep()
        kv_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in runner.kv)
        assert freed >= kv_bytes and torch.cuda.mem_get_info()[0] - free_before >= freed
        engine.update_weights(ModuleWeights(live))
        ours = generate(engine, PROMPTS, cfg)
        fresh_cfg = dataclasses.replace(cfg, sleep=False)
        fresh_model = copy.deepcopy(live).to(torch.bfloat16).requires_grad_(False)  # merged too: the same kernels
        fresh = generate(make_engine(fresh_model, tokenizer, fresh_cfg, cuda), PROMPTS, cfg)
        assert [r.response_ids for r in ours] == [r.response_ids for r in fresh], step
        for a, b in zip(ours, fresh):
            assert torch.allclose(torch.tensor(a.rollout_logprobs), torch.tensor(b.rollout_logprobs), atol=1e-5)
        assert [r.response_ids for r in ours] != [r.response_ids for r in first]  # the new weights took effect
    assert engine._runner is runner and engine.cache_builds == 1 and engine.replica_fills == 3
    assert (runner.kv[0][0].data_ptr(), next(engine._replica.parameters()).data_ptr()) == addresses
