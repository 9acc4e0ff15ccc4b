"""`apply_parallelism`: everything that turns a single-device Hugging Face model into the training model, in one
place and one order (models stay single-device code; this runs after they are built):

1. attention plug-in: packed rows ("remove padding") attend per sample through rlx's registered attention
   function, which under sequence parallelism (sp > 1) also trades sequence shards for head shards (Ulysses);
2. torch.compile of each decoder layer's forward (the forward only: FSDP's and checkpointing's hooks stay
   outside the compiled code);
3. activation checkpointing of each decoder layer (recomputed in the backward);
4. FSDP2: `fully_shard` per decoder layer, then the root, with mixed precision and optional CPU offload
   (under a launcher only; a lone process keeps the plain module); with ep_degree > 1 each MoE layer's experts
   are first split over expert-parallel groups and sharded as units of their own (rlx/parallel/experts.py);
   a lone process instead runs an MoE model's experts in autocast's dtype, as autocast runs its linear layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlx.errors import UserError
from rlx.models.exact import checkpoint_contexts
from rlx.models.family import family_of
from rlx.parallel.dist import DistContext
from rlx.parallel.fsdp import apply_fsdp, decoder_layers
from rlx.parallel.ulysses import enable_ulysses_attention, validate_sp


@dataclass(frozen=True)
class ParallelPlan:
    """What `apply_parallelism` applies to a model."""

    packed_attention: bool = False
    """Plug in packed (and, with sp > 1, Ulysses) attention."""
    compile: bool = False
    """torch.compile each decoder layer's forward."""
    activation_checkpointing: bool = False
    """Recompute decoder-layer activations in the backward."""
    param_dtype: torch.dtype = torch.float32
    """FSDP's compute dtype for gathered parameters (gradients reduce in float32)."""
    offload: bool = False
    """FSDP: keep parameter shards, gradients and optimizer state on the CPU."""
    ep_degree: int = 1
    """Expert parallelism of MoE models: ranks per group splitting each layer's experts (rlx/parallel/experts.py)."""


def apply_parallelism(model: torch.nn.Module, ctx: DistContext, plan: ParallelPlan, where: str = "model"):
    """Apply `plan` to `model` (moved to ctx.device) in the documented order; returns the model."""
    model = model.to(ctx.device)
    if ctx.sp_degree > 1 and not plan.packed_attention:
        raise UserError(f"sequence parallelism (sp_degree {ctx.sp_degree}) needs use_packing ({where})")
    if plan.offload and not ctx.distributed:
        raise UserError("param_offload needs FSDP: launch with torchrun (--nproc_per_node 1 is fine)")
    if plan.ep_degree > 1:
        from rlx.parallel.experts import validate_ep

        validate_ep(model, ctx, plan.ep_degree)
    if plan.packed_attention:
        validate_sp(model.config, ctx.sp_degree)
        enable_ulysses_attention(model, decoder_only=family_of(model.config).attention_scope == "decoder")
    if plan.compile:
        steady_compile_settings()
        for layer in decoder_layers(model):
            layer.forward = torch.compile(layer.forward, dynamic=True)
    if plan.activation_checkpointing:
        # exact mode's layers recomputed inside exact mode (checkpoint_contexts)
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": checkpoint_contexts}
        )
    if shards_models(ctx, plan.offload):
        apply_fsdp(model, ctx, plan.param_dtype, plan.offload, plan.ep_degree)
    elif family_of(model.config).routed_experts:  # float32 weights under autocast: experts in autocast's dtype
        from rlx.parallel.experts import use_autocast_experts

        use_autocast_experts(model)
    return model


def shards_models(ctx: DistContext, offload: bool = False) -> bool:
    """Whether models are FSDP-sharded: under a launcher with several processes, or with CPU offload (FSDP's). A
    launcher with one process trains as a plain process does (float32 weights, bf16 autocast): FSDP over one rank
    only added its casts and copies (the 0.5B GRPO step on an H100: 1.89 s under torchrun against 1.60-1.65 s)."""
    return ctx.distributed and (ctx.world > 1 or offload)


def steady_compile_settings() -> None:
    """Process-wide Inductor settings that keep a compiled layer's graph valid for every packed length. Inductor fuses
    the RMSNorm backward's two reductions (over the tokens and over the hidden size) only above a size, and guards
    the graph on that size: a run whose first micro-batch was large compiled the layer again at the first small one
    (SmolLM2-135M on an H100: 8.8 s at step 4, guard `576 * T >= 5242880`). Non-strict mode drops those size checks."""
    from torch._inductor import config

    if hasattr(config.triton, "mix_order_reduction_non_strict_mode"):
        config.triton.mix_order_reduction_non_strict_mode = True
