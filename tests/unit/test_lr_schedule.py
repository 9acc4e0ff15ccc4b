"""Learning-rate schedules: warm-up, linear and cosine decay to a floor, by hand; constant unchanged bit for bit;
the decay length in `rlx ppo` (the run's steps) and in a hand-run train-step (must be given)."""

from __future__ import annotations

import math

import pytest

from rlx.config import ConfigError
from rlx.training.config import OptimConfig
from tests.conftest import REPO, cli_ok, read_jsonl


def old_lr_at(lr: float, warmup_steps: int, step: int) -> float:
    """The schedule before lr_schedule existed (constant after a linear warm-up)."""
    if warmup_steps > 0:
        return lr * min(1.0, (step + 1) / warmup_steps)
    return lr


@pytest.mark.parametrize("warmup", [0, 1, 3, 7])
def test_constant_is_the_old_schedule_bit_for_bit(warmup):
    cfg = OptimConfig(lr=3.7e-6, warmup_steps=warmup)
    for step in range(20):
        assert cfg.lr_at(step) == old_lr_at(3.7e-6, warmup, step)  # exact: same float operations
    ignored = OptimConfig(lr=3.7e-6, warmup_steps=warmup, lr_decay_steps=12, min_lr_ratio=0.5)
    assert [ignored.lr_at(s) for s in range(20)] == [cfg.lr_at(s) for s in range(20)]


def test_linear_by_hand():
    cfg = OptimConfig(lr=2e-3, warmup_steps=2, lr_schedule="linear", lr_decay_steps=10, min_lr_ratio=0.1)
    expected = {
        0: 1e-3,  # warm-up: (0 + 1) / 2
        1: 2e-3,
        2: 2e-3,  # decay starts at the full rate
        6: 2e-3 * (0.1 + 0.9 * 0.5),  # half-way through steps 2..10
        9: 2e-3 * (0.1 + 0.9 * 1 / 8),  # the last update before the floor
        10: 2e-4,  # the floor: lr * min_lr_ratio
        50: 2e-4,  # and it stays there
    }
    for step, lr in expected.items():
        assert cfg.lr_at(step) == pytest.approx(lr, rel=1e-12), step


def test_cosine_by_hand():
    cfg = OptimConfig(lr=1.0, lr_schedule="cosine", lr_decay_steps=8, min_lr_ratio=0.2)
    for step, progress in ((0, 0.0), (2, 0.25), (4, 0.5), (6, 0.75), (8, 1.0), (30, 1.0)):
        shape = (1 + math.cos(math.pi * progress)) / 2
        assert cfg.lr_at(step) == pytest.approx(0.2 + 0.8 * shape, rel=1e-12), step
    assert cfg.lr_at(4) == pytest.approx(0.6) and cfg.lr_at(8) == pytest.approx(0.2)
    no_floor = OptimConfig(lr=1.0, lr_schedule="cosine", lr_decay_steps=8)
    assert no_floor.lr_at(8) == pytest.approx(0.0, abs=1e-15) and no_floor.lr_at(7) > 0


def test_schedule_settings_are_checked():
    with pytest.raises(ConfigError, match="min_lr_ratio"):
        OptimConfig(min_lr_ratio=1.5)
    with pytest.raises(ConfigError, match="lr_decay_steps: must be larger than warmup_steps"):
        OptimConfig(lr_schedule="linear", warmup_steps=5, lr_decay_steps=5)
    with pytest.raises(ConfigError, match="lr_schedule"):
        OptimConfig(lr_schedule="step")
    with pytest.raises(ValueError, match="needs lr_decay_steps"):
        OptimConfig(lr_schedule="cosine").lr_at(0)  # no length: `rlx ppo` fills it, train-step refuses


def test_recipe_checks_the_run_is_longer_than_the_warm_up():
    from rlx.errors import UserError
    from rlx.ppo.config import load_recipe

    recipe = REPO / "recipes" / "quickstart.toml"
    with pytest.raises(
        UserError, match="train.optim.lr_decay_steps: decay over the run's 2 steps needs steps > warmup"
    ):
        load_recipe(recipe, ["steps=2", "train.optim.lr_schedule=cosine", "train.optim.warmup_steps=3"])
    cfg = load_recipe(
        recipe,
        ["steps=2", "train.optim.lr_schedule=cosine", "train.optim.warmup_steps=3", "train.optim.lr_decay_steps=9"],
    )
    assert cfg.train.with_decay_length(cfg.steps).optim.lr_decay_steps == 9  # given lengths are kept
    assert (
        load_recipe(recipe, ["train.optim.lr_schedule=linear"]).train.with_decay_length(150).optim.lr_decay_steps == 150
    )


def test_ppo_decays_over_the_run_steps(tmp_path):
    run = tmp_path / "run"
    sets = ["steps=4", "data.prompts_per_step=4", "rollout.sampling.n=2", "train.optim.lr_schedule=linear",
            "train.optim.warmup_steps=1", "train.optim.min_lr_ratio=0.25", "train.optim.lr=1e-3"]  # fmt: skip
    cli_ok("ppo", REPO / "recipes" / "quickstart.toml", "--out", run, *[a for s in sets for a in ("--set", s)])
    lrs = [line["actor/lr"] for line in read_jsonl(run / "metrics.jsonl")]
    # warm-up step 0, then linear from 1e-3 at step 1 to the floor at step 4 (= steps): progress 0, 1/3, 2/3
    expected = [1e-3, 1e-3, 1e-3 * (0.25 + 0.75 * 2 / 3), 1e-3 * (0.25 + 0.75 / 3)]
    assert lrs == pytest.approx(expected, rel=1e-9)
