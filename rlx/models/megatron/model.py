"""Build a Llama-family model (Llama, Qwen2 with QKV bias) or an MoE (Qwen3-MoE, Qwen2-MoE, Mixtral) as a
megatron-core `GPTModel` stage.

Each rank builds its own pipeline stage (`pre_process` on the first: embedding; `post_process` on
the last: final norm and the LM head or a critic's scalar value head) with its tensor-parallel slice
of every linear layer. Attention inside the layers is rlx's: `CoreAttention` attends within each
packed sequence (megatron's THD format, `cu_seqlens`) with the kernels of rlx/models/attention.py
(flash-attn varlen when installed, torch's varlen, or exact SDPA per sequence).

An MoE model gets megatron-core's MoE layer in every decoder layer: its top-k router (softmax over the top-k
logits when the model normalises its top-k probabilities, as Mixtral always does, else top-k of the softmax: both
are transformers' routing), SwiGLU experts run one after another (`SequentialMLP`, no grouped GEMM, so the
CPU runs it) and the all-to-all token dispatcher over `expert_model_parallel_size` ranks. Qwen3-MoE adds per-head
RMSNorm on queries and keys (qk-layernorm); Qwen2-MoE adds q/k/v biases and its shared expert (megatron's
`SharedExpertMLP`, split by tensor parallelism like a dense MLP, its output times sigmoid(gate . x) as in
transformers). OLMoE is refused: its q/k norms normalise the whole projection, which megatron's per-head
qk-layernorm cannot express. Under tensor parallelism an MoE model runs megatron-core's
sequence parallelism (as its MoE layer requires): between the attention and MoE blocks each tensor-parallel rank
holds 1/tp of the packed row's tokens (the norms and router run on those, the attention's linear layers gather and
reduce-scatter them); the experts are not split by tensor parallelism (`expert_tensor_parallel_size` 1): each rank
runs its tokens through whole experts. The norms are `RMSNorm` below (megatron's torch fallback refuses sequence
parallelism); their and the router's weights see only their rank's tokens, so their gradients are summed over the
tensor-parallel group (`tensor_parallel_partial`).

Only packed inputs are used: a micro-batch is one row of concatenated samples whose rotary positions restart per
sample, so there is no padding to mask (under sequence parallelism the row is padded to a multiple of tp with one
more sample, dropped again at the head: rlx/backends/megatron/schedule.py). The vocabulary is padded to a multiple
of the tensor-parallel degree; `vocab_size` says how many rows are real (rlx never reads the rest).
"""

from __future__ import annotations

import copy
import math

import torch

from rlx.errors import UserError
from rlx.models.attention import varlen_attention
from rlx.models.megatron import compat
from rlx.models.megatron.routing import attach_routing

FAMILIES = ("llama", "qwen2", "qwen3_moe", "qwen2_moe", "mixtral")
"""Hugging Face model types the megatron backend builds (as causal LMs, or value models)."""
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")
"""The mixture-of-experts ones among them (megatron-core's MoE layer in every decoder layer)."""
REFUSED = {
    "olmoe": "its q/k RMSNorm normalises the whole q and k projections, and megatron-core's qk-layernorm normalises "
    "each head; train it with the FSDP backend (the 'single' or 'fsdp' layout; backend = 'fsdp' in a recipe)"
}
"""Families rlx runs elsewhere that the megatron backend cannot build exactly, and why."""


def is_moe(hf_config) -> bool:
    return getattr(hf_config, "model_type", None) in MOE_FAMILIES


def num_experts(hf_config) -> int:
    """Routed experts per layer of an MoE config (Mixtral: `num_local_experts`)."""
    return hf_config.num_local_experts if hf_config.model_type == "mixtral" else hf_config.num_experts


def has_qk_norm(hf_config) -> bool:
    """Whether the model normalises each query and key head (Qwen3-MoE; megatron's qk-layernorm)."""
    return hf_config.model_type == "qwen3_moe"


def shared_expert_size(hf_config) -> int | None:
    """The width of an MoE layer's shared expert (Qwen2-MoE), or None."""
    return getattr(hf_config, "shared_expert_intermediate_size", None) if hf_config.model_type == "qwen2_moe" else None


def expert_size(hf_config) -> int:
    """The width of one routed expert (Mixtral's experts are `intermediate_size` wide)."""
    return hf_config.intermediate_size if hf_config.model_type == "mixtral" else hf_config.moe_intermediate_size


def norm_topk_prob(hf_config) -> bool:
    """Whether the router renormalises its top-k probabilities (Mixtral always does)."""
    return True if hf_config.model_type == "mixtral" else bool(hf_config.norm_topk_prob)


def padded_vocab_size(vocab_size: int, tp_degree: int) -> int:
    """Rows of the (vocab-parallel) embedding and LM head: the vocabulary rounded up to split evenly."""
    return math.ceil(vocab_size / tp_degree) * tp_degree


def rope_theta(hf_config) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    scaling = params.get("rope_type", "default") if isinstance(params, dict) else "default"
    if scaling not in (None, "default"):
        raise UserError(f"rope scaling {scaling!r} is not supported by the megatron backend (only plain RoPE)")
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta if theta is not None else getattr(hf_config, "rope_theta", 10000.0))


def check_moe(hf_config, tp_degree: int, ep_degree: int, where: str) -> None:
    """Raise a UserError naming what of an MoE config (or an expert-parallel degree) the megatron backend lacks."""
    if not is_moe(hf_config):
        if ep_degree != 1:
            names = ", ".join(MOE_FAMILIES)
            raise UserError(f"{where}: ep_degree {ep_degree} needs a mixture-of-experts model ({names})")
        return
    if getattr(hf_config, "decoder_sparse_step", 1) != 1:
        raise UserError(
            f"{where}: decoder_sparse_step {hf_config.decoder_sparse_step}: the megatron backend needs every layer "
            "routed (decoder_sparse_step 1)"
        )
    if getattr(hf_config, "mlp_only_layers", None):
        raise UserError(
            f"{where}: mlp_only_layers {list(hf_config.mlp_only_layers)}: the megatron backend needs every layer "
            "routed (mlp_only_layers empty)"
        )
    if getattr(hf_config, "router_jitter_noise", 0.0):
        raise UserError(f"{where}: router_jitter_noise {hf_config.router_jitter_noise} is not supported (0 only)")
    shared = shared_expert_size(hf_config)
    if shared is not None and shared % tp_degree:
        raise UserError(f"{where}: --tp {tp_degree} does not divide the shared expert's width {shared}")
    experts = num_experts(hf_config)
    if ep_degree < 1 or experts % ep_degree:
        raise UserError(f"{where}: ep_degree {ep_degree} must divide the {experts} experts per layer")


def check_supported(hf_config, tp_degree: int, pp_degree: int, where: str = "model", ep_degree: int = 1) -> None:
    """Raise a UserError naming what does not fit the megatron backend."""
    family = getattr(hf_config, "model_type", None)
    if family in REFUSED:
        raise UserError(f"{where}: model type {family!r} is not supported by the megatron backend: {REFUSED[family]}")
    if family not in FAMILIES:
        names = ", ".join(FAMILIES)
        raise UserError(f"{where}: model type {family!r} is not supported by the megatron backend ({names})")
    check_moe(hf_config, tp_degree, ep_degree, where)
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    if tp_degree < 1 or pp_degree < 1:
        raise UserError(f"{where}: tp and pp degrees must be at least 1 (got tp {tp_degree}, pp {pp_degree})")
    if heads % tp_degree:
        raise UserError(f"{where}: --tp {tp_degree} does not divide the {heads} attention heads")
    if kv_heads % tp_degree:
        raise UserError(f"{where}: --tp {tp_degree} does not divide the {kv_heads} key/value heads")
    if not is_moe(hf_config) and hf_config.intermediate_size % tp_degree:
        raise UserError(f"{where}: --tp {tp_degree} does not divide the MLP width {hf_config.intermediate_size}")
    if hf_config.num_hidden_layers % pp_degree:
        raise UserError(f"{where}: --pp {pp_degree} does not divide the {hf_config.num_hidden_layers} layers")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise UserError(f"{where}: activation {hf_config.hidden_act!r} is not supported (SwiGLU/silu only)")
    has_output_bias = family in ("llama", "qwen3_moe", "mixtral") and getattr(hf_config, "attention_bias", False)
    if getattr(hf_config, "mlp_bias", False) or has_output_bias:
        raise UserError(f"{where}: biases on the MLP or attention output are not supported by the megatron backend")
    sliding = "sliding_attention" in (getattr(hf_config, "layer_types", None) or [])
    if getattr(hf_config, "use_sliding_window", False) or sliding:
        raise UserError(f"{where}: sliding-window attention is not supported by the megatron backend")
    if family == "mixtral" and hf_config.sliding_window is not None:
        raise UserError(
            f"{where}: sliding_window {hf_config.sliding_window}: the megatron backend attends to the whole sequence "
            "(sliding_window must be null)"
        )
    rope_theta(hf_config)


def has_qkv_bias(hf_config) -> bool:
    if hf_config.model_type == "qwen2_moe":
        return bool(getattr(hf_config, "qkv_bias", True))
    return hf_config.model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False))


def head_dim(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def is_sequence_parallel(hf_config, tp_degree: int) -> bool:
    """Whether the model runs megatron-core's sequence parallelism: an MoE model under tensor parallelism (dense
    models keep the whole row on every tensor-parallel rank)."""
    return is_moe(hf_config) and tp_degree > 1


def moe_options(hf_config, ep_degree: int, aux_loss_coef: float = 0.0) -> dict:
    """TransformerConfig fields of an MoE config: megatron-core's MoE layer as transformers routes (float32 router
    softmax), experts split over `ep_degree` ranks and not by tensor parallelism. rlx's load-balancing coefficient
    averages over layers, megatron's loss adds up per layer: it is divided by the number of layers. megatron's
    z-loss stays off: rlx's (rlx/models/megatron/routing.py) leaves the sequence-parallel padding out."""
    if not is_moe(hf_config):
        return {}
    layers = hf_config.num_hidden_layers
    return dict(
        num_moe_experts=num_experts(hf_config),
        moe_router_topk=hf_config.num_experts_per_tok,
        moe_ffn_hidden_size=expert_size(hf_config),
        moe_router_pre_softmax=not norm_topk_prob(hf_config),  # softmax over all, then top-k (not renormalised)
        moe_shared_expert_intermediate_size=shared_expert_size(hf_config),
        moe_shared_expert_gate=shared_expert_size(hf_config) is not None,  # sigmoid(gate . x) times its output
        moe_shared_expert_overlap=False,
        moe_router_dtype="fp32",
        moe_grouped_gemm=False,
        moe_token_dispatcher_type="alltoall",
        moe_permute_fusion=False,
        moe_router_load_balancing_type="aux_loss" if aux_loss_coef else "none",
        moe_aux_loss_coeff=aux_loss_coef / layers,
        moe_z_loss_coeff=None,
        expert_model_parallel_size=ep_degree,
        expert_tensor_parallel_size=1,
        qk_layernorm=has_qk_norm(hf_config),
    )


def transformer_config(hf_config, tp_degree: int, pp_degree: int, **moe):
    """megatron-core's TransformerConfig for an HF Llama/Qwen2/MoE config (float32 parameters: rlx
    autocasts); `moe`: `moe_options`' arguments after the config (ep_degree, the load-balancing coefficient)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=head_dim(hf_config),
        ffn_hidden_size=hf_config.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=has_qkv_bias(hf_config),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp_degree,
        sequence_parallel=is_sequence_parallel(hf_config, tp_degree),
        pipeline_model_parallel_size=pp_degree,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        perform_initialization=False,  # weights always come from a checkpoint
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        pipeline_dtype=torch.float32,  # activations cross stages in float32 (rlx's schedule)
        **moe_options(hf_config, **({"ep_degree": 1} | moe)),
    )


def packed_rotary(model, position_ids: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [T, 1, D] float32 of each packed token's position, from the model's rotary embedding."""
    freqs = model.rotary_pos_emb(max_len)[position_ids.reshape(-1), 0]  # [T, 1, D]
    return torch.cos(freqs), torch.sin(freqs)


def packed_params(cu_seqlens: torch.Tensor, max_len: int, rotary: tuple[torch.Tensor, torch.Tensor]):
    """megatron's PackedSeqParams for one packed row (THD), carrying the per-token rotary cos/sin."""
    from megatron.core.packed_seq_params import PackedSeqParams

    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=max_len, max_seqlen_kv=max_len
    )
    params.rlx_rotary = rotary
    return params


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated by per-token cos/sin [T, 1, D] (rotate-half form, as HF and megatron)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat((-x2, x1), dim=-1) * sin.to(x.dtype)


class CoreAttention(torch.nn.Module):
    """megatron's core-attention slot filled with rlx's packed attention: query [T, H, D], key/value
    [T, Hkv, D] (this rank's heads) and the packing's `cu_seqlens` -> [T, H * D].

    Rotary embedding is applied here, per token from the packed positions (the decoder gets no
    `rotary_pos_emb`): megatron's own THD path splits the row per sample and syncs with the host."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None, **_):
        super().__init__()
        self.scale = softmax_scale

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise ValueError("rlx's megatron models take packed (THD) inputs only")
        cos, sin = packed_seq_params.rlx_rotary
        query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
        out = varlen_attention(
            query, key, value, packed_seq_params.cu_seqlens_q, int(packed_seq_params.max_seqlen_q), scale=self.scale
        )
        return out.reshape(out.shape[0], -1)


class RMSNorm:
    """megatron's norm slot filled with torch's RMSNorm, as its torch fallback (`WrappedTorchNorm`) fills it, but
    allowed under sequence parallelism: the weight is tagged `sequence_parallel` then (as megatron's fused norms tag
    theirs), its gradient being this rank's part (its tokens; for the q/k norms, its heads)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_):
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        norm.weight.sequence_parallel = config.sequence_parallel
        return norm


def layer_spec(hf_config=None, sequence_parallel: bool = False):
    """megatron-core's local (no Transformer Engine) GPT layer with RMSNorm and rlx's core attention; for an MoE
    config its MoE layer (sequential experts; a shared expert when the config sets one) and qk-layernorm (Qwen3-MoE);
    rlx's `RMSNorm` in every norm under sequence parallelism."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    moe = {}
    if hf_config is not None and is_moe(hf_config):
        moe = dict(num_experts=num_experts(hf_config), moe_grouped_gemm=False, qk_layernorm=has_qk_norm(hf_config))
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization="RMSNorm", **moe))
    attention = spec.submodules.self_attention.submodules
    attention.core_attention = CoreAttention
    if sequence_parallel:
        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = RMSNorm
        if moe.get("qk_layernorm"):
            attention.q_layernorm = attention.k_layernorm = RMSNorm
    return spec


def stage_spec(hf_config, tp_degree: int, pp_degree: int):
    """The decoder spec of one pipeline stage: `layer_spec`, or under sequence parallelism the block of its layers
    with rlx's `RMSNorm` as the final norm."""
    sequence_parallel = is_sequence_parallel(hf_config, tp_degree)
    spec = layer_spec(hf_config, sequence_parallel)
    if not sequence_parallel:
        return spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layers = hf_config.num_hidden_layers // pp_degree
    return TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=RMSNorm)


class ValueHead(torch.nn.Module):
    """A critic's scalar head on the last stage (replicated on every tensor-parallel rank)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.score = torch.nn.Linear(hidden_size, 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.score(hidden).squeeze(-1)


def is_critic_config(hf_config) -> bool:
    return (getattr(hf_config, "architectures", None) or [""])[0].endswith("ForTokenClassification")


def build_stage(hf_config, tp_degree: int, pp_degree: int, pp_rank: int, z_loss_coef: float = 0.0, **moe):
    """This rank's stage of the model (megatron's parallel state must already be initialised); `moe`:
    `moe_options`' arguments after the config (ep_degree, the load-balancing coefficient); `z_loss_coef`: rlx's
    router z-loss (an MoE stage's routing, averaged over layers as on the FSDP backend).

    A critic config (`*ForTokenClassification`) gets `value_head` in place of the LM head."""
    if is_moe(hf_config):
        compat.moe_apply()
    else:
        compat.apply()
    from megatron.core.models.gpt.gpt_model import GPTModel

    check_supported(hf_config, tp_degree, pp_degree, ep_degree=moe.get("ep_degree", 1))
    critic = is_critic_config(hf_config)
    first, last = pp_rank == 0, pp_rank == pp_degree - 1
    model = GPTModel(
        config=transformer_config(hf_config, tp_degree, pp_degree, **moe),
        transformer_layer_spec=stage_spec(hf_config, tp_degree, pp_degree),
        vocab_size=padded_vocab_size(hf_config.vocab_size, tp_degree),
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=first,
        post_process=last,
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)) and not critic,
        position_embedding_type="rope",
        rotary_base=rope_theta(hf_config),
    )
    if critic and last:
        model.output_layer = None
        model.value_head = ValueHead(hf_config.hidden_size)
    if is_moe(hf_config):  # routing replay, mismatch, expert load and the z-loss (rlx/models/megatron/routing.py)
        attach_routing(model, z_loss_coef / hf_config.num_hidden_layers)
    mark_tensor_parallel(model)
    # HF's Llama/Qwen2 embeddings take padding_idx = pad_token_id: that row gets no gradient from the
    # lookup (e.g. a sampled pad token in a response); kept so that both backends train alike
    model.padding_idx = getattr(hf_config, "pad_token_id", None)
    return model


def mark_tensor_parallel(model) -> None:
    """Tag the split parameters as megatron's initialisation would (it is skipped: weights come from a
    checkpoint), so that norms count replicated parameters once."""
    from megatron.core import tensor_parallel as mtp

    for module in model.modules():
        dim = {mtp.ColumnParallelLinear: 0, mtp.RowParallelLinear: 1, mtp.VocabParallelEmbedding: 0}.get(type(module))
        if dim is None:
            continue
        for name in ("weight", "bias"):
            param = getattr(module, name, None)
            if param is None or (name == "bias" and dim == 1):  # a row-parallel bias is replicated
                continue
            param.tensor_model_parallel = True
            param.partition_dim = dim if name == "weight" else 0
            param.partition_stride = 1


def tensor_parallel_partial(model) -> list[torch.nn.Parameter]:
    """The parameters replicated over the tensor-parallel group whose gradient each rank holds only part of (under
    sequence parallelism: the norms and routers, which see this rank's tokens; the q/k norms, its heads): their
    gradients are summed over the group (megatron's `_allreduce_non_tensor_model_parallel_grads`)."""
    return [p for p in model.parameters() if p.requires_grad and getattr(p, "sequence_parallel", False)]


def move_stage(model, device: torch.device):
    """`.to(device)`, and the rotary inverse frequencies (a plain attribute) along with it."""
    model.to(device)
    rotary = getattr(model, "rotary_pos_emb", None)
    if rotary is not None:
        rotary.inv_freq = rotary.inv_freq.to(device)
        rotary.forward.cache_clear()
    return model


def output_weight(model) -> torch.Tensor:
    """This rank's LM-head rows [V_pad / tp, H] (the embedding's when tied and on one stage)."""
    return (
        model.shared_embedding_or_output_weight()
        if model.share_embeddings_and_output_weights
        else model.output_layer.weight
    )
