"""The megatron backend: Llama-family models as megatron-core stages, tensor x pipeline parallel with data
parallel on top (rlx/backends/megatron: groups, schedule, trainers, scoring). Needs megatron-core.

Weights go to the rollout engine as full Hugging Face tensors gathered over the model-parallel group after each
update; the reference is frozen stages cut from the initial policy, so no rank keeps a whole reference model.
"""

from __future__ import annotations

import copy

import torch

from rlx.backends.base import Degrees, TrainingBackend
from rlx.backends.megatron.parallel import MegatronContext, setup_megatron
from rlx.backends.megatron.stage import MegatronScoringModel, load_stage
from rlx.backends.megatron.trainer import build_megatron_trainer
from rlx.checkpoints.registry import check_complete, read_local_state
from rlx.errors import UserError
from rlx.models.loading import ModelSource, tied_keys
from rlx.models.megatron.convert import hf_to_megatron_shard
from rlx.models.megatron.model import is_critic_config
from rlx.training.config import TrainConfig


class MegatronBackend(TrainingBackend):
    name = "megatron"
    ctx: MegatronContext

    @classmethod
    def setup(cls, device: str, degrees: Degrees) -> MegatronBackend:
        if degrees.sp_degree != 1:
            raise UserError(f"sp_degree {degrees.sp_degree}: the megatron backend uses tensor parallelism instead")
        return cls(setup_megatron(device, degrees.tp_degree, degrees.pp_degree, degrees.ep_degree))

    @classmethod
    def unavailable(cls, degrees: Degrees, world: int) -> str | None:
        from rlx.models.megatron.compat import megatron_version

        if megatron_version() is None:
            return "megatron-core is not installed"
        if world % (degrees.tp_degree * degrees.pp_degree):
            return f"tp {degrees.tp_degree} x pp {degrees.pp_degree} does not fit {world} process(es)"
        if (world // degrees.pp_degree) % degrees.ep_degree:
            return f"ep {degrees.ep_degree} does not divide the tensor x data parallel ranks of {world} process(es)"
        return None

    def build_trainer(self, model: torch.nn.Module, cfg: TrainConfig, where: str = "the initial policy"):
        return build_megatron_trainer(model.config, cfg, self.ctx, self._rank_state(model), where)

    def load_trainer(self, cfg: TrainConfig, source: ModelSource, config):
        hf_config = copy.deepcopy(config)  # the trainer keeps its own
        critic = is_critic_config(hf_config)
        if critic != (cfg.role == "critic"):
            what = "a value model" if critic else "a causal LM"
            raise UserError(f"{source.path}: --role {cfg.role} but the checkpoint holds {what}")
        check_complete(source.path)
        local = read_local_state(source.path, "megatron", self._coords())
        return build_megatron_trainer(hf_config, cfg, self.ctx, local.weights, str(source.path), local.optimizer)

    def scorer(self, trainer) -> MegatronScoringModel:
        """The trainer's stage as scoring uses megatron models (no copy)."""
        return MegatronScoringModel(trainer.model, trainer.hf_config, self.ctx)

    def build_reference(self, model: torch.nn.Module) -> MegatronScoringModel:
        stage = load_stage(model.config, self._rank_state(model), self.ctx, "the reference policy")
        return MegatronScoringModel(stage.requires_grad_(False).eval(), model.config, self.ctx)

    def load_scoring_model(self, source: ModelSource, role: str, config) -> MegatronScoringModel:
        config = copy.deepcopy(config)  # the model keeps its own
        if is_critic_config(config) != (role == "critic"):
            expected = "a value model (make one with `rlx shard --role critic`)" if role == "critic" else "a causal LM"
            raise UserError(f"{source.path}: expected {expected}")
        check_complete(source.path)
        local = read_local_state(source.path, "megatron", self._coords())
        return MegatronScoringModel(load_stage(config, local.weights, self.ctx, str(source.path)), config, self.ctx)

    def _coords(self) -> dict[str, int]:
        ctx = self.ctx
        return {"tp_degree": ctx.tp_degree, "pp_degree": ctx.pp_degree, "tp_rank": ctx.tp_rank, "pp_rank": ctx.pp_rank}

    def _rank_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """This rank's megatron slices of an HF model's weights."""
        ctx = self.ctx
        weights = {k: v for k, v in model.state_dict().items() if k not in tied_keys(model)}  # on every rank
        return hf_to_megatron_shard(weights, model.config, ctx.tp_degree, ctx.pp_degree, ctx.tp_rank, ctx.pp_rank)
