"""The actor's PPO update: epochs x mini-batches x micro-batches over one TrainBatch.

Each micro-batch's loss is divided by the token count of its whole mini-batch, so the gradient
accumulated over micro-batches equals the gradient of one pass over the mini-batch.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict

import torch
from tqdm import tqdm

from rlx.engine.algorithms.core import masked_sum
from rlx.engine.algorithms.losses import kl_estimate, ppo_clip_loss
from rlx.engine.batch import TrainBatch
from rlx.engine.device import derive_seed
from rlx.engine.logprobs import response_logprobs
from rlx.engine.training.config import TrainConfig
from rlx.engine.training.optim import build_adamw, load_optimizer_tensors, optimizer_tensors
from rlx.errors import UserError

_MODEL_INPUTS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
_LOSSES = ("loss", "pg_loss", "kl_loss")  # averaged per optimizer step; other sums per token


class ActorTrainer:
    """The trainable policy: a causal LM on `device` with its AdamW optimizer."""

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
        return {
            "name": "adamw",
            "param_groups": [{k: list(v) if isinstance(v, tuple) else v for k, v in group.items() if _is_jsonable(v)}],
        }

    def check_batch(self, batch: TrainBatch, where: str) -> None:
        """The batch must come from a model with this vocabulary and need what the settings need."""
        vocab = self.model.config.vocab_size
        if batch.meta.vocab_size != vocab:
            raise UserError(
                f"{where}: batch was scored with a vocabulary of {batch.meta.vocab_size} "
                f"tokens but the checkpoint's model has {vocab}"
            )
        top = int(torch.maximum(batch.prompt_ids.max(), batch.response_ids.max()))
        if top >= vocab:
            raise UserError(f"{where}: batch contains token id {top}, outside the model's vocabulary of {vocab}")
        if self.cfg.kl_loss_coef > 0 and batch.ref_logprobs is None:
            raise UserError(f"{where}: kl_loss_coef > 0 needs ref logprobs in the batch (run rlx score with --ref)")

    def train_step(self, batch: TrainBatch, step: int) -> dict[str, float]:
        """One PPO update on `batch`; `step` is the number of updates already applied."""
        cfg, start = self.cfg, time.perf_counter()
        lr = cfg.lr_at(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        torch.manual_seed(derive_seed("train", cfg.seed, step))
        self.model.train()
        sums: dict[str, float] = defaultdict(float)
        grad_norms, num_updates, skipped = [], 0, 0
        b = batch.size
        mini = cfg.mini_batch_size or b
        bar = tqdm(total=cfg.epochs * math.ceil(b / mini), desc="train", unit="update", leave=False, disable=None)
        for epoch in range(cfg.epochs):
            order = self._order(b, step, epoch)
            for lo in range(0, b, mini):
                norm = self._update(batch.select(order[lo : lo + mini]), sums)
                grad_norms.append(norm)
                num_updates += 1
                skipped += not math.isfinite(norm)
                bar.update(1)
        bar.close()
        seconds = time.perf_counter() - start
        tokens = sums.pop("tokens")
        trained_tokens = cfg.epochs * float(batch.prompt_mask.sum() + batch.response_mask.sum())
        finite = [g for g in grad_norms if math.isfinite(g)]
        metrics = {f"actor/{k}": v / (num_updates if k in _LOSSES else tokens) for k, v in sums.items()}
        metrics.update(
            {
                "actor/grad_norm": sum(finite) / len(finite) if finite else float("nan"),
                "actor/lr": lr,
                "actor/num_updates": float(num_updates),
                "actor/skipped_updates": float(skipped),
                "perf/train_tokens_per_s": trained_tokens / max(seconds, 1e-9),
                "timing/train_s": seconds,
            }
        )
        return metrics

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
        """Forward/backward every micro-batch of `mini`; each loss is divided by the mini-batch's tokens."""
        cfg = self.cfg
        num_tokens = mini.response_mask.sum().clamp(min=1).to(self.device)
        for lo in range(0, mini.size, cfg.micro_batch_size):
            part = {k: v[lo : lo + cfg.micro_batch_size].to(self.device) for k, v in mini.tensors().items()}
            mask = part["response_mask"]
            logp, entropy = response_logprobs(
                self.model,
                **{k: part[k] for k in _MODEL_INPUTS},
                temperature=mini.meta.temperature,
                dtype=self.dtype,
                with_entropy=True,
            )
            pg_loss, pg_sums = ppo_clip_loss(
                logp,
                part["old_logprobs"],
                part["advantages"],
                mask,
                num_tokens,
                cfg.clip_ratio_low,
                cfg.clip_ratio_high,
                cfg.clip_ratio_c or None,
            )
            entropy_sum = masked_sum(entropy, mask)
            loss = pg_loss - cfg.entropy_coef * entropy_sum / num_tokens
            if cfg.kl_loss_coef > 0:
                kl_loss = masked_sum(kl_estimate(logp, part["ref_logprobs"], cfg.kl_loss_type), mask) / num_tokens
                loss = loss + cfg.kl_loss_coef * kl_loss
                sums["kl_loss"] += kl_loss.item()
            loss.backward()
            sums["pg_loss"] += pg_loss.item()
            sums["loss"] += loss.item()
            sums["entropy"] += entropy_sum.item()
            for key, value in pg_sums.items():
                sums[key] += value.item()


def _is_jsonable(value) -> bool:
    return isinstance(value, (int, float, str, bool, list, tuple)) or value is None
