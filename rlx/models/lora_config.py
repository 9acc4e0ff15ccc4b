"""LoraConfig: the settings of low-rank adapters on a policy or value model (no torch import, so recipes and
`--help` stay fast; the adapters themselves are built by rlx.models.lora, those on a mixture-of-experts model's fused
expert weights by rlx.models.lora_experts)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rlx.config import check, check_choices

ALL_LINEAR = "all-linear"
ALL_EXPERTS = "all-experts"


@dataclass(kw_only=True)
class LoraConfig:
    """Low-rank adapters (LoRA, PEFT's layers): W x + (alpha / rank) B A x on each targeted linear layer (and, on
    a mixture-of-experts model, on each expert of the targeted fused expert weights), with the base weights frozen
    and only A [rank, in] and B [out, rank] trained."""

    rank: int = 16
    """Rank of each adapter (the inner size of B A); must be > 0."""
    alpha: float = 32.0
    """Scale numerator: the adapter's output is multiplied by alpha / rank; must be > 0."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training, in [0, 1)."""
    target_modules: list[str] = field(default_factory=lambda: [ALL_LINEAR])
    """Linear layers to adapt, each name matching module paths that end with it ('q_proj', 'mlp.down_proj',
    'layers.0.self_attn.q_proj'), or ['all-linear']: every linear layer of the backbone (not the LM head, not
    a value head, not a mixture-of-experts model's fused experts: see target_parameters). May be [] when
    target_parameters names something."""
    target_parameters: list[str] = field(default_factory=list)
    """Fused expert weights of a mixture-of-experts model to adapt (PEFT's `target_parameters`): each name matching
    parameter paths that end with it ('experts.gate_up_proj', 'mlp.experts.down_proj',
    'layers.0.mlp.experts.gate_up_proj'), or ['all-experts']: every MoE layer's gate_up_proj and down_proj. Each
    expert gets its own A and B (rank `rank`). [] (the default): the experts stay frozen. Needs dropout 0."""
    init: Literal["default", "gaussian", "random"] = "default"
    """Adapter initialisation: 'default' (A Kaiming-uniform, B zero: the model starts as the base model),
    'gaussian' (A normal with std 1/rank, B zero), 'random' (A and B both random: the adapters change the
    model from the start; for tests and experiments)."""

    def __post_init__(self) -> None:
        check_choices(self)
        check(self.rank > 0, "rank", f"must be > 0, got {self.rank}")
        check(self.alpha > 0, "alpha", f"must be > 0, got {self.alpha}")
        check(0 <= self.dropout < 1, "dropout", f"must be in [0, 1), got {self.dropout}")
        check(
            len(self.target_modules) > 0 or len(self.target_parameters) > 0,
            "target_modules",
            f"expected at least one module name or '{ALL_LINEAR}' (or expert weights in target_parameters)",
        )
        for key, names, everything, what in (
            ("target_modules", self.target_modules, ALL_LINEAR, ("module", "linear layer")),
            ("target_parameters", self.target_parameters, ALL_EXPERTS, ("parameter", "expert weight")),
        ):
            check(all(isinstance(t, str) and t.strip() for t in names), key, f"expected non-empty {what[0]} "
                  f"names, got {names}")  # fmt: skip
            check(everything not in names or len(names) == 1, key,
                  f"'{everything}' already covers every {what[1]}: give it alone, got {names}")  # fmt: skip
        check(
            not self.target_parameters or self.dropout == 0,
            "dropout",
            f"must be 0 with target_parameters (PEFT's adapters on expert weights have no dropout), got {self.dropout}",
        )

    @property
    def scaling(self) -> float:
        """alpha / rank: the factor on the adapter's output."""
        return self.alpha / self.rank
