"""Model FLOPs of dense decoder-only transformers (Llama, Qwen2, Qwen3, Apertus) and MFU. No torch import.

Convention (the one of the PaLM/Megatron MFU papers, with exact causal attention):
- only matrix multiplications count, 2*m*n*k FLOPs for an [m, k] x [k, n] product; norms, rotary
  embeddings, activations, softmax, biases and the embedding lookup are left out;
- per token and layer: Q, K, V and output projections, 2*h*(q + 2*kv + q) with q = heads*head_dim
  and kv = kv_heads*head_dim (grouped-query attention shrinks K and V); the MLP, 2*h*i per matrix,
  3 matrices when gated (gate, up, down: Llama, Qwen) and 2 for Apertus (up, down);
- mixture-of-experts layers (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE) count what one token runs: the router,
  2*h*experts, its top-k experts' gated MLPs, 3*2*h*i_expert each, and a shared expert where there is one
  (Qwen2-MoE: 3*2*h*i_shared plus its 1-output gate, 2*h); dense layers between them count as dense;
- per token: the LM head, 2*h*vocab, whether or not it is tied to the embedding (tying changes the
  parameter count, not the matmul work);
- causal attention of a sequence of L tokens: query i attends to keys 0..i, L*(L+1)/2 pairs, and
  the score (QK^T) and value (PV) products cost 2*head_dim FLOPs per pair and head each, so
  4 * heads * head_dim * L*(L+1)/2 per layer (about 2*2*L*L/2*heads*head_dim); nothing is counted
  for masked-out pairs even where a kernel computes them;
- mode 'forward' counts one forward pass; 'train' counts forward + backward = 3x forward (the
  backward computes gradients of activations and of weights, 2x forward).

`config` is a transformers PretrainedConfig or the dict of a config.json.
"""

from __future__ import annotations

from typing import Any

from rlx.errors import UserError

MODES = {"forward": 1.0, "train": 3.0, "train_frozen": 2.0}
"""x a forward: 'train' adds the backward's input and weight gradients; 'train_frozen' (a LoRA policy, whose frozen
base computes no weight gradients; its small adapters are not counted) only the input gradients."""
# families whose MLP has no gate (up -> activation -> down)
UNGATED_MLP_FAMILIES = ("apertus",)
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
"""config.json keys whose non-zero value marks a mixture-of-experts model (the plan and the fast path read them too)."""
_COUNTED_MOE_KEYS = ("num_experts", "num_local_experts")  # Qwen2/Qwen3-MoE and OLMoE; Mixtral


def _get(config: Any, key: str, default: Any = None) -> Any:
    value = config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)
    return default if value is None else value


def _shape(config: Any) -> dict[str, int]:
    """The sizes the count needs, with a UserError naming a missing key or an unsupported (MoE) model."""
    if hasattr(config, "get_text_config"):  # a vision-language model: its decoder (the vision tower is not counted)
        config = config.get_text_config()
    for key in MOE_KEYS:
        if _get(config, key, 0) and (key not in _COUNTED_MOE_KEYS or not _get(config, "num_experts_per_tok", 0)):
            raise UserError(
                f"FLOPs counting supports dense models and Qwen-MoE / Mixtral / OLMoE routing only; this config has "
                f"{key}={_get(config, key)}"
            )
    shape = {}
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        value = _get(config, key)
        if not isinstance(value, int) or value <= 0:
            raise UserError(f"model config: '{key}' must be a positive integer to count FLOPs, got {value!r}")
        shape[key] = value
    shape["num_key_value_heads"] = int(_get(config, "num_key_value_heads", shape["num_attention_heads"]))
    shape["head_dim"] = int(_get(config, "head_dim", shape["hidden_size"] // shape["num_attention_heads"]))
    shape["mlp_matrices"] = 2 if _get(config, "model_type", "") in UNGATED_MLP_FAMILIES else 3
    return shape


def layer_flops_per_token(config: Any) -> float:
    """Projection + MLP matmul FLOPs of one token through all layers (attention scores/values excluded)."""
    s = _shape(config)
    h, q, kv = s["hidden_size"], s["num_attention_heads"] * s["head_dim"], s["num_key_value_heads"] * s["head_dim"]
    attention_proj = 2 * h * q + 2 * 2 * h * kv + 2 * q * h
    mlp = s["mlp_matrices"] * 2 * h * s["intermediate_size"]
    routed = _routed_layers(config, s["num_hidden_layers"])
    dense = s["num_hidden_layers"] - routed
    moe = routed * _moe_mlp_flops(config, h) if routed else 0
    return float(s["num_hidden_layers"] * attention_proj + dense * mlp + moe)


def _text(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _routed_layers(config: Any, num_layers: int) -> int:
    """How many layers route to experts: every layer of Mixtral and OLMoE; Qwen-MoE's every `decoder_sparse_step`-th
    layer outside `mlp_only_layers`; none for a dense model."""
    config = _text(config)
    if not any(_get(config, key, 0) for key in _COUNTED_MOE_KEYS):
        return 0
    step, dense_only = int(_get(config, "decoder_sparse_step", 1)), set(_get(config, "mlp_only_layers", []))
    return sum(1 for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0)


def _moe_mlp_flops(config: Any, h: int) -> float:
    """One token through one MoE layer: router, top-k gated experts, the shared expert and its gate if any."""
    config = _text(config)
    experts = int(_get(config, "num_experts", 0) or _get(config, "num_local_experts", 0))
    expert_size = int(_get(config, "moe_intermediate_size", 0) or _get(config, "intermediate_size"))
    shared = int(_get(config, "shared_expert_intermediate_size", 0))
    top_k = int(_get(config, "num_experts_per_tok"))
    return 2 * h * experts + top_k * 3 * 2 * h * expert_size + (3 * 2 * h * shared + 2 * h if shared else 0)


def lm_head_flops_per_token(config: Any) -> float:
    """LM-head matmul FLOPs for one position's logits: 2 * hidden * vocab."""
    s = _shape(config)
    return float(2 * s["hidden_size"] * s["vocab_size"])


def attention_flops(config: Any, num_pairs: int) -> float:
    """Score and value matmul FLOPs, all layers, for `num_pairs` (query, key) pairs: 4*pairs*heads*head_dim*layers."""
    s = _shape(config)
    return float(4 * num_pairs * s["num_attention_heads"] * s["head_dim"] * s["num_hidden_layers"])


def causal_pairs(length: int) -> int:
    """(query, key) pairs of a causal sequence: query i sees keys 0..i, L*(L+1)/2 in all."""
    return length * (length + 1) // 2


def count_flops(config: Any, seq_lens: list[int], mode: str) -> float:
    """Matmul FLOPs of running the model over sequences of the given (unpadded) lengths.

    Every position gets logits (as in training and scoring). seq_lens: tokens per sequence
    (prompt + response), padding excluded. mode: 'forward' (x1) or 'train' (forward + backward, x3).
    Returns total FLOPs as a float.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if any(n < 0 for n in seq_lens):
        raise ValueError(f"sequence lengths must be >= 0, got {seq_lens}")
    tokens = sum(seq_lens)
    per_token = layer_flops_per_token(config) + lm_head_flops_per_token(config)
    total = tokens * per_token + attention_flops(config, sum(causal_pairs(n) for n in seq_lens))
    return MODES[mode] * total


def count_generate_flops(config: Any, prompt_lens: list[int], response_lens: list[int]) -> float:
    """Matmul FLOPs of sampling responses with a KV cache (forward only).

    Per sample with prompt length P and response length R >= 1: a prefill over the P prompt tokens
    (causal attention, logits at the last position only), then R - 1 decode steps, each feeding one
    sampled token that attends to every cached key and itself (step j sees P + j keys, j = 1..R-1);
    each decode step computes one position's logits. The last sampled token is never fed back.
    Projection, MLP and attention work therefore equal a forward over P + R - 1 tokens, and the LM
    head runs R times. Returns total FLOPs as a float.
    """
    if len(prompt_lens) != len(response_lens):
        raise ValueError(f"{len(prompt_lens)} prompt lengths but {len(response_lens)} response lengths")
    fed_tokens = logits = pairs = 0
    for p, r in zip(prompt_lens, response_lens):
        if p < 1 or r < 0:
            raise ValueError(f"need prompt length >= 1 and response length >= 0, got ({p}, {r})")
        fed = p + max(r - 1, 0)
        fed_tokens += fed
        logits += r
        pairs += causal_pairs(fed)  # prefill pairs + sum of the decode steps' (P + j) keys
    return (
        fed_tokens * layer_flops_per_token(config)
        + logits * lm_head_flops_per_token(config)
        + attention_flops(config, pairs)
    )


def count_params(config: Any, include_embeddings: bool = True) -> int:
    """Weight-matrix parameters (norms and biases left out): layers, plus the embedding and an untied LM head.

    Tied embeddings share one vocab x hidden matrix; untied ones have two. For the familiar
    6 * params * tokens estimate, pass include_embeddings=False.
    """
    s = _shape(config)
    per_token_layers = layer_flops_per_token(config) / 2  # 2 FLOPs per weight per token
    params = int(per_token_layers)
    if include_embeddings:
        matrices = 1 if _get(config, "tie_word_embeddings", False) else 2
        params += matrices * s["vocab_size"] * s["hidden_size"]
    return params


# Dense (no sparsity) bf16/fp16 tensor-core peaks, FLOP/s, from the vendors' data sheets. Matched in
# order on the device name, lower-cased with spaces, '-' and '_' removed: the first substring found wins.
DEVICE_PEAK_FLOPS: list[tuple[str, float, str]] = [
    ("h100pcie", 756e12, "NVIDIA H100 PCIe, bf16 dense"),
    ("h100nvl", 835e12, "NVIDIA H100 NVL, bf16 dense"),
    ("h100", 989e12, "NVIDIA H100 SXM, bf16 dense"),
    ("h200", 989e12, "NVIDIA H200 SXM, bf16 dense"),
    ("a100", 312e12, "NVIDIA A100 (SXM4 and PCIe), bf16 dense"),
    ("ascend910b", 376e12, "Huawei Ascend 910B, fp16/bf16, nominal (varies by 910B1-B4 bin)"),
    ("910b", 376e12, "Huawei Ascend 910B, fp16/bf16, nominal (varies by 910B1-B4 bin)"),
    ("cpu", 1e12, "nominal CPU figure (1 TFLOP/s): MFU on CPU is only a relative number"),
]


def device_peak_flops(device_name: str) -> float:
    """Peak dense bf16 FLOP/s of one device, from its name as torch reports it.

    Accepts torch.cuda.get_device_name() strings ('NVIDIA H100 80GB HBM3', 'NVIDIA H200',
    'NVIDIA A100-SXM4-80GB'), torch.npu.get_device_name() strings ('Ascend910B2') and 'cpu'.
    Returns 0.0 for an unknown device: callers then leave perf/mfu out.
    """
    key = device_name.lower().replace(" ", "").replace("-", "").replace("_", "")
    for pattern, peak, _ in DEVICE_PEAK_FLOPS:
        if pattern in key:
            return peak
    return 0.0


def mfu(flops: float, seconds: float, peak: float, num_devices: int = 1) -> float:
    """Model FLOPs utilisation: flops / (seconds * peak * num_devices), a fraction in [0, 1] for real work.

    Raises ValueError when seconds, peak or num_devices is not positive (an unknown device has peak 0).
    """
    if seconds <= 0 or peak <= 0 or num_devices < 1:
        raise ValueError(f"mfu needs seconds > 0, peak > 0 and num_devices >= 1, got {seconds}, {peak}, {num_devices}")
    return flops / (seconds * peak * num_devices)
