"""The update loop both trainers share: epochs x mini-batches x micro-batches, AdamW, clipping, metrics,
on one process or data-parallel over ranks (FSDP2).

Each rank holds the whole scored batch. A mini-batch's rows are split across data-parallel ranks by
work (Karmarkar-Karp over token counts), each rank cuts its rows into micro-batches (by count or by
token budget), and ranks agree on the number of micro-batches (a rank with fewer runs zero-weight
ones, so FSDP's collectives line up). Every micro-batch loss is divided by normalisers counted over
the whole mini-batch (`LossNorm`) and FSDP sums the gradients over ranks, so the update equals one
pass over the mini-batch on one process.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import defaultdict
from collections.abc import Iterator
from itertools import accumulate

import torch
import torch.distributed as torch_dist
from tqdm import tqdm

from rlx.algorithms.losses import LossNorm
from rlx.checkpoints.base import LocalState
from rlx.checkpoints.lora_base import LoraSpec
from rlx.errors import UserError
from rlx.formats.batch import TrainBatch
from rlx.logprobs import PackedRows
from rlx.models import lora_state
from rlx.models.family import family_of
from rlx.models.loading import tied_keys
from rlx.models.lora import apply_lora, is_lora_model
from rlx.models.lora_merge import iter_merged_weights, merged_weights
from rlx.models.vision.packing import VisionRow, vision_forward
from rlx.parallel.apply import ParallelPlan, apply_parallelism, shards_models
from rlx.parallel.batching import (
    balanced_partition,
    count_micro_batches,
    even_token_micro_batches,
    token_budget_micro_batches,
)
from rlx.parallel.dist import DistContext, all_reduce
from rlx.parallel.experts import clip_grad_norm
from rlx.parallel.fsdp import activation_offload, full_tensor, gathered_weights, kept_gathered, model_weights
from rlx.training.config import TrainConfig
from rlx.training.optim import (
    build_adamw,
    load_optimizer_tensors,
    optimizer_tensors,
    sharded_model_state,
    sharded_optimizer_state,
)
from rlx.training.views import TrainerState, TrainerWeights
from rlx.utils.device import derive_seed
from rlx.utils.host_copy import before_update, layout, snapshot


def row_tokens(batch: TrainBatch) -> list[int]:
    """Prompt + response tokens of each row (the work measure for balancing and token budgets)."""
    return (batch.prompt_mask.sum(-1) + batch.response_mask.sum(-1)).tolist()


class Trainer:
    """A model on its device (FSDP-sharded under a launcher) with AdamW; subclasses define the loss.

    With `lora` (LoRA) the model trains adapters on a frozen base: the adapters are put in first (unless the model
    already has them, e.g. from a LoRA checkpoint), the base is frozen in the compute dtype, and only the adapters
    (and a critic's head) get gradients and AdamW state. Checkpoints then hold the adapters (`adapter_state`), the
    full weights are the merged ones, and the base with the adapters off is the reference (`base_reference` of the
    backend)."""

    role = "model"
    loss_keys: tuple[str, ...] = ()
    """Metric sums averaged per optimizer step (the others are token sums, averaged per token)."""

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: TrainConfig,
        device: torch.device,
        dtype: torch.dtype,
        ctx: DistContext | None = None,
        lora: LoraSpec | None = None,
    ):
        self.cfg, self.device = cfg, device
        self.ctx = ctx or DistContext(device=device)
        family_of(model.config).prepare(model, cfg.vision.freeze_vision_tower)  # before the optimizer and FSDP
        self.lora = lora
        if lora is not None and cfg.ep_degree > 1:
            raise UserError(
                f"ep_degree {cfg.ep_degree}: expert parallelism does not train LoRA adapters yet (FSDP without it, "
                f"ep_degree 1, trains them, those on the experts too)"
            )
        if lora is not None and not is_lora_model(model):
            apply_lora(model, lora.config, dtype, seed=cfg.seed)
        plan = ParallelPlan(
            packed_attention=cfg.use_packing,
            compile=cfg.compile,
            activation_checkpointing=cfg.gradient_checkpointing,
            param_dtype=dtype,
            offload=cfg.param_offload,
            ep_degree=cfg.ep_degree,
        )
        self.model = apply_parallelism(model, self.ctx, plan, self.role)
        self.sp_group = self.ctx.sp_group if self.ctx.sp_degree > 1 else None
        # FSDP's mixed precision casts the parameters (no autocast on top) and averages gradients over ranks
        # while the losses are global sums: each rank's loss is scaled by the world size
        self.is_sharded = shards_models(self.ctx, cfg.param_offload)
        self.dtype = torch.float32 if self.is_sharded else dtype
        self.gradient_scale = float(self.ctx.world) if self.is_sharded else 1.0
        self.optimizer = build_adamw(self.model, cfg)

    # --- what checkpoints, scoring and rollouts take from a trainer -----------------------------------

    def weights(self) -> TrainerWeights:
        """The view a rollout engine's weight sync reads (`engine.update_weights(trainer.weights())`)."""
        return TrainerWeights(self)

    def state(self) -> TrainerState:
        """The view checkpoint layouts save (`checkpoints.save(out, trainer.state(), ...)`) and restore into."""
        return TrainerState(self)

    @property
    def config(self):
        """The model's Hugging Face config."""
        return self.model.config

    @property
    def is_main(self) -> bool:
        return self.ctx.is_main

    @property
    def world(self) -> int:
        return self.ctx.world

    @property
    def module(self) -> torch.nn.Module:
        """The live (possibly FSDP-sharded) module: rollout engines may generate with it directly."""
        return self.model

    def full_weights(self) -> dict[str, torch.Tensor]:
        if self.lora is None:
            return model_weights(self.model)
        weights = merged_weights(self.model)  # gathered on every rank: hand them over on the main one
        return weights if self.is_main else {}

    def adapter_state(self) -> dict[str, torch.Tensor] | None:
        """The adapters (and a critic's head) by stable name, float32 on the CPU, on every rank (a collective);
        None for a model trained in full."""
        return lora_state.adapter_state(self.model) if self.lora is not None else None

    def full_optimizer_state(self) -> dict[str, torch.Tensor]:
        return self.optimizer_state()

    def snapshot_state(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(full weights, full optimizer state) as host copies that later updates leave alone; a collective.
        Unsharded on CUDA they are still being copied off the device when this returns (rlx.utils.host_copy)."""
        live = self._live_state()
        if live is None:  # gathered (or merged): fresh copies already
            return self.full_weights(), self.full_optimizer_state()
        (weights, w_tag), (optimizer, o_tag) = live
        return snapshot(weights, w_tag), snapshot(optimizer, o_tag)

    def snapshot_layout(self) -> list[tuple[dict, str]]:
        """What `snapshot_state` will copy to pinned host buffers ([(shapes and dtypes, tag)]; empty when it
        gathers fresh copies instead), for `rlx.utils.host_copy.reserve` to pin ahead of the first checkpoint."""
        return [(layout(tensors), tag) for tensors, tag in self._live_state() or ()]

    def _live_state(self) -> list[tuple[dict[str, torch.Tensor], str]] | None:
        """[(live weights, their snapshot tag), (live optimizer tensors, tag)] of an unsharded full model, which
        `snapshot_state` copies itself; None when it gathers (sharded) or merges (LoRA) instead."""
        if self.world > 1 or self.lora is not None:
            return None
        weights = model_weights(self.model, offload=False)
        optimizer = optimizer_tensors(self.model, self.optimizer, offload=False)
        return [(weights, f"{self.role}/weights"), (optimizer, f"{self.role}/optimizer")]

    def local_state(self) -> LocalState:
        """This rank's shards: DTensors under FSDP (whole tensors in a lone process)."""
        return LocalState("dtensor", self.model_shards(), self.optimizer_shards())

    def model_shards(self) -> dict[str, torch.Tensor]:
        """This rank's weights as checkpoints store them (tied ones once): the live parameters, so a checkpoint's
        shards can be read into them in place."""
        tied = tied_keys(self.model)
        return {k: v for k, v in sharded_model_state(self.model).items() if k not in tied}

    def optimizer_shards(self) -> dict[str, torch.Tensor]:
        """This rank's optimizer state tensors, keyed '<param>::<state key>' as checkpoints store them, initialized
        (a zero step at learning rate 0) when no step has run: what a checkpoint's shards are read into, in place."""
        return sharded_optimizer_state(self.model, self.optimizer)

    def named_weights(self, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Full weights with Hugging Face names, tied ones under each name (with adapters: merged, one tensor gathered
        at a time)."""
        if self.lora is not None:
            return iter_merged_weights(self.model, tied=True)
        return gathered_weights(self.model, bucket_bytes)

    def load_optimizer_state(self, tensors: dict[str, torch.Tensor] | None, where: str) -> None:
        if tensors:
            load_optimizer_tensors(self.model, self.optimizer, tensors, where)

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        return optimizer_tensors(self.model, self.optimizer)

    def optimizer_meta(self) -> dict:
        group = {k: v for k, v in self.optimizer.param_groups[0].items() if k != "params"}
        jsonable = {
            k: list(v) if isinstance(v, tuple) else v
            for k, v in group.items()
            if isinstance(v, (int, float, str, bool, list, tuple)) or v is None
        }
        return {"name": "adamw", "param_groups": [jsonable]}

    @property
    def vocab_size(self) -> int:
        return self.model.config.get_text_config().vocab_size

    def check_batch(self, batch: TrainBatch, where: str) -> None:
        """The batch must come from a model with this vocabulary."""
        vocab = self.vocab_size
        if batch.meta.vocab_size != vocab:
            raise UserError(
                f"{where}: batch was scored with a vocabulary of {batch.meta.vocab_size} "
                f"tokens but the checkpoint's model has {vocab}"
            )
        top = int(torch.maximum(batch.prompt_ids.max(), batch.response_ids.max()))
        if top >= vocab:
            raise UserError(f"{where}: batch contains token id {top}, outside the model's vocabulary of {vocab}")
        if batch.images is not None and not family_of(self.config).takes_images:
            raise UserError(f"{where}: the batch has images, but the model ({self.config.model_type}) is text-only")

    def train_step(self, batch: TrainBatch, step: int) -> dict[str, float]:
        """One update on `batch`; `step` is the number of updates already applied."""
        cfg, start = self.cfg, time.perf_counter()
        before_update()  # a checkpoint snapshot still copying these tensors off the device finishes first
        lr = cfg.optim.lr_at(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        torch.manual_seed(derive_seed("train", self.role, cfg.seed, step, self.ctx.rank))
        self.model.train()
        sums: dict[str, float] = defaultdict(float)
        grad_norms, skipped = [], 0
        sizes = cfg.mini_batch_sizes(batch.size)  # each optimizer step's samples in an epoch
        starts = list(accumulate(sizes, initial=0))
        bar = tqdm(
            total=cfg.epochs * len(sizes),
            desc=f"train {self.role}",
            unit="update",
            leave=False,
            disable=None if self.ctx.is_main else True,
        )
        for epoch in range(cfg.epochs):
            order = self._order(batch.size, step, epoch)
            for lo, size in zip(starts, sizes):
                norm = self._update(batch.select(order[lo : lo + size]), sums)
                grad_norms.append(norm)
                skipped += not math.isfinite(norm)
                bar.update(1)
        bar.close()
        return self._metrics(self._reduce_sums(sums), grad_norms, skipped, lr, batch, time.perf_counter() - start)

    def _reduce_sums(self, sums: dict) -> dict[str, float]:
        """Metric sums (device tensors, kept there so micro-steps never wait for the GPU) as floats, summed
        over data-parallel ranks (sequence-parallel ranks hold the same sums)."""
        keys = sorted(sums)
        if not keys:
            return {}
        values = torch.stack(
            [torch.as_tensor(sums[k], device=self.ctx.device).to(torch.float64).reshape(()) for k in keys]
        )
        if self.ctx.distributed and self.ctx.dp_size > 1:
            torch_dist.all_reduce(values, group=self.ctx.dp_group)
        return dict(zip(keys, values.tolist()))

    def _metrics(
        self, sums: dict, grad_norms: list[float], skipped: int, lr: float, batch: TrainBatch, seconds: float
    ) -> dict[str, float]:
        tokens = max(sums.pop("tokens", 0.0), 1.0)
        updates = len(grad_norms)
        out = {f"{self.role}/{k}": v / (updates if k in self.loss_keys else tokens) for k, v in sums.items()}
        finite = [g for g in grad_norms if math.isfinite(g)]
        trained_tokens = self.cfg.epochs * float(batch.prompt_mask.sum() + batch.response_mask.sum())
        out.update(
            {
                f"{self.role}/grad_norm": sum(finite) / len(finite) if finite else float("nan"),
                f"{self.role}/lr": lr,
                f"{self.role}/num_updates": float(updates),
                f"{self.role}/skipped_updates": float(skipped),
                f"perf/{self.role}_tokens_per_s": trained_tokens / max(seconds, 1e-9),
                f"timing/{self.role}_train_s": seconds,
            }
        )
        return out

    def _order(self, b: int, step: int, epoch: int) -> torch.Tensor:
        if not self.cfg.shuffle:
            return torch.arange(b)
        gen = torch.Generator().manual_seed(derive_seed("shuffle", self.cfg.seed, step, epoch))
        return torch.randperm(b, generator=gen)

    def local_rows(self, mini: TrainBatch) -> list[int]:
        """This rank's rows of the mini-batch: a work-balanced share per data-parallel rank."""
        if self.ctx.dp_size == 1:
            return list(range(mini.size))
        if mini.size < self.ctx.dp_size:
            raise UserError(f"a mini-batch of {mini.size} samples cannot feed {self.ctx.dp_size} data-parallel ranks")
        return balanced_partition(row_tokens(mini), self.ctx.dp_size)[self.ctx.dp_rank]

    def micro_batches(self, local: TrainBatch) -> list[list[int]]:
        if self.cfg.max_tokens_per_micro_batch:
            return token_budget_micro_batches(row_tokens(local), self.cfg.max_tokens_per_micro_batch)
        return count_micro_batches(local.size, self.cfg.micro_batch_size)

    def _update(self, mini: TrainBatch, sums: dict[str, float]) -> float:
        """Accumulate the mini-batch's gradient, then one optimizer step.  Returns the grad norm."""
        self.accumulate_gradients(mini, sums)
        params = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = self.cfg.optim.max_grad_norm if self.cfg.optim.max_grad_norm > 0 else float("inf")
        if self.cfg.ep_degree > 1:  # the experts' gradients live on a mesh of their own
            grad_norm = float(clip_grad_norm(params, max_norm))
        else:
            grad_norm = float(full_tensor(torch.nn.utils.clip_grad_norm_(params, max_norm)))
        if math.isfinite(grad_norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def accumulate_gradients(self, mini: TrainBatch, sums: dict[str, float]) -> None:
        """Forward/backward of this rank's micro-batches of `mini`, normalised over the whole mini-batch."""
        norm = self.loss_norm(mini)
        local = mini.select(self.local_rows(mini))
        parts = self.micro_batches(local)
        count = len(parts)
        if self.ctx.distributed:
            count = int(all_reduce(count, "max", group=self.ctx.dp_group, device=self.ctx.device))
        if self.cfg.max_tokens_per_micro_batch:  # `count` even parts: no rank runs a whole micro-batch for nothing
            tokens = row_tokens(local)
            parts = even_token_micro_batches(tokens, self.cfg.max_tokens_per_micro_batch, count) or parts
            filler = [min(range(local.size), key=tokens.__getitem__)]  # where one is still short: the least work
        else:
            filler = parts[0]
        keep = self.is_sharded and self.cfg.keep_gathered
        with kept_gathered(self.model, keep):
            for i in range(count):
                dummy = i >= len(parts)  # keeps FSDP's collectives in step with busier ranks; contributes nothing
                if self.is_sharded:  # unsharded: FSDP accumulates whole float32 gradients, reduces after the last
                    self.model.set_requires_gradient_sync(i == count - 1 or self.cfg.grad_accumulation == "sharded")
                if keep:  # the gathered parameters stay until the last micro-batch's backward
                    self.model.set_reshard_after_backward(i == count - 1)
                part = local.select(filler if dummy else parts[i])
                with activation_offload(self.cfg.activation_offload, self.device):
                    self.micro_step(
                        {k: v.to(self.device) for k, v in part.tensors().items()},
                        part,
                        norm,
                        defaultdict(float) if dummy else sums,
                        0.0 if dummy else self.gradient_scale,
                    )

    def loss_norm(self, mini: TrainBatch) -> LossNorm:
        """Normalisers counted over the whole mini-batch (every rank computes the same), over the trained tokens."""
        mask = mini.loss_mask
        return LossNorm(
            num_tokens=float(mask.sum().clamp(min=1)),
            num_seqs=float((mask.sum(-1) > 0).sum().clamp(min=1)),
            scale_factor=float(self.cfg.loss.loss_scale_factor or mini.response_ids.shape[1]),
        )

    def vision_row(self, part: TrainBatch) -> VisionRow | None:
        """A vision-language micro-batch as one packed row with its images and 3-D positions (None without
        images), built on the CPU; `vision_forward` moves it."""
        if part.images is None:
            return None
        return VisionRow.from_padded(
            part.prompt_ids, part.prompt_mask, part.response_ids, part.response_mask, part.images.vision,
            self.model.config,
        )  # fmt: skip

    def packed_images(self, part: TrainBatch):
        """A context in which the model's packed forward of `part` takes its images and 3-D positions (this rank's
        slice under sequence parallelism); nothing for a micro-batch without images."""
        row = self.vision_row(part)
        if row is None:
            return contextlib.nullcontext()
        sp_rank, sp_degree = (self.ctx.sp_rank, self.ctx.sp_degree) if self.sp_group is not None else (0, 1)
        return vision_forward(self.model, row, sp_rank, sp_degree)

    def packed_rows(self, part: TrainBatch) -> PackedRows:
        """The micro-batch as one packed row (this rank's sequence slice), indexed on the CPU, then moved."""
        rank, size = (self.ctx.sp_rank, self.ctx.sp_degree) if self.sp_group is not None else (0, 1)
        rows = PackedRows.build(part.prompt_ids, part.prompt_mask, part.response_ids, part.response_mask, rank, size)
        return rows.to(self.device)

    def micro_step(
        self, tensors: dict[str, torch.Tensor], part: TrainBatch, norm: LossNorm, sums: dict[str, float], weight: float
    ) -> None:
        """Forward and backward of `weight` * loss for one micro-batch (weight 0 for padding micro-batches,
        the world size under FSDP, else 1)."""
        raise NotImplementedError
