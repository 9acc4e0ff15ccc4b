"""The recipe: `rlx ppo recipe.toml` maps the TOML file 1:1 onto `PPOConfig` (no torch import)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rlx.config import ConfigError, apply_overrides, check, check_choices, from_dict, load_toml
from rlx.engine.evaluation import EvalConfig
from rlx.engine.ppo.defaults import apply_defaults, fast_path_defaults
from rlx.engine.rollout.config import RolloutConfig
from rlx.engine.scoring.config import ScoreConfig
from rlx.engine.sft.config import SFTConfig
from rlx.engine.tracking import TrackingConfig
from rlx.engine.training.config import TrainConfig
from rlx.errors import UserError
from rlx.models.lora_config import LoraConfig
from rlx.models.vision.config import VisionConfig


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
    """prompts.jsonl, or verl's .parquet (relative paths are resolved against the recipe's folder)."""
    prompts_per_step: int = 8
    """Prompts per step; each gets rollout.n responses."""
    shuffle: bool = False
    """Visit prompts in a new seeded order every epoch (else file order)."""
    max_gen_batches: int = 1
    """With score.filter_groups (DAPO dynamic sampling): sample up to this many batches of prompts_per_step
    prompts per step to collect prompts_per_step informative groups (0 = until filled)."""

    def __post_init__(self) -> None:
        check(self.prompts_per_step >= 1, "prompts_per_step", f"must be at least 1, got {self.prompts_per_step}")
        check(self.max_gen_batches >= 0, "max_gen_batches", f"must be >= 0, got {self.max_gen_batches}")


@dataclass(kw_only=True)
class CriticConfig:
    """The value model for GAE: trained alongside the actor on the same batches."""

    path: str | None = None
    """A value model dir or checkpoint; unset = built from the policy's weights with a new head (run seed)."""
    warmup_steps: int = 0
    """Train only the critic for this many steps before the actor starts updating (verl's critic_warmup)."""
    train: TrainConfig = field(default_factory=lambda: TrainConfig(role="critic"))
    """Critic update settings, as [train] (the role is always 'critic': clipped value loss)."""
    lora: LoraConfig | None = None
    """Train the critic as LoRA adapters (and its value head) on its frozen backbone; absent = in full."""

    def __post_init__(self) -> None:
        if self.train.role != "critic":
            self.train = dataclasses.replace(self.train, role="critic")
        check(self.warmup_steps >= 0, "warmup_steps", f"must be >= 0, got {self.warmup_steps}")


@dataclass(kw_only=True)
class MegatronConfig:
    """Train the actor (and critic) on megatron-core stages instead of FSDP: tensor x pipeline parallel per
    model replica, data parallel over the remaining processes (needs megatron-core: pip install 'rlx[megatron]')."""

    tp_degree: int = 1
    """Tensor-parallel degree (divides the attention heads, key/value heads and MLP width)."""
    pp_degree: int = 1
    """Pipeline-parallel degree (divides the layers)."""

    def __post_init__(self) -> None:
        check(self.tp_degree >= 1, "tp_degree", f"must be at least 1, got {self.tp_degree}")
        check(self.pp_degree >= 1, "pp_degree", f"must be at least 1, got {self.pp_degree}")


@dataclass(kw_only=True)
class PPOConfig:
    """A whole run: model, data, and the settings of each stage."""

    seed: int = 0
    """Run seed: random init, step k's rollout seed (seed + k), data order and train seed all derive from it."""
    backend: str = "auto"
    """Training backend: 'fsdp' (Hugging Face modules, FSDP2 under a launcher), 'megatron' (megatron-core stages,
    degrees in [megatron]) or another registered one; 'auto' is 'megatron' with a [megatron] table, else 'fsdp'."""
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
    background_writes: bool = True
    """Write each step's artifacts and checkpoint files in a background thread while the next step runs (the
    weights are gathered first; a kill during a write resumes from the last complete checkpoint)."""
    model: ModelConfig
    """The policy."""
    sft: SFTConfig | None = None
    """A warm start: on a fresh run, supervised fine-tuning of the policy on demonstrations before step 1; the result
    is the run's step-0 checkpoint (checkpoints/step_000000), the initial policy and the reference."""
    data: DataConfig
    """The prompts."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling settings (as `rlx rollout`)."""
    score: ScoreConfig = field(default_factory=ScoreConfig)
    """Reward and advantage settings (as `rlx score`)."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Update settings (as `rlx train-step`)."""
    lora: LoraConfig | None = None
    """Train the actor as LoRA adapters on the frozen policy (the reference is the policy with them off); absent =
    full fine-tuning."""
    critic: CriticConfig | None = None
    """A critic (needed by score.estimator = 'gae')."""
    megatron: MegatronConfig | None = None
    """With this table, the actor and critic train on megatron-core (checkpoints in the 'megatron' layout)."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """Where metrics go besides metrics.jsonl (console, tensorboard, wandb, mlflow) and rollout traces."""
    eval: EvalConfig | None = None
    """Held-out evaluation during training: val/* metrics in the step's metrics line, step_NNNNNN/eval.jsonl."""
    vision: VisionConfig = field(default_factory=VisionConfig)
    """Vision-language models: image sizes and prompt limit of every stage, pixels in the batch files, whether the
    vision tower trains."""

    def __post_init__(self) -> None:
        check(self.steps >= 1, "steps", f"must be at least 1, got {self.steps}")
        check(self.save_every >= 1, "save_every", f"must be at least 1, got {self.save_every}")
        check(self.keep_checkpoints >= 0, "keep_checkpoints", f"must be >= 0, got {self.keep_checkpoints}")
        check(self.rollout.seed == 0, "rollout.seed", "set the top-level 'seed' instead (step k samples with seed + k)")
        check(self.train.seed == 0, "train.seed", "set the top-level 'seed' instead")
        check(self.sft is None or bool(self.sft.data), "sft.data", "the demonstrations file is required")
        check(self.sft is None or self.sft.seed == 0, "sft.seed", "set the top-level 'seed' instead")
        check(self.train.role == "actor", "train.role", "must be 'actor' (the critic trains from [critic.train])")
        check(
            self.critic is not None or self.score.estimator != "gae", "critic", "estimator 'gae' needs a [critic] table"
        )
        check(self.critic is None or self.critic.train.seed == 0, "critic.train.seed", "set the top-level 'seed'")
        check(
            self.critic is None or self.critic.train.sp_degree == self.train.sp_degree,
            "critic.train.sp_degree",
            f"must equal train.sp_degree ({self.train.sp_degree}): the processes form one grid",
        )
        check(
            self.rollout.engine != "vllm" or self.rollout.weight_sync != "disk" or self.save_every == 1,
            "save_every",
            "must be 1 with rollout.weight_sync = 'disk' (the engine reloads each step's checkpoint)",
        )
        check(
            self.megatron is None or self.train.sp_degree == 1,
            "train.sp_degree",
            "must be 1 with [megatron] (tensor parallelism splits the model instead)",
        )
        check(
            self.megatron is None or self.rollout.weight_sync != "disk",
            "rollout.weight_sync",
            "must be 'memory' with [megatron] (the replica is synced from the stages in memory)",
        )
        check(
            self.megatron is None or self.backend in ("auto", "megatron"),
            "backend",
            f"a [megatron] table sets the megatron backend's degrees; backend {self.backend!r} does not use it",
        )
        for key, train in (("train", self.train), ("critic.train", self.critic.train if self.critic else None)):
            decays_over_run = train is not None and train.lr_schedule != "constant" and not train.lr_decay_steps
            check(
                not decays_over_run or self.steps > train.warmup_steps,
                f"{key}.lr_decay_steps",
                f"decay over the run's {self.steps} steps needs steps > warmup_steps (or set lr_decay_steps)",
            )
        self._share_vision()
        has_lora = self.lora is not None or (self.critic is not None and self.critic.lora is not None)
        check(
            not has_lora or self.backend_name != "megatron",
            "lora",
            "LoRA is not supported by the megatron backend (drop [megatron] or the [lora] tables)",
        )
        needs_ref = self.score.kl_coef > 0 or self.train.kl_loss_coef > 0
        check(self.use_ref or not needs_ref, "use_ref", "score.kl_coef or train.kl_loss_coef > 0 needs use_ref = true")

    def _share_vision(self) -> None:
        """Every stage reads the [vision] table (a stage's own `vision` table is the CLI's; in a recipe it must be
        left out, or equal [vision] as in a run dir's recipe.json)."""
        stages = {"rollout": self.rollout, "score": self.score, "train": self.train}
        if self.critic is not None:
            stages["critic.train"] = self.critic.train
        for key, stage in stages.items():
            check(stage.vision in (VisionConfig(), self.vision), f"{key}.vision", "set the [vision] table instead")
            stage.vision = self.vision

    @property
    def backend_name(self) -> str:
        """The training backend the run uses ('auto' resolved)."""
        if self.backend != "auto":
            return self.backend
        return "megatron" if self.megatron is not None else "fsdp"


def load_recipe(path: str | Path, overrides: list[str] = (), device_type: str | None = None) -> PPOConfig:
    """Read a recipe, apply `--set` overrides, resolve relative data/model paths against the recipe; with
    `device_type`, fill the keys the recipe leaves out with that device's fast path (rlx/engine/ppo/defaults.py)."""
    path = Path(path)
    data = load_toml(path)
    tables = ("model", "data", "eval", "sft")
    original = {name: dict(data[name]) for name in tables if isinstance(data.get(name), dict)}
    data = apply_overrides(data, list(overrides))
    if device_type is not None:
        data = apply_defaults(data, fast_path_defaults(device_type, data))
    for section, key in (("model", "path"), ("data", "prompts"), ("eval", "prompts"), ("sft", "data")):
        value = data.get(section, {}).get(key) if isinstance(data.get(section), dict) else None
        from_recipe = value is not None and original.get(section, {}).get(key) == value
        if isinstance(value, str) and from_recipe and not Path(value).is_absolute() and ":" not in value:
            data[section][key] = str((path.parent / value).resolve())
    try:
        return from_dict(PPOConfig, data)
    except ConfigError as e:
        raise UserError(f"{path}: {e}") from None
