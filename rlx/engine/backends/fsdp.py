"""The FSDP backend: Hugging Face modules, FSDP2-sharded under a launcher (a plain module in a lone process), with
Ulysses sequence parallelism; the trainers of rlx/engine/training."""

from __future__ import annotations

import torch

from rlx.engine.backends.base import Degrees, TrainingBackend
from rlx.engine.checkpoints.loading import load_model
from rlx.engine.checkpoints.registry import read_full_optimizer
from rlx.engine.logprobs import ModuleScorer
from rlx.engine.parallel.dist import setup
from rlx.engine.training.actor import ActorTrainer
from rlx.engine.training.config import TrainConfig
from rlx.engine.training.critic import CriticTrainer
from rlx.errors import UserError
from rlx.models.loading import ModelSource
from rlx.utils.device import resolve_precision


class FSDPBackend(TrainingBackend):
    name = "fsdp"

    @classmethod
    def setup(cls, device: str, degrees: Degrees) -> FSDPBackend:
        if degrees.tp_degree != 1 or degrees.pp_degree != 1:
            raise UserError("tensor and pipeline parallelism need the megatron backend ([megatron] in a recipe)")
        return cls(setup(device, degrees.sp_degree))

    def build_trainer(self, model: torch.nn.Module, cfg: TrainConfig, where: str = "", optimizer_state=None):
        trainer_cls = CriticTrainer if cfg.role == "critic" else ActorTrainer
        device = self.ctx.device
        trainer = trainer_cls(model, cfg, device, resolve_precision(cfg.precision, device), self.ctx)
        trainer.load_optimizer_state(optimizer_state, where)
        return trainer

    def load_trainer(self, cfg: TrainConfig, source: ModelSource):
        model = load_model(source, cfg.role)
        return self.build_trainer(model, cfg, str(source.path), read_full_optimizer(source.path))

    def build_reference(self, model: torch.nn.Module) -> ModuleScorer:
        return ModuleScorer(model.requires_grad_(False).to(self.ctx.device).eval(), self.ctx)

    def load_scoring_model(self, source: ModelSource, role: str) -> ModuleScorer:
        return ModuleScorer(load_model(source, role).to(self.ctx.device), self.ctx)
