"""Tensor parallelism in the native rollout engine (rollout.tp_degree): two gloo ranks on the CPU decode with half
the heads and half the MLP each and sample what one engine with the whole model samples."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlx.config import ConfigError
from rlx.rollout.agent_config import AgentConfig
from rlx.rollout.config import RolloutConfig
from tests.conftest import REPO, WORKERS, cli, cli_ok, read_jsonl, rollout_args, run_torchrun, torchrun_commands


def test_two_tensor_parallel_ranks_sample_what_one_engine_samples(tmp_path):
    """Tiny Llama (with and without o_proj/down_proj biases) and Qwen2 (q/k/v biases), greedy and sampled at a fixed
    seed, from a plain model and from FSDP shards: the same tokens on both ranks as one whole engine, logprobs to
    1e-5."""
    out = run_torchrun(2, WORKERS / "native_tp.py", "cpu", timeout=300)
    assert "rank 0: tensor parallel == one engine" in out.stdout
    assert "rank 1: tensor parallel == one engine" in out.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_tensor_parallel_decode_graphs_on_two_gpus(tmp_path):
    """The same on two GPUs over NCCL: decode steps replay CUDA graphs (the all-reduces captured inside them, the
    merged layers compiled), float32, against one GPU's engine."""
    out = run_torchrun(2, WORKERS / "native_tp.py", "cuda", timeout=600)
    assert "rank 1: tensor parallel == one engine" in out.stdout


ROLLOUT = ["--engine", "native", "--seed", "4", "--temperature", "1", "--kv-cache-gib", "0.001"]
PPO_SETS = ["data.prompts_per_step=4", "rollout.sampling.n=2", "steps=2", "rollout.engine=native"]
PPO = ["ppo", Path(REPO) / "recipes" / "quickstart.toml", *[a for s in PPO_SETS for a in ("--set", s)]]
PPO += ["--set", "rollout.kv_cache_gib=0.001"]


def agent_rollout(folder: Path) -> list:
    """`rlx rollout` of AGENT (the model, agent and prompts written in `folder` by `tp_runs`), without --out."""
    return ["rollout", "--model", folder / "model", "--prompts", folder / "prompts.jsonl", "--engine", "native",
            "--agent", f"{folder}/agent.py:twice", "--num-samples", "2", "--max-new-tokens", "10", "--temperature",
            "1", "--seed", "4", "--max-total-tokens", "200", "--kv-cache-gib", "0.01"]  # fmt: skip


# the tests that read tp_runs run on one test worker (under -n 2 --dist loadgroup), which launches it once
SHARES_THE_LAUNCH = pytest.mark.xdist_group("native_tp")


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory, tiny_ckpt, prompts_file) -> Path:
    """The --tp-degree 2 runs of the three tests below (a rollout, an agent's rollout, `rlx ppo`) in one launch of 2
    processes, which pays the start-up and the imports once; each test runs its own in one process. The folder."""
    from tests.agent_helpers import random_chat_model

    d = tmp_path_factory.mktemp("native_tp")
    model, tokenizer = random_chat_model(stop_bias=0.5)  # 4 heads, 2 key/value heads: they split over 2 ranks
    model.save_pretrained(d / "agent" / "model")
    tokenizer.save_pretrained(d / "agent" / "model")
    (d / "agent" / "agent.py").write_text(AGENT)
    (d / "agent" / "prompts.jsonl").write_text("".join(f'{{"id": "p{i}", "prompt": "say {i}"}}\n' for i in range(3)))
    rollout = rollout_args(tiny_ckpt, prompts_file, d / "rollout_tp.jsonl", *ROLLOUT, "--tp-degree", "2")
    rollout[rollout.index("--n")] = "--num-samples"  # torchrun's own parser takes --n
    agent = [*agent_rollout(d / "agent"), "--tp-degree", "2", "--out", d / "agent_tp.jsonl"]
    torchrun_commands(2, rollout, agent, [*PPO, "--out", d / "ppo_tp", "--set", "rollout.tp_degree=2"])
    return d


@SHARES_THE_LAUNCH
def test_rollout_command_with_tp_degree_2_equals_one_process(tmp_path, tiny_ckpt, prompts_file, tp_runs):
    cli_ok(*rollout_args(tiny_ckpt, prompts_file, tmp_path / "one.jsonl", *ROLLOUT))
    one, tp = read_jsonl(tmp_path / "one.jsonl"), read_jsonl(tp_runs / "rollout_tp.jsonl")
    assert [r["response_ids"] for r in one] == [r["response_ids"] for r in tp] and len(tp) == 16
    for a, b in zip(one, tp):
        assert max(abs(x - y) for x, y in zip(a["rollout_logprobs"], b["rollout_logprobs"])) <= 1e-5


AGENT = """
import openai


def twice(record, base_url):
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": record["prompt"]}]
    for _ in range(2):
        reply = client.chat.completions.create(model="rlx", messages=messages)
        answer = {"role": "assistant", "content": reply.choices[0].message.content}
        messages += [answer, {"role": "user", "content": "more"}]
    return 0.5
"""


@pytest.mark.slow
@SHARES_THE_LAUNCH
def test_agent_episodes_at_tp_degree_2_equal_one_process(tmp_path, tp_runs):
    """Runs of an agent (two chat requests each, over the OpenAI-compatible endpoint) at --tp-degree 2: the
    group's first rank runs them and its peer mirrors its stream (rlx/rollout/mirror.py), whose requests arrive between
    keep_going and step (rlx serve's stream worker); the records equal one process's, logprobs to 1e-5. (Environment
    episodes, submitted after a step, are the vllm test's: tests/unit/test_vllm.py.)"""
    cli_ok(*agent_rollout(tp_runs / "agent"), "--out", tmp_path / "one.jsonl")
    one, tp = read_jsonl(tmp_path / "one.jsonl"), read_jsonl(tp_runs / "agent_tp.jsonl")
    assert len(one) == len(tp) == 6 and all(r["num_turns"] == 2 and 0 in r["loss_mask"] for r in one)
    for a, b in zip(one, tp):  # the split sums reorder float additions
        la, lb = a.pop("rollout_logprobs"), b.pop("rollout_logprobs")
        assert a == b and max(abs(x - y) for x, y in zip(la, lb)) <= 1e-5


def test_tp_degree_errors(tmp_path, tiny_ckpt, prompts_file, capsys):
    # the old name still works for one release, with a notice
    assert RolloutConfig(engine="vllm", tp=2).tp_degree == 2
    assert "rollout.tp_degree" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="old name of tp_degree: give one of them"):
        RolloutConfig(engine="vllm", tp=2, tp_degree=4)
    assert RolloutConfig(engine="native", tp_degree=2, agent=AgentConfig(env="envs.py:Env")).agent.is_multi_turn
    result = cli(*rollout_args(tiny_ckpt, prompts_file, tmp_path / "r.jsonl", "--engine", "hf", "--tp-degree", "2"))
    assert result.exit_code == 1 and "--tp-degree: tensor parallel rollout needs engine 'vllm' or 'native'" in (
        result.stderr
    )
    result = cli(*rollout_args(tiny_ckpt, prompts_file, tmp_path / "r.jsonl", "--engine", "native", "--tp-degree", "2"))
    assert result.exit_code == 1 and "tp_degree 2 needs 2 processes" in result.stderr
    assert not (tmp_path / "r.jsonl").exists()


def test_heads_that_do_not_split_are_refused():
    from transformers import GPT2Config, LlamaConfig

    from rlx.errors import UserError
    from rlx.rollout.native.tensor_parallel import check_splittable, rank_slice, sliced_config

    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
    check_splittable(config, 2)
    with pytest.raises(UserError, match="num_key_value_heads \\(2\\) is not a multiple"):
        check_splittable(config, 4)
    with pytest.raises(UserError, match="splits llama, qwen2, qwen3, mistral models only, not 'gpt2'"):
        check_splittable(GPT2Config(n_head=4), 2)
    half = sliced_config(config, 2)
    assert (half.num_attention_heads, half.num_key_value_heads, half.intermediate_size, half.head_dim) == (2, 1, 48, 16)
    weight = torch.arange(12.0).view(3, 4)
    assert torch.equal(rank_slice("model.layers.0.mlp.down_proj.weight", weight, 2, 1), weight[:, 2:])
    assert torch.equal(rank_slice("model.layers.0.self_attn.o_proj.bias", weight[0], 2, 1), torch.zeros(4))
    assert rank_slice("model.norm.weight", weight, 2, 1) is weight


@pytest.mark.slow
@SHARES_THE_LAUNCH
def test_ppo_with_tp_degree_2(tmp_path, tp_runs):
    cli_ok(*PPO, "--out", tmp_path / "one")
    one, tp = (read_jsonl(folder / "metrics.jsonl") for folder in (tmp_path / "one", tp_runs / "ppo_tp"))
    assert [m["reward/mean"] for m in one] == [m["reward/mean"] for m in tp] and len(tp) == 2
