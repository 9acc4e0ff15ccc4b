"""Decode steps of Llama-family layers with merged projections: fewer, larger kernels per layer.

A decode step reads every weight once for a few hundred tokens at most, so its time goes to the count of kernels
(about 15 a layer through the Hugging Face layer) more than to their work. Here the query, key and value
projections are one GEMM over one [q; k; v] weight, the gate and up projections one GEMM over [gate; up], the rotary
positions are applied inside the attention kernel (with the cache write, on the GEMM's output as it lies), and a
layer hands its residual stream to the next one, so the residual addition fuses with the next layer's norm.

The merged weights cost no memory: `merge_projections` lays each layer's q/k/v (and gate/up) weights out as rows of
one tensor and makes the parameters views of it (the Parameter objects stay the same), so every in-place update of
the parameters (a replica's refill, a weight sync) updates the merged tensors too. Only a model the engine owns is
re-laid out this way (a replica, or a model whose parameters nothing trains); the prefill and every other path
still run the Hugging Face layers on the same storage.

Which layers qualify (`fusable`): Llama, Qwen2, Qwen3 and Mistral decoders with plain `nn.Linear` projections (no
LoRA layers), SiLU MLPs and text rotary positions. Others decode through the Hugging Face layers as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
"""model_type values whose decoder layer `fused_layer_step` reproduces."""

_ATTN = ("q_proj", "k_proj", "v_proj")
_MLP = ("gate_proj", "up_proj")


@dataclass
class FusedLayer:
    """One decoder layer's decode weights: views of the model's own parameters (no copies)."""

    ln1: torch.Tensor
    ln2: torch.Tensor
    qkv: torch.Tensor
    """[(H + 2 Hkv) D, C]: the q, k and v projection weights as rows of one tensor."""
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor
    """[2 I, C]: the gate and up projection weights."""
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    """Qwen3's per-head query and key norms (None elsewhere)."""
    k_norm: torch.Tensor | None

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        return (self.ln1, self.ln2, self.qkv, self.qkv_bias, self.o, self.o_bias, self.gate_up, self.gate_up_bias,
                self.down, self.down_bias, self.q_norm, self.k_norm)  # fmt: skip


def fusable(model) -> bool:
    """Whether `model`'s decoder layers are ones `fused_layer_step` reproduces exactly (see the module doc)."""
    config = model.config
    if getattr(config, "model_type", None) not in FAMILIES or getattr(config, "hidden_act", None) != "silu":
        return False
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        return False
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        names = [(attn, n) for n in (*_ATTN, "o_proj")] + [(mlp, n) for n in (*_MLP, "down_proj")]
        if attn is None or mlp is None or any(type(getattr(m, n, None)) is not torch.nn.Linear for m, n in names):
            return False
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [getattr(attn, n) for n in ("q_norm", "k_norm") if hasattr(attn, n)]
        if any(not type(n).__name__.endswith("RMSNorm") or not hasattr(n, "variance_epsilon") for n in norms):
            return False
    return True


def projection_groups(model) -> list[list[torch.nn.Parameter]]:
    """The parameters of a `fusable` model that decode merged, each group to be consecutive rows of one tensor:
    per layer the q/k/v weights, the gate/up weights, and their biases where they have them."""
    groups = []
    for layer in model.model.layers:
        for modules in ([getattr(layer.self_attn, n) for n in _ATTN], [getattr(layer.mlp, n) for n in _MLP]):
            groups.append([m.weight for m in modules])
            biases = [m.bias for m in modules]
            if any(b is not None for b in biases):
                if any(b is None for b in biases):
                    raise ValueError(f"{type(layer).__name__}: some of the merged projections have a bias, some not")
                groups.append(biases)
    return groups


@torch.no_grad()
def merge_projections(model) -> bool:
    """Lay out the `projection_groups` of a `fusable` model as rows of new merged tensors (on the parameters'
    device, values kept), each parameter becoming a view of its rows (the Parameter objects stay the same);
    whether the model was fusable. Only for a model nothing else holds the storage of (see the module doc)."""
    if not fusable(model):
        return False
    for group in projection_groups(model):
        for p, rows in zip(group, torch.cat([p.detach() for p in group]).split([p.shape[0] for p in group])):
            p.data = rows
    return True


def merged_layers(model) -> list[FusedLayer] | None:
    """The decode weights of a model `merge_projections` already laid out (its parameters are views of the merged
    tensors), or None."""
    if not fusable(model):
        return None
    out = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        merged = {}
        for name, modules in (("qkv", [getattr(attn, n) for n in _ATTN]), ("gate_up", [getattr(mlp, n) for n in _MLP])):
            for attr in ("weight", "bias"):
                values = [getattr(m, attr) for m in modules]
                merged[name, attr] = None if values[0] is None else merged_rows(values)
                if values[0] is not None and merged[name, attr] is None:
                    return None  # not laid out by merge_projections
        out.append(
            FusedLayer(
                ln1=layer.input_layernorm.weight,
                ln2=layer.post_attention_layernorm.weight,
                qkv=merged["qkv", "weight"],
                qkv_bias=merged["qkv", "bias"],
                o=attn.o_proj.weight,
                o_bias=attn.o_proj.bias,
                gate_up=merged["gate_up", "weight"],
                gate_up_bias=merged["gate_up", "bias"],
                down=mlp.down_proj.weight,
                down_bias=mlp.down_proj.bias,
                q_norm=attn.q_norm.weight if hasattr(attn, "q_norm") else None,
                k_norm=attn.k_norm.weight if hasattr(attn, "k_norm") else None,
            )  # fmt: skip
        )
    return out


def merged_rows(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The one tensor whose consecutive rows `tensors` are (contiguous views of one storage), or None."""
    first = tensors[0]
    if any(not t.is_contiguous() or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
           for t in tensors):  # fmt: skip
        return None
    offset = first.storage_offset()
    for t in tensors:
        if t.storage_offset() != offset or t.shape[1:] != first.shape[1:]:
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (rows, *first.shape[1:]))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Hugging Face Llama-family RMSNorm: float32 statistics, weight times the result in x's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def fused_layer_step(
    hidden: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weights: tuple,
    paged, dims: tuple[int, int, int], eps: float, scale: float, tp_group=None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One decoder layer on a decode step's T tokens: (hidden [T, C], residual [T, C]; the previous layer's output
    is their sum: the embeddings and zeros for the first layer) -> (this layer's MLP output, the residual stream
    before it). cos, sin [T, D]: the rotary positions, applied inside the attention op with the cache write.
    `tp_group`: a tensor-parallel rank's layer (its slice of the heads and MLP, tensor_parallel.py): the
    attention and MLP outputs are summed over the group."""
    ln1, ln2, qkv_w, qkv_b, o_w, o_b, gu_w, gu_b, down_w, down_b, q_norm, k_norm = weights
    heads, kv_heads, dim = dims
    residual = residual + hidden
    qkv = F.linear(_rms_norm(residual, ln1, eps), qkv_w, qkv_b)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.view(-1, heads, dim), k.view(-1, kv_heads, dim), v.view(-1, kv_heads, dim)
    if q_norm is not None:
        q, k = _rms_norm(q, q_norm, eps), _rms_norm(k, k_norm, eps)
    attn = torch.ops.rlx.paged_decode(  # runner.py's custom op: rotary, the cache write and decode attention
        q, k, v, paged.k_cache, paged.v_cache, paged.slot_mapping, paged.block_tables, paged.context_lens, scale,
        paged.impl, cos, sin,
    )  # fmt: skip
    out = F.linear(attn.reshape(-1, heads * dim).to(o_w.dtype), o_w, o_b)
    if tp_group is not None:
        dist.all_reduce(out, group=tp_group)
    residual = residual + out
    gate, up = F.linear(_rms_norm(residual, ln2, eps), gu_w, gu_b).chunk(2, dim=-1)
    out = F.linear(F.silu(gate) * up, down_w, down_b)
    if tp_group is not None:
        dist.all_reduce(out, group=tp_group)
    return out, residual


def fused_head_step(norm, head, hidden: torch.Tensor, residual: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The last layer's output (hidden + residual), the final norm and the LM head at `keep` -> logits."""
    return head(norm((residual + hidden)[keep]))
