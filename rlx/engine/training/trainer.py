"""The update loop both trainers share: epochs x mini-batches x micro-batches, AdamW, clipping, metrics.

Each micro-batch's loss is divided by normalisers counted over its whole mini-batch (`LossNorm`),
so the gradient accumulated over micro-batches equals one pass over the mini-batch.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict

import torch
from tqdm import tqdm

from rlx.engine.batch import TrainBatch
from rlx.engine.device import derive_seed
from rlx.engine.training.config import TrainConfig
from rlx.engine.training.optim import build_adamw, load_optimizer_tensors, optimizer_tensors
from rlx.errors import UserError

MODEL_INPUTS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")


class Trainer:
    """A model on `device` with its AdamW optimizer; subclasses define the micro-batch loss."""

    role = "model"
    loss_keys: tuple[str, ...] = ()
    """Metric sums averaged per optimizer step (the others are token sums, averaged per token)."""

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig, device: torch.device, dtype: torch.dtype):
        self.model = model.to(device)
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.optimizer = build_adamw(self.model, cfg)

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

    def check_batch(self, batch: TrainBatch, where: str) -> None:
        """The batch must come from a model with this vocabulary."""
        vocab = self.model.config.vocab_size
        if batch.meta.vocab_size != vocab:
            raise UserError(
                f"{where}: batch was scored with a vocabulary of {batch.meta.vocab_size} "
                f"tokens but the checkpoint's model has {vocab}"
            )
        top = int(torch.maximum(batch.prompt_ids.max(), batch.response_ids.max()))
        if top >= vocab:
            raise UserError(f"{where}: batch contains token id {top}, outside the model's vocabulary of {vocab}")

    def train_step(self, batch: TrainBatch, step: int) -> dict[str, float]:
        """One update on `batch`; `step` is the number of updates already applied."""
        cfg, start = self.cfg, time.perf_counter()
        lr = cfg.lr_at(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        torch.manual_seed(derive_seed("train", self.role, cfg.seed, step))
        self.model.train()
        sums: dict[str, float] = defaultdict(float)
        grad_norms, skipped = [], 0
        mini = cfg.mini_batch_size or batch.size
        bar = tqdm(
            total=cfg.epochs * math.ceil(batch.size / mini),
            desc=f"train {self.role}",
            unit="update",
            leave=False,
            disable=None,
        )
        for epoch in range(cfg.epochs):
            order = self._order(batch.size, step, epoch)
            for lo in range(0, batch.size, mini):
                norm = self._update(batch.select(order[lo : lo + mini]), sums)
                grad_norms.append(norm)
                skipped += not math.isfinite(norm)
                bar.update(1)
        bar.close()
        return self._metrics(sums, grad_norms, skipped, lr, batch, time.perf_counter() - start)

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

    def _update(self, mini: TrainBatch, sums: dict[str, float]) -> float:
        """Accumulate the mini-batch's gradient, then one optimizer step.  Returns the grad norm."""
        self.accumulate_gradients(mini, sums)
        params = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        if math.isfinite(norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def accumulate_gradients(self, mini: TrainBatch, sums: dict[str, float]) -> None:
        raise NotImplementedError

    def micro_batches(self, mini: TrainBatch):
        """The mini-batch's tensors in micro-batches of `micro_batch_size` rows, on the device."""
        step = self.cfg.micro_batch_size
        for lo in range(0, mini.size, step):
            yield {k: v[lo : lo + step].to(self.device) for k, v in mini.tensors().items()}
