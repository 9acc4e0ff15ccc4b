"""Rollout routing replay (R3) for multi-turn episodes of a tiny Qwen3-MoE, CPU: on the hf and native engines an
episode's record carries routed_experts over its whole response (each model turn's rows as the engine routed them,
the tool/user tokens in between as the next turn's engine routed them when it read them), equal to the routing of
one forward over the episode's tokens; the engines' prompt rows (TokenRequest.num_prompt_routes) are those of the
right positions in batches, and on the native engine also where the prefix cache holds the positions' blocks;
replaying the record reproduces the rollout logprobs; `rlx rollout --env` -> `rlx score` -> `rlx train-step`, both
with --router-replay rollout, log no routing mismatch, and score refuses rollouts of which only some carry routing.
Agents over the served endpoint record routing too."""

from __future__ import annotations

import json

import pytest
import torch

from rlx.agent.agents import AgentRollout
from rlx.agent.driver import EnvRollout
from rlx.chat.trajectory import Trajectory
from rlx.formats.batch import collate
from rlx.logprobs import ModuleScorer
from rlx.models.moe import tiny_moe_config
from rlx.models.routing import RouterRecorder
from rlx.models.tiny import SPECIAL_TOKENS
from rlx.models.tiny_chat import END_OF_TURN, MARKUP_TOKENS, build_chat_tokenizer
from rlx.parallel.dist import DistContext
from rlx.rollout.agent_config import AgentConfig
from rlx.rollout.config import SamplingParams
from rlx.rollout.requests import TokenRequest
from tests.agent_helpers import ENVS, QUESTIONS, token_engine
from tests.conftest import cli, cli_ok, read_jsonl, write_jsonl
from tests.unit.test_serve import AGENT


def moe_chat_model(seed: int = 0):
    """(model, tokenizer): a random 2-layer Qwen3-MoE (4 experts, top 2) over the chat tokenizer whose sampled
    turns end with <|im_end|> after a few tokens (a head bias read from a constant embedding dimension, as
    tests.agent_helpers.random_chat_model does). Embeddings of unit scale, so tokens route to varied experts (the
    default 0.02 leaves the constant dimension to decide every token's routing alike)."""
    from transformers import AutoModelForCausalLM

    tokenizer = build_chat_tokenizer("qwen2.5")
    end = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    config = tiny_moe_config(len(tokenizer), max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=end)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).eval()
    banned = tokenizer.convert_tokens_to_ids([*SPECIAL_TOKENS, "<|im_start|>", *MARKUP_TOKENS])
    with torch.no_grad():
        embedding = model.model.embed_tokens.weight
        embedding.copy_(torch.randn(embedding.shape, generator=torch.Generator().manual_seed(seed)))
        embedding[:, 0] = 1.0
        head = model.lm_head.weight
        head[:, 0] = 0.0
        head[banned, 0] = -10.0
        head[end, 0] = 3.0
    return model, tokenizer


@pytest.fixture(scope="module")
def moe_chat():
    return moe_chat_model()


@pytest.fixture(scope="module")
def envs_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("envs") / "envs.py"
    path.write_text(ENVS)
    return path


def _forward_routes(model, ids: list[int]) -> torch.Tensor:
    """The experts [len(ids), L, k] one forward over `ids` routes each position to."""
    with torch.no_grad(), RouterRecorder(model) as recorder:
        model(input_ids=torch.tensor([ids]))
        return recorder.pop()


def _full_forward_routes(model, record) -> torch.Tensor:
    """The experts [R, L, k] one forward over the episode's tokens routes each response token's predicting
    position to."""
    return _forward_routes(model, record.prompt_ids + record.response_ids)[len(record.prompt_ids) - 1 : -1]


def _same_experts(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.sort(-1).values, b.sort(-1).values)


def check_episode_routes(model, records) -> None:
    """Each record's routed_experts: [R, 2, 2] int16 with rows on every token, model turns' and inserted ones'
    (their episodes end with a model turn, which read the tokens inserted before it), those of one forward over the
    episode's tokens, and varied (not every token sent to the same experts)."""
    for record in records:
        routes = record.routed_experts
        assert routes.dtype == torch.int16 and tuple(routes.shape) == (len(record.response_ids), 2, 2), record.id
        assert (routes >= 0).all(), record.id
        assert _same_experts(routes, _full_forward_routes(model, record)), record.id
    chosen = torch.cat([r.routed_experts for r in records])
    assert len(set(map(tuple, chosen.sort(-1).values.flatten(1).tolist()))) > 4  # tokens route differently


@pytest.mark.parametrize("engine", ["hf", "native"])
def test_episode_records_carry_every_turns_routing_and_replay_gives_the_rollout_logprobs(moe_chat, envs_file, engine):
    model, tokenizer = moe_chat
    settings = {"block_size": 4, "max_num_seqs": 4} if engine == "native" else {"batch_size": 4}
    runner = EnvRollout(
        token_engine(model, tokenizer, engine, **settings),
        tokenizer,
        SamplingParams(n=2, max_new_tokens=8, temperature=1.0, seed=5),
        AgentConfig(env=f"{envs_file}:Echo", max_total_tokens=400),
    )
    records = runner.generate(QUESTIONS).records
    assert sum(r.num_turns for r in records) > len(records)  # several turns, tool/user tokens between them
    check_episode_routes(model, records)
    tensors = collate(records, tokenizer.pad_token_id)
    mask = tensors["loss_mask"]
    assert (tensors["response_mask"] & ~mask).any()  # inserted tokens: replayed (and counted), no logprobs
    scorer = ModuleScorer(model, DistContext(device=torch.device("cpu")))
    logprobs, mismatch = scorer.replayed_logprobs(
        tensors, "rollout", 1.0, torch.float32, micro_batch_size=2, impl="naive"
    )
    assert mismatch == 0.0
    assert torch.allclose(logprobs[mask], tensors["rollout_logprobs"][mask], atol=1e-4)
    late = dict(tensors, routed_experts=tensors["routed_experts"].roll(1, dims=1))  # one position off: detected
    assert scorer.replayed_logprobs(late, "off", 1.0, torch.float32, micro_batch_size=2, impl="naive")[1] > 0


def test_served_agent_records_carry_routing(moe_chat, tmp_path):
    """An agent over the OpenAI-compatible endpoint (rlx serve's sessions): the same routing in its records."""
    model, tokenizer = moe_chat
    (tmp_path / "agent.py").write_text(AGENT)
    sampling = SamplingParams(n=2, max_new_tokens=12, temperature=1.0, seed=5)  # the agent asks for 12
    cfg = AgentConfig(max_total_tokens=400)
    rollout = AgentRollout(token_engine(model, tokenizer), tokenizer, sampling, cfg, f"{tmp_path}/agent.py:echo_agent")
    records = rollout.generate(QUESTIONS).records
    assert sum(r.num_turns for r in records) > len(records)
    check_episode_routes(model, records)


def test_a_trajectory_records_routing_only_when_every_model_turn_has_it():
    turn = torch.tensor([[[0, 1]], [[2, 3]]], dtype=torch.int16)  # 2 tokens, 1 layer, k = 2
    traj = Trajectory([1, 2], [])
    traj.add_model_turn([5, 6], [-1.0, -2.0], turn)
    traj.add_inserted([7, 8, 9])
    assert traj.num_pending_inserted == 3  # what the next turn's request asks the engine for
    traj.add_model_turn([10, 11], [-1.0, -1.0], turn + 1)  # its engine could not tell them: -1
    assert traj.num_pending_inserted == 0
    routes = traj.routed_experts()
    assert tuple(routes.shape) == (7, 1, 2) and routes[:, 0, 0].tolist() == [0, 2, -1, -1, -1, 1, 3]
    traj.add_inserted([12])
    traj.add_model_turn([13], [-1.0], turn[:1] + 4, inserted_routes=turn[1:] + 4)  # the rows it read token 12 with
    assert traj.routed_experts()[:, 0, 0].tolist() == [0, 2, -1, -1, -1, 1, 3, 6, 4]
    traj.add_inserted([14])
    traj.add_model_turn([15], [-1.0])  # a turn from an engine without routing: nothing is replayed
    assert traj.routed_experts() is None
    assert Trajectory([1], []).routed_experts() is None
    with pytest.raises(ValueError, match="rows of routed experts"):
        Trajectory([1], []).add_model_turn([5], [-1.0], turn)
    traj = Trajectory([1], [])
    traj.add_inserted([2, 3])
    with pytest.raises(ValueError, match="2 inserted tokens before a model turn but 1 rows"):
        traj.add_model_turn([5], [-1.0], turn[:1], inserted_routes=turn[:1])


@pytest.mark.parametrize("engine", ["hf", "native"])
def test_engines_return_the_routing_of_the_prompt_positions_asked_for(moe_chat, engine):
    """Requests of several lengths asking for the routing of none to all but one of their prompt tokens' predicting
    positions, in one batch (one prefill on native): Generated.prompt_routed_experts then routed_experts are the
    rows one forward over the context and response routes the positions before each of those tokens to."""
    model, tokenizer = moe_chat
    settings = {"block_size": 4, "max_num_seqs": 4} if engine == "native" else {"batch_size": 4}
    texts = ["hello", "what is 2 + 3", "tell me a story!", "say hi?"]
    contexts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    asked = [0, len(contexts[1]) - 1, 4, 1]
    requests = [TokenRequest(f"r/{i}", ids, 3, num_prompt_routes=n) for i, (ids, n) in enumerate(zip(contexts, asked))]
    sampling = SamplingParams(n=1, max_new_tokens=3, temperature=1.0, seed=5)
    generated = token_engine(model, tokenizer, engine, **settings).generate_tokens(requests, sampling)
    for ids, n, gen in zip(contexts, asked, generated):
        own, p = _forward_routes(model, ids + gen.response_ids), len(ids)
        assert _same_experts(gen.routed_experts, own[p - 1 : p - 1 + len(gen.response_ids)])
        if not n:
            assert gen.prompt_routed_experts is None
            continue
        assert gen.prompt_routed_experts.dtype == torch.int16
        assert _same_experts(gen.prompt_routed_experts, own[p - 1 - n : p - 1]), n


def test_native_engine_routes_prompt_positions_its_prefix_cache_holds(moe_chat):
    """A request whose context an earlier one left in the native engine's prefix cache, asking for the routing of
    its last 6 prompt tokens: the positions predicting them are computed again (the cache had their blocks), the
    blocks before them are still shared, and the rows are those of one forward over the context."""
    model, tokenizer = moe_chat
    engine = token_engine(model, tokenizer, "native", block_size=4, max_num_seqs=4)
    context = tokenizer.encode("abcdefghijklmnopqr", add_special_tokens=False)
    assert len(context) == 18  # positions 0-17: the first request leaves blocks 0-15 cached
    stream = engine.open_stream(SamplingParams(n=1, max_new_tokens=2, temperature=1.0, seed=5), 64, 2)
    try:
        results = []
        for request in (TokenRequest("a", context, 1), TokenRequest("b", context, 2, num_prompt_routes=6)):
            stream.submit(request.key, request)
            done = []
            while not done:
                done = stream.step()
            results.append(done[0][1])
        cached = stream.stats()["cached_prefix_tokens"]
    finally:
        stream.close()
    assert cached == 8  # blocks 0-7 shared; 11-16 are routed, so their blocks (8-15) are computed again
    own = _forward_routes(model, context + results[1].response_ids)
    assert _same_experts(results[1].prompt_routed_experts, own[11:17])
    assert _same_experts(results[1].routed_experts, own[17:-1])


def test_rollout_env_score_train_step_with_router_replay(moe_chat, envs_file, tmp_path):
    model, tokenizer = moe_chat
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"hi {i}"}) + "\n" for i in range(2)))
    rollouts = tmp_path / "rollouts.jsonl"
    cli_ok("rollout", "--model", tmp_path / "model", "--prompts", prompts, "--out", rollouts, "--env",
           f"{envs_file}:Echo", "--n", "2", "--max-new-tokens", "8", "--temperature", "1.0", "--seed", "3",
           "--max-total-tokens", "300")  # fmt: skip
    lines = read_jsonl(rollouts)
    assert all(r["routed_experts_shape"] == [len(r["response_ids"]), 2, 2] for r in lines)
    score = ["score", "--actor", tmp_path / "model", "--reward", "env", "--router-replay", "rollout"]
    cli_ok(*score, "--rollouts", rollouts, "--out", tmp_path / "s", "--metrics", tmp_path / "score.jsonl")
    assert read_jsonl(tmp_path / "score.jsonl")[0]["moe/routing_mismatch"] == 0.0
    cli_ok("shard", "--model", tmp_path / "model", "--out", tmp_path / "ck")
    batch, metrics = tmp_path / "s" / "batch.safetensors", tmp_path / "train.jsonl"
    cli_ok("train-step", "--checkpoint", tmp_path / "ck", "--batch", batch, "--out", tmp_path / "ck1", "--lr", "1e-2",
           "--router-replay", "rollout", "--metrics", metrics)  # fmt: skip
    assert read_jsonl(metrics)[0]["actor/moe_routing_mismatch"] == 0.0  # the training forward's
    partly = write_jsonl(tmp_path / "partly.jsonl", [
        {k: v for k, v in r.items() if i or not k.startswith("routed_experts")} for i, r in enumerate(lines)
    ])  # fmt: skip
    result = cli(*score, "--rollouts", partly, "--out", tmp_path / "s2")
    assert result.exit_code == 1 and "1 of 4 rollouts have no routed_experts" in result.stderr
