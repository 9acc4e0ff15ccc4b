"""A stage resolves each model path to a source and reads its config once, at its boundary, and passes both down:
`rlx merge` and `rlx score` counted on a tiny checkpoint (every rlx module's reference to the two functions wrapped)."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

import rlx.models.loading as loading
from tests.conftest import cli_ok, rollout_args


@pytest.fixture
def counted(monkeypatch) -> dict[str, Counter]:
    """Calls of resolve_source (by path) and load_config (by source path) from anywhere in rlx."""
    import rlx.stages.score
    import rlx.stages.shard  # noqa: F401 - loaded so that their imported names are wrapped too

    calls = {"resolve_source": Counter(), "load_config": Counter()}

    def wrap(name: str, key):
        original = getattr(loading, name)

        def counting(*args, **kwargs):
            calls[name][key(args[0])] += 1
            return original(*args, **kwargs)

        for module in list(sys.modules.values()):
            if getattr(module, "__name__", "").startswith("rlx") and getattr(module, name, None) is original:
                monkeypatch.setattr(module, name, counting)

    wrap("resolve_source", lambda path: Path(path).resolve())
    wrap("load_config", lambda source: source.path.resolve())
    return calls


@pytest.fixture(scope="module")
def megatron_ckpt(tiny_dir, tmp_path_factory) -> Path:
    """The tiny model in the 'megatron' layout (its readers need the config: the layout that used to re-read it)."""
    out = tmp_path_factory.mktemp("resolve") / "megatron"
    cli_ok("shard", "--model", tiny_dir, "--init", "random", "--layout", "megatron", "--out", out)
    return out


def test_merge_resolves_its_checkpoint_once(counted, megatron_ckpt, tmp_path):
    cli_ok("merge", "--checkpoint", megatron_ckpt, "--out", tmp_path / "hf")
    assert (tmp_path / "hf" / "config.json").is_file()
    assert counted["resolve_source"] == {megatron_ckpt.resolve(): 1}
    assert counted["load_config"] == {megatron_ckpt.resolve(): 1}


def test_score_resolves_each_model_once(counted, megatron_ckpt, tiny_ckpt, prompts_file, tmp_path):
    rollouts = tmp_path / "r.jsonl"
    cli_ok(*rollout_args(megatron_ckpt, prompts_file, rollouts))
    assert counted["resolve_source"] == {megatron_ckpt.resolve(): 1}
    assert counted["load_config"] == {megatron_ckpt.resolve(): 1}
    for calls in counted.values():
        calls.clear()
    # the actor doubles as the reference: one path, resolved once; the critic is another path
    critic = tmp_path / "critic"
    cli_ok("shard", "--model", tiny_ckpt, "--role", "critic", "--out", critic)
    for calls in counted.values():
        calls.clear()
    cli_ok("score", "--rollouts", rollouts, "--out", tmp_path / "s", "--actor", megatron_ckpt, "--ref", megatron_ckpt,
           "--critic", critic, "--estimator", "gae", "--reward", "arith")  # fmt: skip
    assert (tmp_path / "s" / "batch.safetensors").is_file()
    expected = {megatron_ckpt.resolve(): 1, critic.resolve(): 1}
    assert counted["resolve_source"] == expected
    assert counted["load_config"] == expected
