"""Mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE): what rlx knows of their routed experts.

transformers 5.17 keeps each MoE layer's experts as fused parameters (`mlp.experts.gate_up_proj` [E, 2I, H] and
`mlp.experts.down_proj` [E, H, I]); the hub's files (and `save_pretrained`) hold one tensor per expert, which
rlx.models.hub_layout converts with transformers' own mapping, so rlx holds the module's (fused) names everywhere
inside (checkpoints, training, scoring) and writes the hub's per-expert layout back on `rlx merge`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from rlx.models.bundle import ModelFamily


@dataclass(frozen=True, kw_only=True)
class MoeFamily(ModelFamily):
    """A text decoder whose MLPs are routed experts (a `ModelFamily` with the expert weight layout)."""

    routed_experts: ClassVar[bool] = True
    model_type: str
    """config.model_type of the family."""

    def expert_modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The routed-experts modules of `model`'s MoE layers, in layer order: transformers' `*Experts` modules
        holding the fused `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] (a shared expert is not one)."""
        return [
            m
            for m in model.modules()
            if type(m).__name__.endswith("Experts") and all(hasattr(m, n) for n in ("gate_up_proj", "down_proj"))
        ]


MOE_FAMILIES: dict[str, MoeFamily] = {
    f.model_type: f
    for f in (
        MoeFamily(name="qwen3_moe", title="Qwen3-MoE", model_type="qwen3_moe"),
        MoeFamily(name="qwen2_moe", title="Qwen2-MoE", model_type="qwen2_moe"),
        MoeFamily(name="mixtral", title="Mixtral", model_type="mixtral"),
        MoeFamily(name="olmoe", title="OLMoE", model_type="olmoe"),
    )
}
"""The MoE families rlx drives (transformers' fused experts with a per-expert hub layout)."""


def tiny_moe_config(vocab_size: int, model_type: str = "qwen3_moe", num_experts: int = 4, top_k: int = 2, **sizes):
    """A small MoE config of `model_type` (every layer routed, tied embeddings) whose special ids match
    `rlx.models.tiny.build_char_tokenizer`; `sizes` override hidden_size (32), num_hidden_layers (2) etc."""
    import transformers

    if model_type not in MOE_FAMILIES:
        raise ValueError(f"no tiny MoE config for {model_type!r} (known: {', '.join(MOE_FAMILIES)})")
    experts = {"mixtral": "num_local_experts"}.get(model_type, "num_experts")
    kwargs = dict(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, num_experts_per_tok=top_k, **{experts: num_experts},
    )  # fmt: skip
    if model_type in ("qwen3_moe", "qwen2_moe"):
        kwargs.update(moe_intermediate_size=16, decoder_sparse_step=1, mlp_only_layers=[])
    if model_type == "qwen2_moe":
        kwargs.update(shared_expert_intermediate_size=16)
    kwargs.update(sizes)
    return transformers.AutoConfig.for_model(model_type, **kwargs)


def write_tiny_moe_model_dir(out: str | Path, model_type: str = "qwen3_moe", seed: int = 0, **config_kwargs) -> Path:
    """A tiny MoE Hugging Face dir with random weights (seed), written by transformers' `save_pretrained` in the
    hub's per-expert layout, and the character tokenizer."""
    from transformers import AutoModelForCausalLM

    from rlx.models.tiny import build_char_tokenizer

    out = Path(out)
    tokenizer = build_char_tokenizer()
    config = tiny_moe_config(len(tokenizer), model_type, **config_kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def router_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The routers of `model`'s MoE layers, in layer order: transformers' `*TopKRouter` modules (Qwen3-MoE,
    Qwen2-MoE, Mixtral, OLMoE), each returning (router_logits [N, E], top-k weights [N, k], top-k experts [N, k])."""
    return [m for _, m in _named_routers(model)]


def router_layer_indices(model: torch.nn.Module) -> list[int]:
    """The indices of the decoder layers holding `router_modules(model)` (`layers.N.` in each router's name), in
    order: the layer axis of recorded routes among all decoder layers."""
    return [int(name.split("layers.")[-1].split(".")[0]) for name, _ in _named_routers(model)]


def _named_routers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if type(m).__name__.endswith("TopKRouter")]


class RouterProbe:
    """While open, forward hooks on every router keep each forward's router logits [N, E] (with their graph) and
    the experts each token was sent to [N, k]; `aux_loss` and `expert_load` read them. Nothing is changed in the
    forward. Under activation checkpointing a layer's recomputed forward calls the hook again: only the first
    call of each router per `reset` counts."""

    def __init__(self, model: torch.nn.Module):
        self.routers = router_modules(model)
        self.logits: dict[int, torch.Tensor] = {}
        self.experts: dict[int, torch.Tensor] = {}
        self._handles: list = []

    def __enter__(self) -> RouterProbe:
        self.reset()
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def reset(self) -> None:
        self.logits, self.experts = {}, {}

    def _hook(self, index: int):
        def hook(module, args, output):
            if index not in self.logits:  # a recomputation (activation checkpointing) is not a second forward
                self.logits[index], self.experts[index] = output[0], output[2].detach()

        return hook

    def aux_loss(self, num_experts: int, top_k: int) -> torch.Tensor:
        """The Switch-Transformer load-balancing loss averaged over layers: E * sum_e f_e * p_e, where f_e is the
        fraction of routed (token, slot) pairs sent to expert e and p_e its mean router probability (1.0 when the
        load is uniform). Every routed token counts (packed rows have no padding)."""
        losses = []
        for index, logits in self.logits.items():
            probs = torch.softmax(logits.float(), dim=-1)  # [N, E]
            chosen = torch.nn.functional.one_hot(self.experts[index], num_experts).float()  # [N, k, E]
            fraction = chosen.sum(dim=(0, 1)) / max(chosen.shape[0] * top_k, 1)
            losses.append(num_experts * (fraction * probs.mean(0)).sum())
        return torch.stack(losses).mean() if losses else torch.zeros(())

    def z_loss(self) -> torch.Tensor:
        """The router z-loss (ST-MoE) averaged over layers: the mean over routed tokens of logsumexp(logits)^2,
        which keeps the router logits small (float32)."""
        losses = [torch.logsumexp(logits.float(), dim=-1).square().mean() for logits in self.logits.values()]
        return torch.stack(losses).mean() if losses else torch.zeros(())

    def expert_load(self, num_experts: int) -> torch.Tensor:
        """Routed (token, slot) pairs per expert, summed over layers: [E] float."""
        counts = [torch.bincount(e.flatten(), minlength=num_experts).float() for e in self.experts.values()]
        return torch.stack(counts).sum(0) if counts else torch.zeros(num_experts)


def moe_sizes(config) -> tuple[int, int] | None:
    """(number of experts, experts per token) of an MoE config, or None for a dense model."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    return (int(experts), int(top_k)) if experts and top_k else None


def write_tiny_moe_config_dir(out: str | Path, model_type: str = "qwen3_moe", **config_kwargs) -> Path:
    """config.json + the character tokenizer of a tiny MoE (no weights: `init = "random"` initialises them)."""
    from rlx.models.tiny import build_char_tokenizer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer()
    tiny_moe_config(len(tokenizer), model_type, **config_kwargs).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Write a tiny MoE's config.json and tokenizer (no weights).")
    parser.add_argument("--out", required=True, help="folder to write")
    parser.add_argument("--model-type", default="qwen3_moe", choices=list(MOE_FAMILIES))
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-experts", type=int, default=4)
    args = parser.parse_args()
    write_tiny_moe_config_dir(
        args.out, args.model_type, num_experts=args.num_experts, hidden_size=args.hidden_size, moe_intermediate_size=64
    )


if __name__ == "__main__":
    main()
