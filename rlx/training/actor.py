"""The actor's update: a policy loss (PPO clip and its family) with rollout correction, KL loss and
entropy bonus, aggregated with mini-batch normalisers. Every term and metric is over the batch's `loss_mask`
(a multi-turn sample's environment tokens get no loss and count in no normaliser)."""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as torch_dist

from rlx.algorithms.core import masked_sum
from rlx.algorithms.kl import kl_estimate
from rlx.algorithms.losses import LossNorm, aggregate, compute_policy_loss
from rlx.algorithms.rollout_correction import correct, mismatch_metrics
from rlx.errors import UserError
from rlx.formats.batch import TrainBatch
from rlx.logprobs import MODEL_INPUTS, ROUTES, flat_routes, packed_response_logprobs, response_logprobs
from rlx.models.exact import exact_forward
from rlx.models.moe import RouterProbe, moe_sizes
from rlx.models.routing import RouterReplay
from rlx.training.trainer import Trainer


class ActorTrainer(Trainer):
    """The trainable policy: a causal LM and its AdamW optimizer."""

    role = "actor"
    loss_keys = (
        "loss", "pg_loss", "kl_loss", "entropy_loss", "moe_aux_loss", "moe_router_z_loss", "moe_max_expert_load"
    )  # fmt: skip
    step_expert_load: torch.Tensor = torch.zeros(())
    _forward_old: tuple[dict[str, int], torch.Tensor] | None = None
    """During a train step whose batch takes its old logprobs from the forward: the batch's row of each sample id and
    the [B, R] logprobs, filled micro-batch by micro-batch; None otherwise."""
    """Routed (token, slot) pairs per expert [E] over the current train step (this rank's tokens)."""

    def check_batch(self, batch: TrainBatch, where: str) -> None:
        super().check_batch(batch, where)
        if self.cfg.loss.kl_loss_coef > 0 and batch.ref_logprobs is None:
            raise UserError(f"{where}: kl_loss_coef > 0 needs ref logprobs in the batch (run rlx score with --ref)")
        if self.cfg.router_replay != "off" and batch.routed_experts is None:
            raise UserError(
                f"{where}: router_replay = 'rollout' needs a batch with routed_experts (MoE rollouts of engine hf or "
                "native)"
            )
        if batch.meta.old_logprobs == "train":
            self._check_old_from_forward(batch, where)
        if batch.routed_experts is not None and self.router_replay is not None:
            if self.ctx.sp_degree > 1:
                raise UserError(f"{where}: MoE routing replay does not run under sequence parallelism (sp_degree > 1)")
            try:
                self.router_replay.check_shape(tuple(batch.routed_experts.shape[2:]), moe_sizes(self.config)[1])
            except UserError as e:
                raise UserError(f"{where}: {e}") from None

    def _check_old_from_forward(self, batch: TrainBatch, where: str) -> None:
        """A batch whose old logprobs the train step takes from its own forward: one update, no rejection."""
        cfg, correction = self.cfg, self.cfg.correction
        problems = []
        if not cfg.updates_once(batch.size):
            problems.append(
                f"train.epochs = {cfg.epochs} and train.mini_batch_size = {cfg.mini_batch_size} for {batch.size} "
                "samples (must be 1, and 0 or at least the samples)"
            )
        if correction.rollout_rs != "none" or correction.rollout_veto_threshold > 0:
            problems.append("rejection in train.correction (rollout_rs / rollout_veto_threshold)")
        if len(set(batch.meta.sample_ids)) != batch.size:
            problems.append("repeated sample ids")
        if problems:
            raise UserError(
                f"{where}: the batch's old logprobs are to come from this step's forward (scored with "
                f"old_logprobs = 'train'), which takes one update per batch; here: {'; '.join(problems)}. Score it "
                f"with old_logprobs = 'actor' instead"
            )

    def train_step(self, batch: TrainBatch, step: int) -> dict[str, float]:
        self.step_expert_load = torch.zeros(())
        from_forward = batch.meta.old_logprobs == "train"
        if from_forward:  # each micro-batch's detached logprobs are the old ones, gathered here for the metrics
            rows = {sample: i for i, sample in enumerate(batch.meta.sample_ids)}
            forward_old = torch.zeros(batch.old_logprobs.shape, dtype=torch.float32, device=self.device)
            self._forward_old = rows, forward_old
        try:
            metrics = super().train_step(batch, step)
        finally:
            self._forward_old = None
        if from_forward:
            if self.ctx.distributed and self.ctx.dp_size > 1:  # each data-parallel rank filled its own rows
                torch_dist.all_reduce(forward_old, group=self.ctx.dp_group)
            batch.old_logprobs = forward_old.cpu()
            metrics.update(mismatch_metrics(batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask))
            metrics["actor/old_logprobs_from_train"] = 1.0
        if self.router_probe is not None:
            metrics.update(self.expert_load_metrics())
        mismatched, compared = metrics.pop("actor/routing_mismatched", None), metrics.pop("actor/routing_compared", 0)
        if mismatched is not None:  # both divided by the same token count
            metrics["actor/moe_routing_mismatch"] = mismatched / compared if compared else 0.0
        if batch.meta.routing_mismatch is not None:  # the scoring forward's, as rlx score logged it
            metrics["moe/routing_mismatch"] = batch.meta.routing_mismatch
        if self.cfg.correction.active:  # what the correction did, over the whole batch
            metrics.update(correct(batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask, self.cfg.correction)[2])
        return metrics

    def loss_norm(self, mini: TrainBatch) -> LossNorm:
        """Normalisers over the tokens the rollout correction keeps (rejection removes tokens)."""
        _, keep, _ = correct(mini.old_logprobs, mini.rollout_logprobs, mini.loss_mask, self.cfg.correction)
        return LossNorm(
            num_tokens=float(keep.sum().clamp(min=1)),
            num_seqs=float((keep.sum(-1) > 0).sum().clamp(min=1)),
            scale_factor=float(self.cfg.loss.loss_scale_factor or mini.response_ids.shape[1]),
        )

    def logprobs(self, t: dict[str, torch.Tensor], part: TrainBatch):
        """New logprobs and entropy [B, R] of a micro-batch (train.exact: the batch-invariant forward)."""
        with exact_forward(self.model) if self.cfg.exact else contextlib.nullcontext():
            return self._logprobs(t, part)

    def _logprobs(self, t: dict[str, torch.Tensor], part: TrainBatch):
        inputs = {k: t[k] for k in MODEL_INPUTS}
        common = {"temperature": part.meta.temperature, "dtype": self.dtype, "with_entropy": True}
        if self.cfg.use_packing:
            rows = self.packed_rows(part)
            with self.packed_images(part):  # images and 3-D positions hooked into the packed forward
                return packed_response_logprobs(
                    self.model, **inputs, **common, impl=self.cfg.logprob_impl, sp_group=self.sp_group, rows=rows
                )
        vision = part.images.vision if part.images is not None else None
        return response_logprobs(self.model, **inputs, **common, impl=self.cfg.logprob_impl, vision=vision)

    def micro_step(
        self, t: dict[str, torch.Tensor], part: TrainBatch, norm: LossNorm, sums: dict[str, float], weight: float
    ) -> None:
        probe, replay = self.router_probe, self.router_replay if ROUTES in t else None
        # the replay stays open through the backward: activation checkpointing's recomputation is forced alike
        with replay if replay is not None else contextlib.nullcontext():
            if replay is not None:
                routes = flat_routes(t[ROUTES], t["prompt_mask"], t["response_mask"], self.cfg.use_packing)
                replay.set_routes(routes)
                before = (replay.mismatched, replay.compared)
            with probe if probe is not None else contextlib.nullcontext():
                logp, entropy = self.logprobs(t, part)
            if self._forward_old is not None:  # the old logprobs are this forward's (one update per batch)
                t["old_logprobs"] = logp.detach().float()
                if weight:  # not a padding micro-batch (a repeat of the rank's first)
                    row_of, forward_old = self._forward_old
                    rows = torch.tensor([row_of[s] for s in part.meta.sample_ids], device=self.device)
                    forward_old.index_copy_(0, rows, t["old_logprobs"] * t["loss_mask"])
            loss = self.micro_loss(t, logp, entropy, norm, sums)
            if probe is not None:
                loss = loss + self.moe_loss(probe, t, norm, sums if weight else None)
            (loss * weight).backward()
        if replay is not None:
            sums["routing_mismatched"] += replay.mismatched - before[0]  # device tensors: no sync here
            sums["routing_compared"] += replay.compared - before[1]

    @functools.cached_property
    def router_replay(self) -> RouterReplay | None:
        """Hooks that compare (and with train.router_replay = 'rollout' force) an MoE actor's routing with the
        batch's routed_experts (None for a dense actor)."""
        if moe_sizes(self.config) is None:
            return None
        return RouterReplay(self.model, force=self.cfg.router_replay == "rollout")

    @functools.cached_property
    def router_probe(self) -> RouterProbe | None:
        """Hooks on the routers of an MoE actor (None for a dense one)."""
        return RouterProbe(self.model) if moe_sizes(self.config) is not None else None

    def moe_loss(self, probe: RouterProbe, t: dict[str, torch.Tensor], norm: LossNorm, sums: dict | None):
        """The routers' load-balancing and z-loss terms of the micro-batch (each times its coefficient; 0 when
        both are off), weighted by its share of the mini-batch's trained tokens (so accumulated micro-batches give
        about one batch's value); their metric sums added to `sums` and the routed tokens per expert to the step's
        load (None: a padding micro-batch, nothing counted)."""
        num_experts, top_k = moe_sizes(self.config)
        share = t["loss_mask"].sum() / norm.num_tokens
        aux = probe.aux_loss(num_experts, top_k) * share
        z_loss = probe.z_loss() * share
        if sums is not None:
            with torch.no_grad():
                load = probe.expert_load(num_experts)
                self.step_expert_load = self.step_expert_load + load.double()
                sums["moe_aux_loss"] += aux.detach()
                sums["moe_router_z_loss"] += z_loss.detach()
                sums["moe_max_expert_load"] += (load.max() / load.mean().clamp(min=1e-9)) * share  # 1.0 = balanced
        loss = torch.zeros((), device=aux.device)
        if self.cfg.loss.moe_aux_loss_coef > 0:
            loss = loss + self.cfg.loss.moe_aux_loss_coef * aux
        if self.cfg.loss.router_z_loss_coef > 0:
            loss = loss + self.cfg.loss.router_z_loss_coef * z_loss
        return loss

    def expert_load_metrics(self) -> dict[str, float]:
        """The step's routed (token, slot) pairs per expert (summed over MoE layers and all ranks) as
        moe/expert_load_max (the busiest expert over the mean, 1.0 = balanced) and moe/expert_load_cv (standard
        deviation over mean, population, 0 = balanced); a collective under a launcher."""
        load = torch.as_tensor(self.step_expert_load, dtype=torch.float64, device=self.ctx.device)
        if self.ctx.distributed and self.ctx.world > 1:  # every rank routed its own tokens (sequence slices too)
            torch_dist.all_reduce(load)
        mean = load.mean().clamp(min=1e-9)
        cv = load.std(correction=0) / mean
        return {"moe/expert_load_max": float(load.max() / mean), "moe/expert_load_cv": float(cv)}

    def micro_loss(
        self, t: dict[str, torch.Tensor], logp: torch.Tensor, entropy: torch.Tensor, norm: LossNorm, sums: dict
    ) -> torch.Tensor:
        """The micro-batch's loss from its logprobs and entropy [B, R] (metric sums added to `sums`)."""
        cfg = self.cfg.loss
        weights, mask, _ = correct(t["old_logprobs"], t["rollout_logprobs"], t["loss_mask"], self.cfg.correction)
        pg_loss, pg_sums = compute_policy_loss(
            cfg.policy_loss,
            logp,
            t["old_logprobs"],
            t["advantages"],
            mask,
            norm,
            cfg.loss_agg_mode,
            cfg,
            weights,
        )
        loss = pg_loss
        if cfg.entropy_coef > 0:
            entropy_loss = aggregate(entropy, mask, cfg.loss_agg_mode, norm)
            loss = loss - cfg.entropy_coef * entropy_loss
            sums["entropy_loss"] += entropy_loss.detach()
        if cfg.kl_loss_coef > 0:
            kl_loss = aggregate(kl_estimate(logp, t["ref_logprobs"], cfg.kl_loss_type), mask, cfg.loss_agg_mode, norm)
            loss = loss + cfg.kl_loss_coef * kl_loss
            sums["kl_loss"] += kl_loss.detach()
        sums["pg_loss"] += pg_loss.detach()
        sums["loss"] += loss.detach()
        with torch.no_grad():
            sums["entropy"] += masked_sum(entropy, mask).detach()
            sums["tokens"] += mask.sum().detach()
        for key, value in pg_sums.items():
            sums[key] += value.detach()
        return loss
