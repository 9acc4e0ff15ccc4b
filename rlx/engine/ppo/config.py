"""The recipe: `rlx ppo recipe.toml` maps the TOML file 1:1 onto `PPOConfig` (no torch import)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rlx.config import ConfigError, apply_overrides, check, check_choices, from_dict, load_toml
from rlx.engine.rollout.config import RolloutConfig
from rlx.engine.scoring.config import ScoreConfig
from rlx.engine.training.config import TrainConfig
from rlx.errors import UserError


@dataclass(kw_only=True)
class ModelConfig:
    """The policy to train; the reference model is the same weights, frozen."""

    path: str
    """HF model dir, rlx checkpoint dir, .gguf file (or pkg:PACKAGE/file.gguf); for init = 'random', a dir
    with config.json and a tokenizer."""
    init: Literal["pretrained", "random"] = "pretrained"
    """'pretrained' loads the weights; 'random' initialises from config.json with the run's seed."""

    def __post_init__(self) -> None:
        check_choices(self)


@dataclass(kw_only=True)
class DataConfig:
    """Where prompts come from and how many each step uses."""

    prompts: str
    """prompts.jsonl (relative paths are resolved against the recipe's folder)."""
    prompts_per_step: int = 8
    """Prompts per step; each gets rollout.n responses."""
    shuffle: bool = False
    """Visit prompts in a new seeded order every epoch (else file order)."""

    def __post_init__(self) -> None:
        check(self.prompts_per_step >= 1, "prompts_per_step", f"must be at least 1, got {self.prompts_per_step}")


@dataclass(kw_only=True)
class PPOConfig:
    """A whole run: model, data, and the settings of each stage."""

    seed: int = 0
    """Run seed: random init, step k's rollout seed (seed + k), data order and train seed all derive from it."""
    steps: int = 10
    """Number of rollout -> score -> train-step iterations."""
    use_ref: bool = True
    """Keep a frozen copy of the initial policy as reference (KL metrics, score.kl_coef, train.kl_loss_coef)."""
    save_every: int = 1
    """Write a checkpoint every this many steps (and always after the last step)."""
    keep_checkpoints: int = 2
    """Keep only the newest this-many checkpoints (0 keeps all)."""
    keep_artifacts: bool = True
    """Keep each step's rollouts.jsonl, scores.jsonl and batch.safetensors in the run dir."""
    model: ModelConfig
    """The policy."""
    data: DataConfig
    """The prompts."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling settings (as `rlx rollout`)."""
    score: ScoreConfig = field(default_factory=ScoreConfig)
    """Reward and advantage settings (as `rlx score`)."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Update settings (as `rlx train-step`)."""

    def __post_init__(self) -> None:
        check(self.steps >= 1, "steps", f"must be at least 1, got {self.steps}")
        check(self.save_every >= 1, "save_every", f"must be at least 1, got {self.save_every}")
        check(self.keep_checkpoints >= 0, "keep_checkpoints", f"must be >= 0, got {self.keep_checkpoints}")
        check(self.rollout.seed == 0, "rollout.seed", "set the top-level 'seed' instead (step k samples with seed + k)")
        check(self.train.seed == 0, "train.seed", "set the top-level 'seed' instead")
        needs_ref = self.score.kl_coef > 0 or self.train.kl_loss_coef > 0
        check(self.use_ref or not needs_ref, "use_ref", "score.kl_coef or train.kl_loss_coef > 0 needs use_ref = true")


def load_recipe(path: str | Path, overrides: list[str] = ()) -> PPOConfig:
    """Read a recipe, apply `--set` overrides, resolve relative data/model paths against the recipe."""
    path = Path(path)
    data = load_toml(path)
    original = {"model": dict(data.get("model", {})), "data": dict(data.get("data", {}))}
    data = apply_overrides(data, list(overrides))
    for section, key in (("model", "path"), ("data", "prompts")):
        value = data.get(section, {}).get(key) if isinstance(data.get(section), dict) else None
        from_recipe = value is not None and original.get(section, {}).get(key) == value
        if isinstance(value, str) and from_recipe and not Path(value).is_absolute() and ":" not in value:
            data[section][key] = str((path.parent / value).resolve())
    try:
        return from_dict(PPOConfig, data)
    except ConfigError as e:
        raise UserError(f"{path}: {e}") from None
