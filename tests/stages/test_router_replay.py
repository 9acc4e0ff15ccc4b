"""Rollout routing replay (R3) on a tiny Qwen3-MoE, CPU: the hf engine records the experts the model's own routers
pick, replaying them changes nothing, forcing another model's routing gives its experts and its logprobs, the
routing-mismatch metric, and the rollout -> score -> train-step pipeline with --router-replay rollout."""

from __future__ import annotations

import copy

import pytest
import torch

from rlx.formats.batch import TrainBatch
from rlx.logprobs import ModuleScorer, response_logprobs
from rlx.models.moe import write_tiny_moe_model_dir
from rlx.models.routing import RouterRecorder, RouterReplay, decode_routes, encode_routes
from rlx.parallel.dist import DistContext
from tests.conftest import cli, cli_ok, read_jsonl, rollout_args, write_jsonl, write_length_reward
from tests.stages.test_moe import _batch

CPU = DistContext(device=torch.device("cpu"))
ROWS = [([1, 5, 6], [7, 8, 9, 2]), ([1, 10, 11, 12, 13], [4, 2]), ([1, 3], [5, 6, 7, 8, 9, 10])]


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    hub = write_tiny_moe_model_dir(tmp_path_factory.mktemp("r3") / "hf", "qwen3_moe", seed=0)
    out = tmp_path_factory.mktemp("r3_ck") / "step0"
    cli_ok("shard", "--model", hub, "--out", out)
    return out


def _load(path, **config):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **config).eval()


def _routes_of(model, tensors) -> torch.Tensor:
    """The experts [B, P+R, L, k] a padded forward of `tensors` routes each column to (-1 at padding)."""
    with torch.no_grad(), RouterRecorder(model) as recorder:
        response_logprobs(model, **tensors, temperature=1.0, dtype=torch.float32)
        routes = recorder.pop()
    b = tensors["prompt_ids"].shape[0]
    routes = routes.unflatten(0, (b, -1))
    mask = torch.cat([tensors["prompt_mask"], tensors["response_mask"]], dim=1).bool()
    return torch.where(mask[..., None, None], routes, torch.full_like(routes, -1))


def test_routes_encode_to_base64_int16_and_back():
    routes = torch.tensor([[[0, 3], [2, 1]], [[-1, -1], [7, 300]]], dtype=torch.int16)
    assert torch.equal(decode_routes(encode_routes(routes), (2, 2, 2)), routes)
    with pytest.raises(ValueError):
        decode_routes(encode_routes(routes), (3, 2, 2))


def test_a_malformed_routed_experts_field_is_a_user_error():
    from rlx.errors import UserError
    from rlx.formats.records import RolloutRecord

    line = {"id": "0/0", "prompt_id": "0", "sample_index": 0, "prompt": "1+1", "response": "2", "prompt_ids": [1],
            "response_ids": [5, 2], "rollout_logprobs": [-1.0, -0.5], "finish_reason": "stop",
            "temperature": 1.0}  # fmt: skip
    routes = torch.tensor([[[0, 1]], [[2, 3]]], dtype=torch.int16)
    good = {**line, "routed_experts": encode_routes(routes), "routed_experts_shape": [2, 1, 2]}
    record = RolloutRecord.from_json(good, "r.jsonl:1")
    assert torch.equal(record.routed_experts, routes) and record.to_json()["routed_experts"] == good["routed_experts"]
    for bad, field in (({"routed_experts_shape": [3, 1, 2]}, "routed_experts_shape"),
                       ({"routed_experts": "not base64!"}, "routed_experts"),
                       ({"routed_experts_shape": [2, 2, 2]}, "routed_experts")):  # fmt: skip
        with pytest.raises(UserError, match=f"r.jsonl:1: field '{field}'"):
            RolloutRecord.from_json({**good, **bad}, "r.jsonl:1")


def test_rollout_records_the_routers_own_choice_and_replaying_it_changes_nothing(tmp_path, moe_ckpt, prompts_file):
    out = tmp_path / "r.jsonl"
    cli_ok(*rollout_args(moe_ckpt, write_jsonl(tmp_path / "p.jsonl", read_jsonl(prompts_file)[:4]), out))
    model = _load(moe_ckpt)
    for record in read_jsonl(out):
        prompt, response = record["prompt_ids"], record["response_ids"]
        assert record["routed_experts_shape"] == [len(response), 2, 2]
        recorded = decode_routes(record["routed_experts"], tuple(record["routed_experts_shape"]))
        with torch.no_grad(), RouterRecorder(model) as recorder:
            model(input_ids=torch.tensor([prompt + response]))
            own = recorder.pop()[len(prompt) - 1 : -1]  # the positions that predict the response tokens
        assert torch.equal(recorded.sort(-1).values, own.sort(-1).values), record["id"]
    scorer, tensors = ModuleScorer(model, CPU), _batch(ROWS)
    tensors["routed_experts"] = _routes_of(model, tensors)
    plain = scorer.logprobs(tensors, 1.0, torch.float32, micro_batch_size=2, impl="naive")
    for max_tokens in (0, 64):  # padded and packed micro-batches
        replayed, mismatch = scorer.replayed_logprobs(
            tensors, "rollout", 1.0, torch.float32, micro_batch_size=2, impl="naive", max_tokens=max_tokens
        )
        assert mismatch == 0.0 and torch.allclose(replayed, plain, atol=1e-6), max_tokens


def test_forcing_a_perturbed_models_routing_gives_its_experts_and_logprobs(tmp_path):
    # one expert per token with normalised weights: a token's output depends on which expert only, so a model
    # forced to another router's choices must give that model's logprobs exactly
    hub = write_tiny_moe_model_dir(tmp_path / "hf", "qwen3_moe", seed=0, top_k=1, norm_topk_prob=True)
    model = _load(hub)
    perturbed = copy.deepcopy(model)
    with torch.no_grad():
        for name, param in perturbed.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.copy_(torch.randn_like(param, generator=torch.Generator().manual_seed(3)))
    tensors = _batch(ROWS)
    routes = _routes_of(perturbed, tensors)
    assert not torch.equal(routes, _routes_of(model, tensors))
    want = ModuleScorer(perturbed, CPU).logprobs(tensors, 1.0, torch.float32, micro_batch_size=3, impl="naive")
    tensors["routed_experts"] = routes
    scorer = ModuleScorer(model, CPU)
    own, mismatch = scorer.replayed_logprobs(tensors, "off", 1.0, torch.float32, micro_batch_size=3, impl="naive")
    assert mismatch > 0 and not torch.allclose(own, want, atol=1e-3)
    for max_tokens in (0, 64):
        forced, _ = scorer.replayed_logprobs(
            tensors, "rollout", 1.0, torch.float32, micro_batch_size=3, impl="naive", max_tokens=max_tokens
        )
        assert torch.allclose(forced, want, atol=1e-5), (max_tokens, (forced - want).abs().max())
    with RouterReplay(model, force=True) as replay, RouterRecorder(model) as recorder:  # what the experts got
        replay.set_routes(routes.flatten(0, 1))
        with torch.no_grad():
            response_logprobs(model, **{k: v for k, v in tensors.items() if k != "routed_experts"},
                              temperature=1.0, dtype=torch.float32)  # fmt: skip
        used = recorder.pop()
    recorded = routes.flatten(0, 1) >= 0
    assert torch.equal(used.long()[recorded], routes.flatten(0, 1).long()[recorded])


def test_forced_routing_keeps_router_gradients(moe_ckpt):
    model = _load(moe_ckpt).train()
    tensors = _batch(ROWS)
    routes = _routes_of(model, tensors).roll(1, dims=-2)  # another layer's experts: a different routing
    with RouterReplay(model, force=True) as replay:
        replay.set_routes(routes.flatten(0, 1))
        logp, _ = response_logprobs(model, **tensors, temperature=1.0, dtype=torch.float32)
        (logp * tensors["response_mask"]).sum().backward()
    assert replay.mismatch > 0
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_rollout_score_train_step_with_router_replay(tmp_path, moe_ckpt, prompts_file):
    rollouts = tmp_path / "rollouts.jsonl"
    cli_ok(*rollout_args(moe_ckpt, write_jsonl(tmp_path / "p.jsonl", read_jsonl(prompts_file)[:4]), rollouts))
    reward = write_length_reward(tmp_path)
    score = ["score", "--rollouts", rollouts, "--actor", moe_ckpt, "--reward", f"{reward}:score"]
    cli_ok(*score, "--out", tmp_path / "s", "--router-replay", "rollout", "--metrics", tmp_path / "score.jsonl")
    assert read_jsonl(tmp_path / "score.jsonl")[0]["moe/routing_mismatch"] == 0.0
    batch = TrainBatch.load(tmp_path / "s" / "batch.safetensors")
    assert batch.routed_experts.dtype == torch.int16
    assert tuple(batch.routed_experts.shape) == (16, batch.prompt_ids.shape[1] + batch.response_ids.shape[1], 2, 2)
    for packing in ([], ["--use-packing"]):
        metrics = tmp_path / f"train{len(packing)}.jsonl"
        cli_ok("train-step", "--checkpoint", moe_ckpt, "--batch", tmp_path / "s" / "batch.safetensors", "--out",
               tmp_path / f"step{len(packing)}", "--lr", "1e-2", "--router-replay", "rollout", "--metrics", metrics,
               *packing)  # fmt: skip
        line = read_jsonl(metrics)[0]
        assert line["moe/routing_mismatch"] == 0.0  # score's
        assert line["actor/moe_routing_mismatch"] == 0.0  # the training forward's: one update, still on-policy
    plain = write_jsonl(tmp_path / "plain.jsonl", [
        {k: v for k, v in r.items() if not k.startswith("routed_experts")} for r in read_jsonl(rollouts)
    ])  # fmt: skip
    result = cli(*score[:2], plain, *score[3:], "--out", tmp_path / "s2", "--router-replay", "rollout")
    assert result.exit_code == 1 and "routed_experts" in result.stdout + result.stderr
    cli_ok(*score[:2], plain, *score[3:], "--out", tmp_path / "s3")  # no routing: no replay, no metric
    result = cli("train-step", "--checkpoint", moe_ckpt, "--batch", tmp_path / "s3" / "batch.safetensors", "--out",
                 tmp_path / "bad", "--router-replay", "rollout")  # fmt: skip
    assert result.exit_code == 1 and "routed_experts" in result.stdout + result.stderr
