"""Recipes: TOML onto typed dataclasses, unknown keys named by path, --set overrides, validation."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from rlx.config import ConfigError, apply_overrides, field_docs, from_dict, parse_override, to_dict
from rlx.errors import UserError
from rlx.ppo.config import PPOConfig, load_recipe
from rlx.rollout.config import RolloutConfig
from tests.conftest import REPO

BASE = {"model": {"path": "m"}, "data": {"prompts": "p.jsonl"}}


def test_unknown_key_is_named_with_its_path():
    with pytest.raises(ConfigError, match=r"rollout\.sampling\.temprature: unknown key") as info:
        from_dict(PPOConfig, {**BASE, "rollout": {"sampling": {"temprature": 0.5}}})
    assert "did you mean 'temperature'?" in str(info.value) and "top_p" in str(info.value)  # and every valid key


def test_wrong_type_and_bad_value_are_named():
    with pytest.raises(ConfigError, match=r"rollout\.sampling\.n: expected int"):
        from_dict(PPOConfig, {**BASE, "rollout": {"sampling": {"n": "eight"}}})
    with pytest.raises(ConfigError, match=r"rollout\.sampling\.top_p: must be in \(0, 1\]"):
        from_dict(PPOConfig, {**BASE, "rollout": {"sampling": {"top_p": 1.5}}})
    with pytest.raises(ConfigError, match=r"score\.kl_estimator: expected one of"):
        from_dict(PPOConfig, {**BASE, "score": {"kl_estimator": "k9"}})


def test_missing_required_key():
    with pytest.raises(ConfigError, match=r"data: missing required key"):
        from_dict(PPOConfig, {"model": {"path": "m"}})
    with pytest.raises(ConfigError, match=r"model\.path: missing required key"):
        from_dict(PPOConfig, {"model": {}, "data": {"prompts": "p"}})


def test_int_accepted_for_float_and_defaults_fill_in():
    cfg = from_dict(PPOConfig, {**BASE, "train": {"optim": {"lr": 1}}})
    assert cfg.train.optim.lr == 1.0 and isinstance(cfg.train.optim.lr, float)
    assert cfg.rollout == RolloutConfig()


def test_overrides_parse_toml_literals():
    assert parse_override("train.optim.lr=1e-5") == (["train", "optim", "lr"], 1e-5)
    assert parse_override("score.reward=arith") == (["score", "reward"], "arith")
    assert parse_override("train.shuffle=true") == (["train", "shuffle"], True)
    assert parse_override("train.optim.betas=[0.9, 0.95]") == (["train", "optim", "betas"], [0.9, 0.95])
    data = apply_overrides(BASE, ["rollout.sampling.n=4", "steps=3"])
    assert data["rollout"]["sampling"]["n"] == 4 and data["steps"] == 3 and "rollout" not in BASE
    with pytest.raises(UserError, match="expected KEY=VALUE"):
        parse_override("train.optim.lr")


def test_recipe_paths_are_relative_to_the_recipe(tmp_path):
    (tmp_path / "sub").mkdir()
    recipe = tmp_path / "sub" / "r.toml"
    recipe.write_text('steps = 2\n[model]\npath = "model"\n[data]\nprompts = "data/p.jsonl"\n')
    cfg = load_recipe(recipe)
    assert Path(cfg.model.path) == (tmp_path / "sub" / "model").resolve()
    assert Path(cfg.data.prompts) == (tmp_path / "sub" / "data" / "p.jsonl").resolve()
    cfg = load_recipe(recipe, ["data.prompts=other.jsonl"])  # --set values stay as given (relative to cwd)
    assert cfg.data.prompts == "other.jsonl"


def test_recipe_errors_name_the_file(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[model]\npath = "m"\n[data]\nprompts = "p"\n[train.optim]\nlr = -1\n')
    with pytest.raises(UserError, match=r"r\.toml: train\.optim\.lr: must be >= 0"):
        load_recipe(recipe)
    recipe.write_text("[model\n")
    with pytest.raises(UserError, match="invalid TOML"):
        load_recipe(recipe)
    with pytest.raises(UserError, match=r"train\.seed: set the top-level 'seed'"):
        load_recipe(REPO / "recipes" / "quickstart.toml", ["train.seed=3"])


def test_shipped_recipes_load():
    for recipe in sorted((REPO / "recipes").glob("*.toml")):
        cfg = load_recipe(recipe)
        assert cfg.steps >= 1, recipe


def test_a_mini_batch_size_must_divide_the_samples_of_a_step(tmp_path):
    """train.mini_batch_size (and critic.train's) that does not cut prompts_per_step x n samples into equal mini-batches
    is refused naming the key, the sizes and the nearest that divide them; 0, a divisor or the whole batch and more
    (one optimizer step) are kept, with dynamic sampling too (a short step is said at run time: tests/stages)."""
    quickstart, gae = REPO / "recipes" / "quickstart.toml", REPO / "recipes" / "quickstart_gae.toml"  # 32 x 8 = 256
    with pytest.raises(UserError) as e:
        load_recipe(quickstart, ["train.mini_batch_size=100"])
    assert str(e.value) == (
        "--set: train.mini_batch_size: 100 does not divide the 256 samples of a step (data.prompts_per_step 32 x "
        "rollout.sampling.n 8): 2 optimizer steps of 100 and one of 56 each epoch; nearest sizes that divide it: 64 "
        "or 128"
    )
    critic = r"critic\.train\.mini_batch_size: 200 does not divide the 256 samples .* 1 optimizer step of 200 and one"
    with pytest.raises(UserError, match=critic + r" of 56 .*: 128 or 256 \(256 or 0: the whole batch in one optimizer"):
        load_recipe(gae, ["critic.train.mini_batch_size=200"])
    with pytest.raises(UserError, match=r"quickstart\.toml: train\.mini_batch_size: 128 does not divide the 192"):
        load_recipe(quickstart, ["rollout.sampling.n=6"])  # the recipe's 128 no longer divides 32 x 6
    for mini in (0, 32, 256, 512):
        assert load_recipe(quickstart, [f"train.mini_batch_size={mini}"]).train.mini_batch_size == mini
    assert load_recipe(REPO / "recipes" / "dapo_quickstart.toml", ["train.mini_batch_size=64"]).score.filter_groups
    from tests.conftest import cli

    refused = cli("ppo", quickstart, "--out", tmp_path / "run", "--set", "train.mini_batch_size=100")
    assert refused.exit_code == 1 and "nearest sizes that divide it: 64 or 128" in refused.stderr
    assert not (tmp_path / "run").exists()


def test_a_mini_batch_smaller_than_the_data_parallel_ranks_is_refused_at_the_start():
    """Each optimizer step splits its mini-batch over the data-parallel ranks, a sample or more each: a mini-batch size
    (the actor's or the critic's) or a whole step smaller than the ranks is refused naming the key, the value, the
    ranks and the sizes that work; counts that do not split equally (4 over 3 ranks) are fine (shares balance tokens),
    and one process checks nothing."""
    from rlx.ppo.start import check_data_parallel_batches

    quickstart, gae = REPO / "recipes" / "quickstart.toml", REPO / "recipes" / "quickstart_gae.toml"
    small = ["data.prompts_per_step=2", "rollout.sampling.n=4"]  # 8 samples a step
    with pytest.raises(UserError) as e:
        check_data_parallel_batches(load_recipe(quickstart, [*small, "train.mini_batch_size=1"]), 2, 2)
    assert str(e.value) == (
        "train.mini_batch_size: 1 is fewer samples than the 2 data-parallel ranks (2 training processes): each "
        "optimizer step splits its mini-batch over them, a sample or more each; sizes that work (dividing a step's 8 "
        "samples, 2 or more): 2, 4, 8, or 0 (the whole step in one optimizer step)"
    )
    with pytest.raises(UserError, match=r"^train\.mini_batch_size: 2 is fewer samples than the 4 data-parallel ranks "
                       r"\(8 training processes, 2 to a model replica\): .*: 4, 8, or 0"):  # fmt: skip
        check_data_parallel_batches(load_recipe(quickstart, [*small, "train.mini_batch_size=2"]), 4, 8)
    critic = load_recipe(gae, [*small, "train.mini_batch_size=4", "critic.train.mini_batch_size=2"])
    with pytest.raises(UserError, match=r"^critic\.train\.mini_batch_size: 2 is fewer samples than the 3 "):
        check_data_parallel_batches(critic, 3, 3)
    whole = load_recipe(quickstart, ["data.prompts_per_step=1", "rollout.sampling.n=2", "train.mini_batch_size=0"])
    with pytest.raises(UserError) as e:
        check_data_parallel_batches(whole, 4, 4)
    assert str(e.value).startswith("data.prompts_per_step: a step's 2 samples (data.prompts_per_step 1 x rollout")
    assert str(e.value).endswith("needs a sample or more per rank; data.prompts_per_step 2 or more")
    check_data_parallel_batches(load_recipe(quickstart, [*small, "train.mini_batch_size=4"]), 3, 3)  # 2 + 1 + 1: fine
    check_data_parallel_batches(load_recipe(quickstart, [*small, "train.mini_batch_size=1"]), 1, 1)
    check_data_parallel_batches(whole, 2, 2)


def test_the_old_name_rollout_tp_conflicting_with_tp_degree_is_refused_whatever_the_values(tmp_path, capsys):
    """tp_degree unset is told from tp_degree 1 given: `tp = 2` with `tp_degree = 1` (a recipe, --set or the flags) is
    an error naming both, no longer tp 2 silently; tp alone still works with a one-line notice, and equal values too."""
    with pytest.raises(ConfigError, match=r"^tp: is the old name of tp_degree: give one of them \(both given, with "
                       r"different values: tp 2, tp_degree 1\)"):  # fmt: skip
        RolloutConfig(engine="vllm", tp=2, tp_degree=1)
    assert RolloutConfig().tp_degree == 1 and RolloutConfig(engine="vllm", tp_degree=1).tp_degree == 1
    assert RolloutConfig(engine="vllm", tp=2).tp_degree == 2
    assert RolloutConfig(engine="vllm", tp=2, tp_degree=2).tp_degree == 2
    assert capsys.readouterr().err.count("rollout.tp (--tp) is now rollout.tp_degree (--tp-degree)") == 2
    recipe = tmp_path / "r.toml"
    recipe.write_text('[model]\npath = "m"\n[data]\nprompts = "p"\n[rollout]\nengine = "vllm"\ntp = 2\n')
    assert load_recipe(recipe).rollout.tp_degree == 2
    both = tmp_path / "both.toml"
    both.write_text(recipe.read_text() + "tp_degree = 1\n")
    with pytest.raises(UserError, match=r"both\.toml: rollout\.tp: .*tp 2, tp_degree 1\)"):
        load_recipe(both)
    with pytest.raises(UserError) as e:  # each value named where it came from, not both blamed on the recipe
        load_recipe(recipe, ["rollout.tp_degree=1"])
    assert str(e.value) == (
        f"{recipe} (rollout.tp) and --set (rollout.tp_degree): rollout.tp: is the old name of tp_degree: give one of "
        "them (both given, with different values: tp 2, tp_degree 1)"
    )
    degree = tmp_path / "degree.toml"
    degree.write_text(recipe.read_text().replace("tp = 2", "tp_degree = 1"))
    with pytest.raises(UserError) as e:
        load_recipe(degree, ["rollout.tp=2"])
    assert str(e.value).startswith(f"--set (rollout.tp) and {degree} (rollout.tp_degree): rollout.tp: ")
    with pytest.raises(UserError, match=r"^--set: rollout\.tp: .*tp 2, tp_degree 1\)"):  # both from --set: one place
        load_recipe(degree, ["rollout.tp=2", "rollout.tp_degree=1"])
    resumed = from_dict(PPOConfig, to_dict(load_recipe(recipe)))  # a run folder's recipe.json: tp cleared, 2 kept
    assert (resumed.rollout.tp, resumed.rollout.tp_degree) == (0, 2)
    from tests.conftest import cli

    flags = cli("rollout", "--model", "m", "--prompts", "p.jsonl", "--out", tmp_path / "o.jsonl", "--engine", "vllm",
                "--tp", "2", "--tp-degree", "1")  # fmt: skip
    assert flags.exit_code == 1 and "--tp: is the old name of tp_degree" in flags.stderr
    assert "tp 2, tp_degree 1" in flags.stderr
    ppo = cli("ppo", recipe, "--out", tmp_path / "run", "--set", "rollout.tp_degree=1")
    assert ppo.exit_code == 1 and f"rlx ppo: error: {recipe} (rollout.tp) and --set (rollout.tp_degree): " in ppo.stderr
    assert not (tmp_path / "run").exists()


def test_every_config_field_has_a_docstring():
    from rlx.ppo.config import DataConfig, ModelConfig
    from rlx.scoring.config import ScoreConfig
    from rlx.training.config import TrainConfig

    for cls in (PPOConfig, ModelConfig, DataConfig, RolloutConfig, ScoreConfig, TrainConfig):
        import dataclasses

        missing = [f.name for f in dataclasses.fields(cls) if f.name not in field_docs(cls)]
        assert not missing, f"{cls.__name__}: {missing}"


def test_the_fast_path_is_the_default_on_cuda_and_only_fills_what_the_recipe_leaves_out(tmp_path):
    """A pure function of the device type: on CUDA the native engine, packing, token budgets and compile; the
    recipe's own keys win; the CPU keeps the simple path; megatron gets no compile; a critic trains alike."""
    from rlx.ppo.config import load_recipe
    from rlx.ppo.defaults import fast_path_defaults

    recipe = REPO / "recipes" / "quickstart.toml"
    cpu, cuda = load_recipe(recipe, [], "cpu"), load_recipe(recipe, [], "cuda")
    assert cpu == load_recipe(recipe, [])
    assert (cuda.rollout.engine, cuda.train.use_packing, cuda.train.compile) == ("native", True, True)
    assert cuda.train.max_tokens_per_micro_batch == 32768 and cuda.score.use_packing
    mine = load_recipe(recipe, ['rollout.engine="hf"', "train.compile=false"], "cuda")
    assert (mine.rollout.engine, mine.train.compile, mine.train.use_packing) == ("hf", False, True)
    assert "train.compile" not in fast_path_defaults("cuda", {"megatron": {"tp_degree": 2}})
    chosen = fast_path_defaults("cuda", {"critic": {}, "train": {"use_packing": False}})
    assert chosen["critic.train.use_packing"] is True and "train.use_packing" not in chosen
    assert fast_path_defaults("cpu", {}) == fast_path_defaults("npu", {}) == {}


def test_the_fast_path_token_budget_shrinks_for_larger_models():
    """32,768 tokens per micro-batch for the 0.5B shape and smaller; a Qwen2-VL-2B-shaped model (its text config
    nested) gets fewer, read from its config.json (at 32,768 its train step ran out of an H100's memory)."""
    from rlx.ppo.config import load_recipe
    from rlx.ppo.defaults import micro_batch_token_budget

    qwen05 = {"num_hidden_layers": 24, "hidden_size": 896, "intermediate_size": 4864}
    assert micro_batch_token_budget(qwen05) == micro_batch_token_budget(None) == 32768
    assert micro_batch_token_budget({"num_hidden_layers": 2, "hidden_size": 64}) == 32768
    qwen15 = {"num_hidden_layers": 28, "hidden_size": 1536, "intermediate_size": 8960}
    assert micro_batch_token_budget(qwen15) == micro_batch_token_budget({"text_config": qwen15}) == 15360
    assert micro_batch_token_budget({"num_hidden_layers": 80, "hidden_size": 8192, "intermediate_size": 29568}) == 2048
    vl = load_recipe(REPO / "recipes" / "qwen2_vl_2b_shapes.toml", [], "cuda")
    assert vl.score.max_tokens_per_micro_batch == 15360  # the fast path's, from its config.json
    assert vl.train.max_tokens_per_micro_batch == 8192  # the recipe's own key wins (15,360 ran out of an H100)
    mine = load_recipe(REPO / "recipes" / "qwen2_vl_2b_shapes.toml", ["train.max_tokens_per_micro_batch=4096"], "cuda")
    assert mine.train.max_tokens_per_micro_batch == 4096


def test_async_recipes_correct_stale_samples_unless_the_recipe_says_otherwise():
    from rlx.ppo.config import load_recipe

    recipe = REPO / "recipes" / "quickstart.toml"
    assert load_recipe(recipe, ["async.max_staleness=1"], "cpu").train.correction.rollout_is == "token"
    assert load_recipe(recipe, ["async.rollout_ranks=1"], "cpu").train.correction.rollout_is == "token"  # staleness 1
    assert load_recipe(recipe, ["async.max_staleness=0"], "cpu").train.correction.rollout_is == "none"  # synchronous
    mine = load_recipe(recipe, ["async.max_staleness=2", 'train.correction.rollout_is="none"'], "cpu")
    assert mine.train.correction.rollout_is == "none"
    assert load_recipe(recipe, [], "cpu").train.correction.rollout_is == "none"


def test_compile_caches_live_under_rlx_cache(tmp_path, monkeypatch):
    from rlx.utils.cache import configure_compile_caches

    monkeypatch.setenv("RLX_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/mine")
    configure_compile_caches()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "compile" / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == "/mine"  # a user's own setting wins


def test_pinned_memory_is_registered_unless_the_user_set_the_allocator(monkeypatch):
    """Process-wide, before torch starts: host pinning by registration on 8 threads; a user's allocator
    configuration (either variable) is left alone."""
    from rlx.utils.allocator import PINNED_REGISTER, configure_pinned_memory

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    configure_pinned_memory()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == PINNED_REGISTER
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    configure_pinned_memory()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    configure_pinned_memory()
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run with RLX_TEST_GPU=1)")
def test_reserved_host_buffers_are_the_ones_the_first_snapshot_copies_into():
    """`reserve` pins a snapshot's host buffers ahead (the loop does it on its writer thread after the first step), so
    the first checkpoint's snapshot pins nothing itself; the copies hold the values, and updates after it do not."""
    from rlx.utils import host_copy

    tensors = {"w": torch.randn(64, 32, device="cuda"), "m": torch.randn(7, device="cuda", dtype=torch.bfloat16)}
    pinned = host_copy.reserve(host_copy.layout(tensors), "test_reserve")
    assert pinned == 64 * 32 * 4 + 7 * 2 and host_copy.reserve(host_copy.layout(tensors), "test_reserve") == 0
    buffers = {k: host_copy._BUFFERS[f"test_reserve/{k}"] for k in tensors}
    assert all(b.is_pinned() for b in buffers.values())
    expected = {key: value.cpu() for key, value in tensors.items()}
    copies = host_copy.snapshot(tensors, "test_reserve")
    host_copy.before_update()
    for value in tensors.values():
        value.add_(1)
    host_copy.wait_copied()
    for key in tensors:
        assert copies[key] is buffers[key] and torch.equal(copies[key], expected[key])


def test_the_fast_path_leaves_compile_off_for_a_mixture_of_experts_model():
    """The MoE quickstart's model (routed experts in config.json) gets the native engine and packing on CUDA, not
    train.compile; a dense model's recipe still gets it."""
    from rlx.ppo.config import load_recipe

    moe = load_recipe(REPO / "recipes" / "moe_quickstart.toml", [], "cuda")
    assert (moe.rollout.engine, moe.train.use_packing, moe.train.compile) == ("native", True, False)
    assert load_recipe(REPO / "recipes" / "quickstart.toml", [], "cuda").train.compile
