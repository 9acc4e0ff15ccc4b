"""The training-backend interface: how the actor, critic and reference are built, trained, scored, saved and
handed to the rollout engine, whatever holds them (FSDP2 over Hugging Face modules, megatron-core stages).

    backend = backend_class(name).setup(device, Degrees(...))       # process groups for its grid
    trainer = backend.build_trainer(model, train_cfg)               # or backend.load_trainer(cfg, checkpoint)
    trainer.train_step(batch, step)                                 # one PPO update
    backend.scorer(trainer).logprobs(...)                           # old logprobs / values from the trained model
    checkpoints.save(out, trainer.state(), aux, meta)               # its view a checkpoints TrainedState
    engine.update_weights(trainer.weights())                        # its view a rollout WeightSource

Stage runners and the `rlx ppo` loop only use these calls, so they never branch on a backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from rlx.checkpoints.base import LocalState
from rlx.errors import UserError
from rlx.formats.batch import TrainBatch
from rlx.models.loading import ModelSource
from rlx.scoring.score import Scorer
from rlx.training.config import TrainConfig
from rlx.training.views import TrainerState, TrainerWeights


@dataclass(frozen=True)
class Degrees:
    """The parallel grid a backend sets up (data parallel takes the remaining processes)."""

    sp_degree: int = 1
    """Ulysses sequence parallel (FSDP backend)."""
    tp_degree: int = 1
    """Tensor parallel (megatron backend)."""
    pp_degree: int = 1
    """Pipeline parallel (megatron backend)."""
    ep_degree: int = 1
    """Expert parallel (megatron backend: megatron-core's expert_model_parallel_size; the FSDP backend reads
    train.ep_degree from the trainer's config)."""


class Trainer(Protocol):
    """A trained model (actor or critic) and its optimizer, as every caller sees it."""

    role: str
    config: object
    """The model's Hugging Face config."""
    module: torch.nn.Module | None
    """A live Hugging Face module a rollout engine may generate with directly (None: weights must be copied)."""
    is_main: bool
    world: int
    lora: object | None
    """With LoRA, the adapters' settings and base (a LoraSpec; backends with `supports_lora`); else None."""

    def weights(self) -> TrainerWeights:
        """What a rollout engine's weight sync reads (a rollout WeightSource)."""

    def state(self) -> TrainerState:
        """What checkpoint layouts save and restore (a checkpoints TrainedState)."""

    def check_batch(self, batch: TrainBatch, where: str) -> None: ...
    def train_step(self, batch: TrainBatch, step: int) -> dict[str, float]: ...
    def optimizer_meta(self) -> dict: ...
    def full_weights(self) -> dict[str, torch.Tensor]: ...
    def full_optimizer_state(self) -> dict[str, torch.Tensor] | None: ...
    def local_state(self) -> LocalState: ...
    def named_weights(self, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]: ...
    def adapter_state(self) -> dict[str, torch.Tensor] | None:
        """With LoRA, the adapters by stable name on every rank (a collective); else None."""


class TrainingBackend(ABC):
    """Builds trainers and scoring models on one parallel grid. Subclasses register in registry.py."""

    name: ClassVar[str]
    supports_lora: ClassVar[bool] = False
    """Whether `build_trainer` takes `lora=` (a LoraSpec: adapters to put on the model) and `load_trainer` takes
    `lora=` (a LoraConfig) and LoRA checkpoints; callers pass it through `lora_options`, so a backend without
    LoRA never sees the keyword and a request for it is a clear error."""

    def __init__(self, ctx):
        self.ctx = ctx
        """The process's distributed context (devices, ranks, the backend's groups)."""

    @classmethod
    @abstractmethod
    def setup(cls, device: str, degrees: Degrees) -> TrainingBackend:
        """Set up the process groups for `degrees` on `device` ('auto', 'cpu', 'cuda', 'npu')."""

    @classmethod
    def unavailable(cls, degrees: Degrees, world: int) -> str | None:
        """Why this backend cannot run here with `degrees` over `world` processes (None: it can)."""
        return None

    def lora_options(self, lora: object | None, where: str) -> dict:
        """The `lora=` keyword for build_trainer / load_trainer ({} without LoRA); a UserError naming `where` when
        this backend cannot train adapters."""
        if lora is None:
            return {}
        if not self.supports_lora:
            raise UserError(f"{where}: LoRA is not supported by the {self.name} training backend (use fsdp)")
        return {"lora": lora}

    @abstractmethod
    def build_trainer(self, model: torch.nn.Module, cfg: TrainConfig, where: str) -> Trainer:
        """A trainer (actor or critic, by `cfg.role`) starting from a Hugging Face model's weights, fresh optimizer."""

    @abstractmethod
    def load_trainer(self, cfg: TrainConfig, source: ModelSource, config) -> Trainer:
        """A trainer continuing from a checkpoint (weights and optimizer state) or a Hugging Face dir; `config`: the
        source's transformers config, read once by the caller (`resolve_model`)."""

    @abstractmethod
    def scorer(self, trainer: Trainer) -> Scorer:
        """The trainer's model as scoring uses it (old logprobs or values), no copy."""

    def base_reference(self, trainer: Trainer) -> Scorer | None:
        """The reference policy inside the trainer's own model (its frozen base with the LoRA adapters off), or None
        when the trainer trains every weight (the reference is then a copy: `build_reference`)."""
        return None

    @abstractmethod
    def build_reference(self, model: torch.nn.Module) -> Scorer:
        """A frozen copy of `model` (the initial policy) for reference logprobs."""

    @abstractmethod
    def load_scoring_model(self, source: ModelSource, role: str, config) -> Scorer:
        """A model of `source` for scoring only (role 'actor': logprobs, 'critic': values); `config` as for
        `load_trainer`."""
