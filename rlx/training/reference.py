"""The reference policy for free with LoRA: the actor's own module with its adapters switched off.

A LoRA actor is its frozen base plus adapters, so the base's logprobs come from the same module inside
`adapters_disabled` (exactly the base's numbers, rlx.models.lora): no second copy of the model. `rlx ppo` uses it
whenever the actor trains adapters; `rlx score --actor LORA_CKPT --ref REF` uses it when REF is the actor's base
model, or a LoRA checkpoint on the same base whose adapters are still zero (the run's step 0), so a shell pipeline
computes what the driver computes.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlx.checkpoints.lora_base import source_path
from rlx.checkpoints.registry import read_lora
from rlx.logprobs import ModuleScorer
from rlx.models.lora import adapters_disabled, is_lora_model


class BaseModelScorer(ModuleScorer):
    """A module with LoRA adapters, scored with the adapters off: its base model's logprobs and values."""

    def logprobs(self, *args, **kwargs) -> torch.Tensor:
        with adapters_disabled(self.module):
            return super().logprobs(*args, **kwargs)

    def values(self, *args, **kwargs) -> torch.Tensor:
        with adapters_disabled(self.module):
            return super().values(*args, **kwargs)


def is_base_of(ref: Path, actor: Path) -> bool:
    """Whether model source `ref` computes exactly what LoRA checkpoint `actor`'s base computes: it is that base
    (the same source, pretrained), or a LoRA checkpoint on the same base whose adapters' B A are all zero."""
    actor_lora = read_lora(actor)
    if actor_lora is None:
        return False
    base = actor_lora.spec.base
    if base.init == "pretrained" and source_path(ref) == base.path:
        return True
    ref_lora = read_lora(ref) if ref.is_dir() else None
    if ref_lora is None or ref_lora.spec.role != "actor":
        return False
    return ref_lora.spec.base.identity == base.identity and ref_lora.has_zero_delta()


def shared_reference(actor: object, ref: Path, actor_path: Path) -> BaseModelScorer | None:
    """The reference as the actor's module with its adapters off, when `actor` is such a scorer and `ref` is its
    base (`is_base_of`); None when the reference must be loaded."""
    if not isinstance(actor, ModuleScorer) or not is_lora_model(actor.module):
        return None
    return BaseModelScorer(actor.module, actor.ctx) if is_base_of(ref, actor_path) else None
