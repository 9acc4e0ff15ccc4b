"""Compiling a run's graphs ahead (rlx/engine/ppo/precompile.py): which runs do it, the one-layer copy's recipe, a
failing child, and (slow) that a child's compilation on a small copy is what the run then finds in the cache."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlx.engine.ppo.config import CriticConfig, load_recipe
from rlx.engine.ppo.precompile import Precompile, marker, phases_for, small_copy_config, start_precompile
from rlx.models.lora_config import LoraConfig

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes" / "quickstart.toml"
COMPILED = ["train.compile=true", "train.use_packing=true", "score.use_packing=true"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RLX_CACHE", str(tmp_path / "cache"))
    for name in ("WORLD_SIZE", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):  # the children's caches: RLX_CACHE's
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "cache"


def test_which_runs_compile_ahead(cache, monkeypatch):
    cuda = load_recipe(QUICKSTART, [], "cuda")  # the fast path: native engine, compile
    assert phases_for(cuda, "cuda") == ("train",)
    assert phases_for(load_recipe(QUICKSTART, [], "cpu"), "cpu") == ()  # the CPU keeps the simple path
    assert phases_for(load_recipe(QUICKSTART, COMPILED, "cpu"), "cpu") == ()  # compile on the CPU: not worth it
    assert phases_for(load_recipe(QUICKSTART, ['rollout.engine="hf"'], "cuda"), "cuda") == ("train",)
    assert phases_for(load_recipe(QUICKSTART, ["train.compile=false"], "cuda"), "cuda") == ()
    assert phases_for(dataclasses.replace(cuda, lora=LoraConfig()), "cuda") == ()
    critic = dataclasses.replace(cuda, critic=CriticConfig(lora=LoraConfig()))
    assert phases_for(critic, "cuda") == ()
    monkeypatch.setenv("WORLD_SIZE", "2")  # under torchrun: every rank would start children
    assert phases_for(cuda, "cuda") == ()


def test_the_marker_names_the_setup(cache):
    cfg = load_recipe(QUICKSTART, [], "cuda")
    same = load_recipe(QUICKSTART, ["steps=3", "seed=5"], "cuda")  # what no graph depends on
    other = load_recipe(QUICKSTART, ["train.gradient_checkpointing=true"], "cuda")
    assert marker(cfg, "train") == marker(same, "train")
    assert marker(cfg, "train") != marker(other, "train") and marker(cfg, "train") != marker(cfg, "other")
    assert marker(cfg, "train").parent == cache / "precompile"
    assert start_precompile(load_recipe(QUICKSTART, [], "cpu"), "cpu") is None
    marker(cfg, "train").parent.mkdir(parents=True, exist_ok=True)
    marker(cfg, "train").write_text("done\n")
    assert start_precompile(cfg, "cuda") is None  # compiled ahead before: the caches are warm


def test_the_copy_has_the_policy_and_settings_with_fewer_layers(tmp_path):
    cfg = load_recipe(QUICKSTART, COMPILED + ["score.kl_coef=0.01"], "cpu")
    copy = small_copy_config(cfg, tmp_path / "model")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    policy = json.loads((Path(cfg.model.path) / "config.json").read_text())
    assert config["num_hidden_layers"] == min(3, policy["num_hidden_layers"])
    assert {k: v for k, v in config.items() if k != "num_hidden_layers"} == {
        k: v for k, v in policy.items() if k != "num_hidden_layers"
    }
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == sorted(
        p.name for p in Path(cfg.model.path).iterdir() if not p.name.endswith(".safetensors")
    )
    assert (copy.model.init, copy.sft, copy.eval, copy.critic) == ("random", None, None, None)
    assert (copy.train, copy.score.kl_coef, copy.rollout.engine) == (cfg.train, 0.01, cfg.rollout.engine)


def test_a_failing_child_is_reported_and_the_run_goes_on(cache, tmp_path, capsys):
    cfg = load_recipe(QUICKSTART, COMPILED, "cpu")
    ahead = Precompile(cfg, ("nonsense",))  # the child stops at its first step: no such phase
    ahead.wait("nonsense")
    assert "compiling the nonsense graphs ahead failed (exit 1" in capsys.readouterr().err
    assert not marker(cfg, "nonsense").exists()
    ahead.wait("train")  # no such child: nothing to wait for
    work = ahead.work
    ahead.close()
    assert not work.exists()


@pytest.mark.slow
def test_the_run_finds_what_a_one_layer_copy_compiled(cache, tmp_path):
    """The score and train graphs compiled by a child on a small copy of the policy (here the 2-layer policy itself,
    randomly initialised) are cache hits for the run: it compiles nothing itself (hits > 0, misses 0), although its
    rollout compiled the same layers first (on the CPU the hf engine generates with the trainer's module)."""
    sets = [*COMPILED, "steps=1"]
    cfg = load_recipe(QUICKSTART, sets, "cpu")
    ahead = Precompile(cfg, ("train",))
    ahead.wait("train")
    ahead.close()
    assert marker(cfg, "train").exists()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "TRITON_"))}
    env.update(RLX_CACHE=str(cache), OMP_NUM_THREADS="1")
    args = [a for s in sets for a in ("--set", s)]
    run = subprocess.run(
        [sys.executable, "-m", "rlx", "ppo", str(QUICKSTART), "--out", str(tmp_path / "run"), *args],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    for phase in ("score", "train"):
        assert metrics[f"compile/{phase}_graphs"] > 0
        assert metrics[f"compile/{phase}_cache_hits"] > 0
        assert metrics[f"compile/{phase}_cache_misses"] == 0, metrics
