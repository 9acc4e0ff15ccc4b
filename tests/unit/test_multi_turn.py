"""Multi-turn rollouts on the engines: hf == native trajectories for a seed (greedy and sampled), the native
engine's turns reuse the cached blocks of their earlier turns, a sample waiting on its environment never
stalls the others, the token-level call's per-request limits, and the block manager's turn cache by hand."""

from __future__ import annotations

import importlib
import math
import sys

import pytest

from rlx.agent.driver import EnvRollout
from rlx.formats.records import PromptRecord
from rlx.rollout.agent_config import AgentConfig
from rlx.rollout.config import SamplingParams
from rlx.rollout.native.blocks import BlockManager, Sequence
from rlx.rollout.requests import TokenRequest
from tests.agent_helpers import ENVS, bigram_chat_model, random_chat_model, spans, token_engine

QUESTIONS = [PromptRecord(id=f"q{i}", prompt=f"say {i}") for i in range(3)]

TIMED_ENVS = '''
import threading
import time

STEPS = []  # (sample, turn, started, ended) of every step() call
_LOCK = threading.Lock()


class SlowForQ0:
    """Three turns; the environment of prompt q0 takes 1.5 s per step, the others answer at once (0.4 s was too short
    for the others' three turns on a loaded 2-core machine)."""

    def __init__(self, record):
        self.sample, self.turns = record["prompt"], 0
        self.delay = 1.5 if record["id"] == "q0" else 0.0

    def reset(self):
        return [{"role": "user", "content": self.sample}]

    def step(self, message):
        started = time.monotonic()
        time.sleep(self.delay)
        self.turns += 1
        with _LOCK:
            STEPS.append((self.sample, self.turns, started, time.monotonic()))
        if self.turns == 3:
            return [], 1.0, True
        return [{"role": "user", "content": "again"}], 0.0, False
'''


@pytest.fixture(scope="module")
def envs_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("envs")
    (folder / "envs.py").write_text(ENVS)
    (folder / "timed.py").write_text(TIMED_ENVS)
    return folder


def episodes(model_and_tokenizer, env: str, engine: str, temperature: float, **agent):
    model, tokenizer = model_and_tokenizer
    settings = {"block_size": 4, "max_num_seqs": 4} if engine == "native" else {"batch_size": 4}
    runner = EnvRollout(
        token_engine(model, tokenizer, engine, **settings),
        tokenizer,
        SamplingParams(n=2, max_new_tokens=12, temperature=temperature, seed=7),
        AgentConfig(env=env, max_total_tokens=400, **agent),
    )
    result = runner.generate(QUESTIONS)
    return result.records, result.stats.episodes


@pytest.mark.parametrize(("style", "temperature"), [("qwen2.5", 0.0), ("qwen2.5", 1.0), ("qwen3", 1.0)])
def test_native_trajectories_equal_the_hf_engine(envs_file, style, temperature):
    """Same tokens (each turn draws from its own keyed stream), same mask and logprobs up to float error, though the
    native engine batches continuously (4 sequences at most, turns joining as their environments answer) and
    prefills only what its cache lacks."""
    model = random_chat_model(style, stop_bias=0.1)
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}} if style == "qwen3" else {}
    hf, _ = episodes(model, f"{envs_file}/envs.py:Echo", "hf", temperature, **kwargs)
    native, stats = episodes(model, f"{envs_file}/envs.py:Echo", "native", temperature, **kwargs)
    assert sum(r.num_turns for r in hf) > len(hf)  # several turns
    for a, b in zip(hf, native):
        assert (a.id, a.prompt_ids, a.response_ids, a.loss_mask) == (b.id, b.prompt_ids, b.response_ids, b.loss_mask)
        assert (a.finish_reason, a.num_turns, a.env_reward, a.messages) == (
            b.finish_reason,
            b.num_turns,
            b.env_reward,
            b.messages,
        )
        assert all(math.isclose(x, y, abs_tol=1e-5) for x, y in zip(a.rollout_logprobs, b.rollout_logprobs))
    # every turn's context is prefilled or found cached; later turns find their earlier turns' full blocks
    contexts = sum(len(r.prompt_ids) + lo for r in native for lo, _, on in spans(r.loss_mask) if on)
    assert stats.preemptions == 0
    assert stats.prefill_tokens + stats.cached_prefix_tokens == contexts
    assert stats.cached_prefix_tokens > contexts / 2


@pytest.mark.parametrize("engine", ["hf", "native"])
def test_a_slow_environment_never_stalls_the_other_samples(envs_file, engine):
    """q0's environment sleeps 1.5 s per step; q1 and q2 play all three turns while q0's first step sleeps."""
    model = random_chat_model(stop_bias=2.0)  # turns end quickly
    module = f"{envs_file}/timed.py"
    records, stats = episodes(model, f"{module}:SlowForQ0", engine, 1.0)
    steps = sys.modules["rlx_user_env_timed"].STEPS
    slow_first_end = min(end for sample, turn, _, end in steps if sample == "say 0" and turn == 1)
    fast = [(sample, turn, end) for sample, turn, _, end in steps if sample != "say 0"]
    stepped_three_times = {s for s, turn, _ in fast if turn == 3}
    assert {s for s, _, _ in fast} == {"say 1", "say 2"} and stepped_three_times == {"say 1", "say 2"}
    assert all(end < slow_first_end for _, _, end in fast)  # done before q0's environment answered once
    assert stats.env_wait_s > 2.0  # the engine idled while only q0 was left, waiting on it
    steps.clear()
    importlib.invalidate_caches()


@pytest.mark.parametrize("engine", ["hf", "native"])
def test_a_stop_string_ends_the_turn_and_is_cut_from_its_message(envs_file, engine):
    """rollout.sampling.stop in multi-turn: the turn ends at the token that completes the stop string (that token is
    trained), the message the environment reads ends before it (as in single-turn text), and the next turn
    follows the template's end of turn."""
    model, tokenizer = bigram_chat_model("\nabXYcd<|im_end|>")
    runner = EnvRollout(
        token_engine(model, tokenizer, engine),
        tokenizer,
        SamplingParams(n=1, max_new_tokens=12, temperature=0.0, stop=("XY",)),
        AgentConfig(env=f"{envs_file}/envs.py:Echo", max_total_tokens=400),
    )
    record = runner.generate(QUESTIONS[:1]).records[0]
    replies = [m["content"] for m in record.messages if m["role"] == "assistant"]
    assert replies == ["ab", "ab", "ab"] and record.finish_reason == "env_done"
    model_spans = [record.response_ids[lo:hi] for lo, hi, on in spans(record.loss_mask) if on]
    assert [tokenizer.decode(ids) for ids in model_spans] == ["abXY"] * 3


def test_token_requests_keep_their_own_limits_and_streams():
    """A request's tokens depend on its key only (not its batch, engine or neighbours), and stop at its own limit."""
    model, tokenizer = random_chat_model(stop_bias=-10.0)  # never stops: limits end every request
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("ab", "abc", "xyz!")]
    requests = [TokenRequest(f"k{i}", ids, limit) for i, (ids, limit) in enumerate(zip(prompts, (3, 7, 5)))]
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, seed=2)
    out = {}
    for name in ("hf", "native"):
        engine = token_engine(model, tokenizer, name)
        out[name] = engine.generate_tokens(requests, sampling)
        alone = [engine.generate_tokens([r], sampling)[0] for r in requests]
        assert [g.response_ids for g in alone] == [g.response_ids for g in out[name]]
    for hf, native, request in zip(out["hf"], out["native"], requests):
        assert hf.response_ids == native.response_ids and len(hf.response_ids) == request.max_new_tokens
        assert hf.finish_reason == native.finish_reason == "length"
    with pytest.raises(ValueError, match="max_new_tokens 9 is not in"):
        token_engine(model, tokenizer).generate_tokens([TokenRequest("k", prompts[0], 9)], sampling)


def test_a_finished_turn_leaves_its_blocks_for_the_next_turn():
    blocks = BlockManager(num_blocks=8, block_size=2)
    turn = Sequence(0, [1, 2, 3], 4)
    blocks.allocate(turn)
    for token in (4, 5, 6):
        assert blocks.ensure_slot(turn)
        turn.output_ids.append(token)
    turn.num_computed = 5  # the last sampled token (6) was never fed back
    blocks.release(turn)
    assert blocks.num_free == 7 and len(blocks.evictable) == 2  # [1, 2], [3, 4] stay cached; nobody holds them
    following = Sequence(1, [1, 2, 3, 4, 5, 6, 9, 9], 4)  # the next turn: the same context, then inserted tokens
    blocks.allocate(following)
    assert following.num_computed == 4 and following.block_table[:2] == turn_blocks(blocks, [1, 2, 3, 4])
    assert blocks.num_hit_tokens == 4 and not blocks.evictable
    other = Sequence(2, [1, 2, 7, 7, 7], 4)  # shares the first block only
    blocks.allocate(other)
    assert other.num_computed == 2 and other.block_table[0] == following.block_table[0]


def turn_blocks(blocks: BlockManager, tokens: list[int]) -> list[int]:
    """The cached chain of blocks holding `tokens` (whole blocks)."""
    chain, previous = [], -1
    for i in range(0, len(tokens), blocks.block_size):
        previous = blocks.cached[(previous, tuple(tokens[i : i + blocks.block_size]))]
        chain.append(previous)
    return chain


def test_evicting_a_cached_block_uncaches_the_blocks_after_it():
    """A key names its predecessor by block id: once that block is taken for other tokens, the chain after it
    must be forgotten (else a prefix that reuses the id would find the old tokens' keys and values)."""
    blocks = BlockManager(num_blocks=4, block_size=2)  # 3 usable blocks
    first = Sequence(0, [1, 2, 3, 4, 5], 2)
    blocks.allocate(first)
    first.num_computed = 4
    parent, child = first.block_table[:2]
    blocks.release(first)
    assert blocks.cached == {(-1, (1, 2)): parent, (parent, (3, 4)): child}
    assert list(blocks.evictable) == [child, parent]  # a chain's later blocks go first
    blocks.evictable.move_to_end(child)  # make the parent the least recently released
    other = Sequence(1, [8, 8, 8], 2)  # two blocks: the free one, then the parent is evicted
    blocks.allocate(other)
    assert parent in other.block_table and child in blocks.free and not blocks.evictable
    assert blocks.cached == {(-1, (8, 8)): other.block_table[0]} and set(blocks.key_of) == {other.block_table[0]}
