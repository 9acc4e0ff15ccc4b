"""The 'megatron' checkpoint layout: `rlx shard --layout megatron --tp N --pp M`, `rlx merge` back to
Hugging Face (bit-exact), the per-rank files, resharding, the collective writer, and commands that
read a model (rollout, score) accepting it. Conversion needs no megatron-core, so neither do these tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlx.checkpoints.megatron import (
    rank_dir,
    read_full_weights,
    read_rank_optimizer,
    read_rank_state,
    save_megatron_checkpoint,
)
from rlx.checkpoints.meta import CheckpointMeta
from rlx.checkpoints.registry import read_full_optimizer
from rlx.models.loading import read_weights
from rlx.models.tiny import build_char_tokenizer
from tests.conftest import WORKERS, cli, cli_ok, read_jsonl, rollout_args, run_torchrun, save_tiny_hf

AUX = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def save_tiny_qwen2(out: Path, seed: int = 0) -> Path:
    """A tiny Qwen2 HF dir (QKV bias, untied) with the character tokenizer."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    tokenizer = build_char_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def assert_bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert torch.equal(a[key].reshape(-1).view(torch.uint8), b[key].reshape(-1).view(torch.uint8)), key


def shard_megatron(source: Path, out: Path, tp: int, pp: int, *extra: str) -> Path:
    result = cli_ok("shard", "--model", source, "--out", out, "--layout", "megatron", "--tp", tp, "--pp", pp, *extra)
    assert f"tp {tp} x pp {pp}" in result.stderr
    return out


@pytest.mark.parametrize("tp,pp,tie", [(1, 1, True), (2, 1, False), (1, 2, True), (2, 2, False), (2, 2, True)])
def test_llama_shard_then_merge_is_bit_exact(tmp_path, tp, pp, tie):
    hf = save_tiny_hf(tmp_path / "hf", tie=tie)
    ckpt = shard_megatron(hf, tmp_path / "ckpt", tp, pp)
    cli_ok("merge", "--checkpoint", ckpt, "--out", tmp_path / "back")
    assert_bit_equal(read_weights(hf), read_weights(tmp_path / "back"))
    for name in AUX:
        assert (hf / name).read_bytes() == (ckpt / name).read_bytes() == (tmp_path / "back" / name).read_bytes()
    meta = CheckpointMeta.read(ckpt)
    assert (meta.layout, meta.tp_degree, meta.pp_degree, meta.step) == ("megatron", tp, pp, 0)
    ranks = {rank_dir(t, p) for t in range(tp) for p in range(pp)}
    assert {p.name for p in ckpt.iterdir() if p.is_dir()} == ranks
    assert not (ckpt / "model.safetensors").exists() and not (tmp_path / "back" / "rlx.json").exists()


def test_shard_files_hold_each_ranks_slices(tmp_path):
    """tp 2 x pp 2 of a 2-layer GQA Llama (4 query heads, 2 key/value groups, head dim 16, vocab 19)."""
    hf = save_tiny_hf(tmp_path / "hf", tie=False)
    ckpt = shard_megatron(hf, tmp_path / "ckpt", 2, 2)
    full = read_weights(hf)
    vocab = full["model.embed_tokens.weight"].shape[0]
    assert vocab % 2 == 1  # padded to a multiple of tp
    for t in range(2):
        first, last = read_rank_state(ckpt, t, 0), read_rank_state(ckpt, t, 1)
        assert set(first) - {k for k in first if k.startswith("decoder.layers.0.")} == {
            "embedding.word_embeddings.weight"
        }
        assert "decoder.layers.1.input_layernorm.weight" not in last  # layer indices are local to the stage
        assert set(last) >= {"output_layer.weight", "decoder.final_layernorm.weight"}
        # 1 key/value group per rank: 2 query heads + key + value, 16 rows each
        assert first["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (64, 64)
        assert first["decoder.layers.0.mlp.linear_fc1.weight"].shape == (128, 64)  # gate rows then up rows
        assert first["decoder.layers.0.mlp.linear_fc2.weight"].shape == (64, 64)
        embedding = first["embedding.word_embeddings.weight"]
        assert embedding.shape == ((vocab + 1) // 2, 64)
        rows = embedding.shape[0]
        assert torch.equal(embedding[: vocab - t * rows], full["model.embed_tokens.weight"][t * rows :][:rows])
    assert torch.count_nonzero(read_rank_state(ckpt, 1, 0)["embedding.word_embeddings.weight"][-1]) == 0
    assert torch.count_nonzero(read_rank_state(ckpt, 1, 1)["output_layer.weight"][-1]) == 0


def test_qwen2_with_qkv_bias_round_trips(tmp_path):
    hf = save_tiny_qwen2(tmp_path / "hf")
    ckpt = shard_megatron(hf, tmp_path / "ckpt", 2, 2)
    assert read_rank_state(ckpt, 1, 1)["decoder.layers.0.self_attention.linear_qkv.bias"].shape == (64,)
    cli_ok("merge", "--checkpoint", ckpt, "--out", tmp_path / "back")
    before = read_weights(hf)
    assert "model.layers.1.self_attn.k_proj.bias" in before
    assert_bit_equal(before, read_weights(tmp_path / "back"))


def test_critic_round_trip_matches_the_single_layout(tmp_path):
    from rlx.checkpoints.loading import load_model
    from rlx.models.loading import resolve_source

    hf = save_tiny_hf(tmp_path / "hf", tie=True)
    cli_ok("shard", "--model", hf, "--role", "critic", "--seed", "3", "--out", tmp_path / "single")
    ckpt = shard_megatron(hf, tmp_path / "ckpt", 2, 2, "--role", "critic", "--seed", "3")
    head = read_rank_state(ckpt, 1, 1)
    assert head["value_head.score.weight"].shape == (1, 64) and "output_layer.weight" not in head
    cli_ok("merge", "--checkpoint", ckpt, "--out", tmp_path / "back")
    assert_bit_equal(read_weights(tmp_path / "single"), read_weights(tmp_path / "back"))
    assert (tmp_path / "single" / "config.json").read_bytes() == (ckpt / "config.json").read_bytes()
    critic = load_model(resolve_source(ckpt), "critic").state_dict()  # what `rlx score --critic` loads
    reference = load_model(resolve_source(tmp_path / "single"), "critic").state_dict()
    assert all(torch.equal(critic[k], reference[k]) for k in reference)


def test_bfloat16_shard_matches_the_single_layout(tmp_path):
    hf = save_tiny_hf(tmp_path / "hf", tie=False)
    ckpt = shard_megatron(hf, tmp_path / "ckpt", 2, 1, "--dtype", "bfloat16")
    assert all(t.dtype == torch.bfloat16 for t in read_rank_state(ckpt, 0, 0).values())
    assert json.loads((ckpt / "config.json").read_text())["dtype"] == "bfloat16"
    cli_ok("shard", "--model", hf, "--out", tmp_path / "single", "--dtype", "bfloat16")
    cli_ok("merge", "--checkpoint", ckpt, "--out", tmp_path / "back")
    assert_bit_equal(read_weights(tmp_path / "single"), read_weights(tmp_path / "back"))


def test_random_init_shards_the_seeded_model(tmp_path, tiny_dir):
    cli_ok("shard", "--model", tiny_dir, "--init", "random", "--seed", "4", "--out", tmp_path / "single")
    ckpt = shard_megatron(tiny_dir, tmp_path / "ckpt", 2, 1, "--init", "random", "--seed", "4")
    assert_bit_equal(read_weights(tmp_path / "single"), read_full_weights(ckpt))


def test_read_rank_state_and_optimizer_reshard(tmp_path):
    """Another tp x pp than stored: the weights and the AdamW moments are cut anew, the step copied."""
    from rlx.models.loading import ModelSource, load_config
    from rlx.models.megatron.convert import hf_to_megatron

    hf = save_tiny_hf(tmp_path / "hf", tie=False)
    full = read_weights(hf)
    config = load_config(ModelSource(hf))
    moments = {name: torch.randn_like(tensor) for name, tensor in full.items()}
    stored, stored_moments = hf_to_megatron(full, config, 2, 1), hf_to_megatron(moments, config, 2, 1)
    optimizer = {
        rank: {
            **{f"{n}::exp_avg": v for n, v in stored_moments[rank].items()},
            **{f"{n}::step": torch.tensor(7.0) for n in stored_moments[rank]},
        }
        for rank in stored
    }
    meta = CheckpointMeta(layout="megatron", tp_degree=2, pp_degree=1)
    ckpt = tmp_path / "ckpt"
    aux = {name: (hf / name).read_bytes() for name in AUX}
    save_megatron_checkpoint(ckpt, stored, aux, meta, optimizer_states=optimizer)
    assert_bit_equal(read_rank_optimizer(ckpt, 1, 0), optimizer[(1, 0)])
    want, want_moments = hf_to_megatron(full, config, 1, 2), hf_to_megatron(moments, config, 1, 2)
    for p in range(2):
        assert_bit_equal(read_rank_state(ckpt, 0, p, tp_degree=1, pp_degree=2), want[(0, p)])
        got = read_rank_optimizer(ckpt, 0, p, tp_degree=1, pp_degree=2)
        assert_bit_equal(
            {k[: -len("::exp_avg")]: v for k, v in got.items() if k.endswith("::exp_avg")}, want_moments[(0, p)]
        )
        assert {k for k in got if k.endswith("::step")} == {f"{n}::step" for n in want[(0, p)]}
        assert all(float(v) == 7.0 for k, v in got.items() if k.endswith("::step"))
    assert read_full_optimizer(ckpt) is None  # per rank: only the megatron trainer reads it
    shard_megatron(hf, tmp_path / "fresh", 1, 1)
    assert read_rank_optimizer(tmp_path / "fresh", 0, 0) is None


def test_collective_writer_with_data_parallel_replicas(tmp_path):
    hf = save_tiny_hf(tmp_path / "hf", tie=False)
    source = shard_megatron(hf, tmp_path / "ckpt", 2, 1)
    run_torchrun(4, WORKERS / "megatron_write.py", source, tmp_path / "next", timeout=300)
    meta = CheckpointMeta.read(tmp_path / "next")
    assert (meta.step, meta.tp_degree) == (1, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf", "next"]  # no temporaries
    for t in range(2):
        assert all(float(v.abs().max()) == 0.0 for v in read_rank_optimizer(tmp_path / "next", t, 0).values())
    assert_bit_equal(read_weights(hf), read_full_weights(tmp_path / "next"))


def test_rollout_and_score_from_a_megatron_checkpoint_equal_the_hf_dir(tmp_path, prompts_file):
    hf = save_tiny_hf(tmp_path / "hf", tie=False)
    ckpt = shard_megatron(hf, tmp_path / "ckpt", 2, 2)
    for name, model in (("hf", hf), ("mg", ckpt)):
        cli_ok(*rollout_args(model, prompts_file, tmp_path / f"{name}.jsonl", "--seed", "3"))
    got, want = read_jsonl(tmp_path / "mg.jsonl"), read_jsonl(tmp_path / "hf.jsonl")
    assert [r["response_ids"] for r in got] == [r["response_ids"] for r in want]
    assert [r["rollout_logprobs"] for r in got] == [r["rollout_logprobs"] for r in want]
    for name, model in (("hf", hf), ("mg", ckpt)):
        cli_ok("score", "--rollouts", tmp_path / "hf.jsonl", "--actor", model, "--ref", model, "--out", tmp_path / name)
    from rlx.formats.batch import TrainBatch

    a, b = (
        TrainBatch.load(tmp_path / "hf" / "batch.safetensors"),
        TrainBatch.load(tmp_path / "mg" / "batch.safetensors"),
    )
    assert torch.equal(a.old_logprobs, b.old_logprobs) and torch.equal(a.ref_logprobs, b.ref_logprobs)


def assert_error(result, *fragments: str) -> None:
    assert result.exit_code == 1, result
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, (fragment, result.stderr)


def test_tp_that_does_not_divide_the_heads_is_refused(tmp_path):
    hf = save_tiny_hf(tmp_path / "hf")
    args = ("shard", "--model", hf, "--out", tmp_path / "ckpt", "--layout", "megatron")
    assert_error(cli(*args, "--tp", "3"), "--tp 3", "4 attention heads")
    assert_error(cli(*args, "--pp", "3"), "--pp 3", "2 layers")
    assert_error(cli(*args, "--tp", "0"), "at least 1")
    assert not (tmp_path / "ckpt").exists()


def test_tp_with_another_layout_is_refused(tmp_path):
    hf = save_tiny_hf(tmp_path / "hf")
    assert_error(cli("shard", "--model", hf, "--out", tmp_path / "ckpt", "--tp", "2"), "--layout megatron only")
    assert_error(
        cli("shard", "--model", hf, "--out", tmp_path / "ckpt", "--layout", "fsdp", "--pp", "1"), "--layout megatron"
    )
    assert not (tmp_path / "ckpt").exists()


def test_missing_rank_file_or_degrees_are_named(tmp_path, prompts_file):
    hf = save_tiny_hf(tmp_path / "hf")
    ckpt = shard_megatron(hf, tmp_path / "ckpt", 2, 1)
    (ckpt / "mp_rank_01_000" / "model.safetensors").unlink()
    message = f"{ckpt}/mp_rank_01_000/model.safetensors: missing (checkpoint written with tp 2, pp 1)"
    assert_error(cli("merge", "--checkpoint", ckpt, "--out", tmp_path / "back"), message)
    assert_error(cli(*rollout_args(ckpt, prompts_file, tmp_path / "r.jsonl")), "mp_rank_01_000/model.safetensors")
    assert not (tmp_path / "back").exists() and not (tmp_path / "r.jsonl").exists()
    meta = json.loads((ckpt / "rlx.json").read_text())
    del meta["pp_degree"]
    (ckpt / "rlx.json").write_text(json.dumps(meta))
    assert_error(cli("merge", "--checkpoint", ckpt, "--out", tmp_path / "back"), "rlx.json", "pp_degree")


@pytest.mark.parametrize("layout", ["megatron", "fsdp"])
def test_vllm_disk_reload_reads_sharded_checkpoints(tmp_path, layout):
    """The vllm engine's reload-from-checkpoint stream gathers a sharded checkpoint whole (tied head added)."""
    from rlx.checkpoints.loading import checkpoint_weights

    source = save_tiny_hf(tmp_path / "hf", tie=True)
    extra = ["--tp", "2", "--pp", "2"] if layout == "megatron" else []
    cli_ok("shard", "--model", source, "--out", tmp_path / "ck", "--layout", layout, *extra)
    got = dict(checkpoint_weights(tmp_path / "ck", tied=True))
    want = read_weights(source)
    assert got.pop("lm_head.weight") is got["model.embed_tokens.weight"]
    assert_bit_equal(got, want)
