"""The FSDP backend: Hugging Face modules, FSDP2-sharded under a launcher (a plain module in a lone process), with
Ulysses sequence parallelism; the trainers of rlx/training. It trains LoRA adapters too: on a model given
with a LoraSpec, or from a LoRA checkpoint (the base frozen in the compute dtype, adapters float32), and scores a LoRA
checkpoint with its adapters in (so the reference can be the same module with them off)."""

from __future__ import annotations

import torch

from rlx.backends.base import Degrees, TrainingBackend
from rlx.checkpoints.loading import load_model, unfilled_model
from rlx.checkpoints.lora_base import LoraSpec, check_same_config, lora_spec
from rlx.checkpoints.registry import read_full_optimizer, read_lora, read_shards, reads_shards
from rlx.errors import UserError
from rlx.logprobs import ModuleScorer
from rlx.models.loading import ModelSource
from rlx.models.lora_config import LoraConfig
from rlx.parallel.dist import setup
from rlx.training.actor import ActorTrainer
from rlx.training.config import TrainConfig
from rlx.training.critic import CriticTrainer
from rlx.training.reference import BaseModelScorer
from rlx.utils.device import resolve_precision


class FSDPBackend(TrainingBackend):
    name = "fsdp"
    supports_lora = True

    @classmethod
    def setup(cls, device: str, degrees: Degrees) -> FSDPBackend:
        if degrees.tp_degree != 1 or degrees.pp_degree != 1:
            raise UserError("tensor and pipeline parallelism need the megatron backend ([megatron] in a recipe)")
        return cls(setup(device, degrees.sp_degree))

    def build_trainer(self, model: torch.nn.Module, cfg: TrainConfig, where: str = "", optimizer_state=None,
                      lora: LoraSpec | None = None):  # fmt: skip
        """`lora`: train adapters on `model` as a frozen base (put in now unless the model has them already)."""
        trainer_cls = CriticTrainer if cfg.role == "critic" else ActorTrainer
        device = self.ctx.device
        trainer = trainer_cls(model, cfg, device, resolve_precision(cfg.precision, device), self.ctx, lora=lora)
        trainer.state().load_optimizer_state(optimizer_state, where)
        return trainer

    def load_trainer(self, cfg: TrainConfig, source: ModelSource, config, lora: LoraConfig | None = None):
        """A LoRA checkpoint continues its adapters (`lora`, when given, must agree with them); `lora` on a
        checkpoint of full weights puts fresh adapters on it, its weights becoming the frozen base."""
        where = str(source.path)
        adapters = None if source.is_gguf else read_lora(source.path)
        if adapters is not None:
            check_same_config(lora, adapters.spec.config, where)
            model = adapters.build_model(resolve_precision(cfg.precision, self.ctx.device))
            return self.build_trainer(model, cfg, where, adapters.optimizer(), lora=adapters.spec)
        if lora is None and self.ctx.world > 1 and cfg.ep_degree == 1 and reads_shards(source.path):
            return self._trainer_from_shards(cfg, source, config)
        model = load_model(source, cfg.role, config=config)
        if lora is not None:  # the full checkpoint's optimizer state belongs to its full weights: not carried over
            spec = lora_spec(lora, source.path, "pretrained", cfg.seed, model, cfg.role)
            return self.build_trainer(model, cfg, where, lora=spec)
        return self.build_trainer(model, cfg, where, read_full_optimizer(source.path))

    def _trainer_from_shards(self, cfg: TrainConfig, source: ModelSource, config):
        """Under a launcher, from a checkpoint of shards ('fsdp', what `rlx ppo` writes there): the model is built
        unfilled and sharded, then every rank reads its own shards of the weights and AdamW state into it. Reading the
        whole checkpoint on every rank, a 7B run resuming on four H200 held 365 GB on the host and spent ~280 s
        loading (2026-11-29)."""
        trainer = self.build_trainer(unfilled_model(source, cfg.role, config), cfg, str(source.path))
        state = trainer.state()
        read_shards(source.path, "model", state.model_shards)
        read_shards(source.path, "optim", state.optimizer_shards)
        return trainer

    def scorer(self, trainer) -> ModuleScorer:
        return ModuleScorer(trainer.model, self.ctx, keep_gathered=trainer.cfg.keep_gathered)

    def base_reference(self, trainer) -> BaseModelScorer | None:
        """With adapters, the trainer's module with them off: the reference policy without a second copy."""
        return BaseModelScorer(trainer.model, self.ctx) if trainer.lora is not None else None

    def build_reference(self, model: torch.nn.Module) -> ModuleScorer:
        return ModuleScorer(model.requires_grad_(False).to(self.ctx.device).eval(), self.ctx)

    def load_scoring_model(self, source: ModelSource, role: str, config) -> ModuleScorer:
        """A LoRA checkpoint keeps its adapters as PEFT layers (the numbers of the trainer's module)."""
        return ModuleScorer(load_model(source, role, adapters=True, config=config).to(self.ctx.device), self.ctx)
