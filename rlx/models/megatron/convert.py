"""Hugging Face <-> megatron-core weight maps for Llama-family models, per (tp_rank, pp_rank) shard.

Megatron names are those of `GPTModel` built by rlx/models/megatron/model.py; layer indices are local
to the pipeline stage. Per tensor-parallel rank:

    embedding.word_embeddings.weight      [V_pad/tp, H]   vocabulary rows (zero rows pad V to V_pad)
    decoder.layers.i.self_attention.linear_qkv.{weight,bias}
                                          [G/tp * (q+2) * D, H]  per key/value group g: its q query
                                          heads, then its key head, then its value head
    decoder.layers.i.self_attention.linear_proj.weight   [H, Hq*D/tp]   input columns split
    decoder.layers.i.mlp.linear_fc1.weight               [2*F/tp, H]    this rank's gate rows, then up rows
    decoder.layers.i.mlp.linear_fc2.weight               [H, F/tp]      input columns split
    decoder.layers.i.{input_layernorm,pre_mlp_layernorm}.weight, decoder.final_layernorm.weight: replicated
    output_layer.weight                   [V_pad/tp, H]   last stage (also when tied and pp > 1: a copy)
    An MoE layer (Qwen3-MoE, Qwen2-MoE, Mixtral) has, in place of the dense MLP (replicated on every
    tensor-parallel rank: experts are not split by tp):
    decoder.layers.i.self_attention.{q,k}_layernorm.weight   [D]   HF self_attn.{q,k}_norm.weight (Qwen3-MoE)
    decoder.layers.i.mlp.router.weight                       [E, H]  HF mlp.gate.weight
    decoder.layers.i.mlp.experts.local_experts.e.linear_fc1.weight   [2*I, H]  HF mlp.experts.gate_up_proj[e]
    decoder.layers.i.mlp.experts.local_experts.e.linear_fc2.weight   [H, I]    HF mlp.experts.down_proj[e]
    and a Qwen2-MoE layer's shared expert, split by tp like a dense MLP (its gate replicated):
    decoder.layers.i.mlp.shared_experts.linear_fc1.weight   [2*S/tp, H]  HF mlp.shared_expert.{gate,up}_proj rows
    decoder.layers.i.mlp.shared_experts.linear_fc2.weight   [H, S/tp]    HF mlp.shared_expert.down_proj columns
    decoder.layers.i.mlp.shared_experts.gate_weight         [1, H]       HF mlp.shared_expert_gate.weight
    with e the global expert index in checkpoints and these maps; an expert-parallel rank's own stage numbers
    its experts from 0 (`local_experts` / `global_experts` renumber).
    value_head.score.{weight,bias}        [1, H], [1]     a critic's head, replicated

Every map copies slices of the stored tensors (dtype kept), so HF -> megatron -> HF is bit-exact.
"""

from __future__ import annotations

import re

import torch

from rlx.errors import UserError
from rlx.models.megatron.model import (
    check_supported,
    has_qk_norm,
    head_dim,
    is_critic_config,
    is_moe,
    num_experts,
    padded_vocab_size,
    shared_expert_size,
)

HF_LAYER = "model.layers.{i}."
MG_LAYER = "decoder.layers.{i}."
REPLICATED_LAYER = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
}


QK_NORMS = {"self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
            "self_attn.k_norm.weight": "self_attention.k_layernorm.weight"}  # fmt: skip
EXPERT = "mlp.experts.local_experts.{e}."
_EXPERT_NAME = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def _renumber(state: dict, shift: int, keep: range | None) -> dict:
    out = {}
    for name, tensor in state.items():
        match = _EXPERT_NAME.match(name)
        if match is None:
            out[name] = tensor
        elif keep is None or int(match[2]) in keep:
            out[f"{match[1]}{int(match[2]) + shift}{match[3]}"] = tensor
    return out


def local_experts(state: dict, num_experts: int, ep_degree: int, ep_rank: int) -> dict:
    """A stage's state (or '<name>::<key>' optimizer state) with all experts -> expert-parallel rank `ep_rank`'s:
    its E / ep_degree experts, numbered from 0; other names unchanged."""
    per = num_experts // ep_degree
    return _renumber(state, -ep_rank * per, range(ep_rank * per, (ep_rank + 1) * per))


def global_experts(state: dict, num_experts: int, ep_degree: int, ep_rank: int) -> dict:
    """The inverse of `local_experts`: rank `ep_rank`'s experts under their global numbers."""
    return _renumber(state, ep_rank * (num_experts // ep_degree), None)


def _moe_to_megatron(weights: dict, config, hf: str, mg: str) -> dict[str, torch.Tensor]:
    out = {mg + dst: _get(weights, hf + src) for src, dst in QK_NORMS.items()} if has_qk_norm(config) else {}
    out[mg + "mlp.router.weight"] = _get(weights, hf + "mlp.gate.weight")
    gate_up, down = _get(weights, hf + "mlp.experts.gate_up_proj"), _get(weights, hf + "mlp.experts.down_proj")
    for e in range(num_experts(config)):
        out[mg + EXPERT.format(e=e) + "linear_fc1.weight"] = gate_up[e]  # [2I, H]: gate rows, then up rows
        out[mg + EXPERT.format(e=e) + "linear_fc2.weight"] = down[e]  # [H, I]
    return out


def _moe_to_hf(state: dict, config, hf: str, mg: str) -> dict[str, torch.Tensor]:
    out = {hf + dst: _get(state, mg + src) for dst, src in QK_NORMS.items()} if has_qk_norm(config) else {}
    out[hf + "mlp.gate.weight"] = _get(state, mg + "mlp.router.weight")
    for name, part in (("gate_up_proj", "linear_fc1"), ("down_proj", "linear_fc2")):
        experts = [_get(state, f"{mg}{EXPERT.format(e=e)}{part}.weight") for e in range(num_experts(config))]
        out[f"{hf}mlp.experts.{name}"] = torch.stack(experts)
    return out


def _mlp_to_megatron(weights: dict, config, hf: str, mg: str, rows, cols) -> dict[str, torch.Tensor]:
    """One layer's MLP: a dense one split by tp (`rows` / `cols` take this rank's slice), or the MoE layer (its
    experts and router the same on every tp rank; a shared expert split like a dense MLP)."""
    mlp_hf, mlp_mg, out = hf + "mlp.", mg + "mlp.", {}
    if is_moe(config):
        out = _moe_to_megatron(weights, config, hf, mg)
        if shared_expert_size(config) is None:
            return out
        out[mg + "mlp.shared_experts.gate_weight"] = _get(weights, hf + "mlp.shared_expert_gate.weight")
        mlp_hf, mlp_mg = hf + "mlp.shared_expert.", mg + "mlp.shared_experts."
    gate, up = _get(weights, mlp_hf + "gate_proj.weight"), _get(weights, mlp_hf + "up_proj.weight")
    out[mlp_mg + "linear_fc1.weight"] = torch.cat([rows(gate), rows(up)])
    out[mlp_mg + "linear_fc2.weight"] = cols(_get(weights, mlp_hf + "down_proj.weight"))
    return out


def stage_layers(num_layers: int, pp_degree: int, pp_rank: int) -> range:
    """Global indices of the layers held by pipeline stage `pp_rank`."""
    per = num_layers // pp_degree
    return range(pp_rank * per, (pp_rank + 1) * per)


def _qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config) -> torch.Tensor:
    """HF q/k/v projections ([Hq*D, ...], [G*D, ...]) -> megatron's grouped layout [G*(q+2)*D, ...]."""
    groups, d = config.num_key_value_heads, head_dim(config)
    per = config.num_attention_heads // groups
    rest = q.shape[1:]
    qg = q.reshape(groups, per * d, *rest)
    return torch.cat([qg, k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)], dim=1).reshape(-1, *rest)


def _split_qkv(fused: torch.Tensor, config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, d = config.num_key_value_heads, head_dim(config)
    per = config.num_attention_heads // groups
    rest = fused.shape[1:]
    g = fused.reshape(groups, (per + 2) * d, *rest)
    q, k, v = g.split([per * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _pad_vocab(weight: torch.Tensor, padded: int) -> torch.Tensor:
    if weight.shape[0] == padded:
        return weight
    return torch.cat([weight, weight.new_zeros(padded - weight.shape[0], *weight.shape[1:])])


def _get(weights: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in weights:
        raise UserError(f"weights are missing {name}")
    return weights[name]


def hf_to_megatron_shard(
    weights: dict[str, torch.Tensor], config, tp_degree: int, pp_degree: int, tp_rank: int, pp_rank: int
) -> dict[str, torch.Tensor]:
    """The megatron state of rank (tp_rank, pp_rank) from full Hugging Face weights (contiguous copies)."""
    check_supported(config, tp_degree, pp_degree)
    tp, r = tp_degree, tp_rank
    critic, tied = is_critic_config(config), bool(getattr(config, "tie_word_embeddings", False))
    first, last = pp_rank == 0, pp_rank == pp_degree - 1
    padded = padded_vocab_size(config.vocab_size, tp)
    out: dict[str, torch.Tensor] = {}

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(tp, dim=0)[r]

    def cols(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(tp, dim=1)[r]

    embed = _get(weights, "model.embed_tokens.weight")
    if first:
        out["embedding.word_embeddings.weight"] = rows(_pad_vocab(embed, padded))
    for local, i in enumerate(stage_layers(config.num_hidden_layers, pp_degree, pp_rank)):
        hf, mg = HF_LAYER.format(i=i), MG_LAYER.format(i=local)
        for src, dst in REPLICATED_LAYER.items():
            out[mg + dst] = _get(weights, hf + src)
        attn = hf + "self_attn."
        qkv = [_get(weights, f"{attn}{p}_proj.weight") for p in "qkv"]
        out[mg + "self_attention.linear_qkv.weight"] = rows(_qkv(*qkv, config))
        if f"{attn}q_proj.bias" in weights:
            bias = [_get(weights, f"{attn}{p}_proj.bias") for p in "qkv"]
            out[mg + "self_attention.linear_qkv.bias"] = rows(_qkv(*bias, config))
        out[mg + "self_attention.linear_proj.weight"] = cols(_get(weights, attn + "o_proj.weight"))
        out |= _mlp_to_megatron(weights, config, hf, mg, rows, cols)
    if last:
        out["decoder.final_layernorm.weight"] = _get(weights, "model.norm.weight")
        if critic:
            out["value_head.score.weight"] = _get(weights, "score.weight")
            out["value_head.score.bias"] = _get(weights, "score.bias")
        elif not tied:
            out["output_layer.weight"] = rows(_pad_vocab(_get(weights, "lm_head.weight"), padded))
        elif pp_degree > 1:  # the last stage keeps its own copy of the tied embedding
            out["output_layer.weight"] = rows(_pad_vocab(embed, padded))
    return {k: v.contiguous().clone() for k, v in out.items()}


def hf_to_megatron(weights: dict[str, torch.Tensor], config, tp_degree: int, pp_degree: int) -> dict:
    """{(tp_rank, pp_rank): megatron state} for every rank."""
    return {
        (t, p): hf_to_megatron_shard(weights, config, tp_degree, pp_degree, t, p)
        for p in range(pp_degree)
        for t in range(tp_degree)
    }


def megatron_units(config, pp_degree: int) -> list[tuple[int, str]]:
    """The parts of a model that convert on their own, in Hugging Face order, as (pp_rank, unit): 'embedding' on
    the first stage, 'layer.<local index>' for each layer of each stage, 'final' (norm and head) on the last."""
    units = [(0, "embedding")]
    for p in range(pp_degree):
        units += [(p, f"layer.{local}") for local in range(len(stage_layers(config.num_hidden_layers, pp_degree, p)))]
    return units + [(pp_degree - 1, "final")]


def unit_of(name: str) -> str:
    """The unit (`megatron_units`) a megatron state name belongs to."""
    if name.startswith("decoder.layers."):
        return "layer." + name.split(".", 3)[2]
    return "embedding" if name.startswith("embedding.") else "final"


def unit_to_hf(shards: dict, config, tp_degree: int, pp_degree: int, pp_rank: int, unit: str) -> dict:
    """One unit's Hugging Face weights from the tp ranks' states of its stage ({(tp_rank, pp_rank): state}, each
    holding at least that unit's tensors); tensor-parallel slices are concatenated, replicated ones returned as
    they are (views of the states)."""
    p, vocab = pp_rank, config.vocab_size

    def cat(name: str, dim: int) -> torch.Tensor:
        return torch.cat([_get(shards[(t, p)], name) for t in range(tp_degree)], dim=dim)

    if unit == "embedding":
        return {"model.embed_tokens.weight": cat("embedding.word_embeddings.weight", 0)[:vocab]}
    if unit == "final":
        last = shards[(0, p)]
        out = {"model.norm.weight": _get(last, "decoder.final_layernorm.weight")}
        if is_critic_config(config):
            out["score.weight"] = _get(last, "value_head.score.weight")
            out["score.bias"] = _get(last, "value_head.score.bias")
        elif not getattr(config, "tie_word_embeddings", False):
            out["lm_head.weight"] = cat("output_layer.weight", 0)[:vocab]
        return out
    local = int(unit.removeprefix("layer."))
    hf = HF_LAYER.format(i=stage_layers(config.num_hidden_layers, pp_degree, p)[local])
    mg = MG_LAYER.format(i=local)
    out = {hf + dst: _get(shards[(0, p)], mg + src) for dst, src in REPLICATED_LAYER.items()}
    names = ["weight"] + (["bias"] if mg + "self_attention.linear_qkv.bias" in shards[(0, p)] else [])
    for kind in names:
        q, k, v = _split_qkv(cat(f"{mg}self_attention.linear_qkv.{kind}", 0), config)
        for proj, tensor in zip("qkv", (q, k, v)):
            out[f"{hf}self_attn.{proj}_proj.{kind}"] = tensor
    out[hf + "self_attn.o_proj.weight"] = cat(mg + "self_attention.linear_proj.weight", 1)
    mlp_hf, mlp_mg = hf + "mlp.", mg + "mlp."
    if is_moe(config):  # replicated: tp rank 0's
        out |= _moe_to_hf(shards[(0, p)], config, hf, mg)
        if shared_expert_size(config) is None:
            return out
        out[hf + "mlp.shared_expert_gate.weight"] = _get(shards[(0, p)], mg + "mlp.shared_experts.gate_weight")
        mlp_hf, mlp_mg = hf + "mlp.shared_expert.", mg + "mlp.shared_experts."
    halves = [_get(shards[(t, p)], mlp_mg + "linear_fc1.weight").chunk(2) for t in range(tp_degree)]
    out[mlp_hf + "gate_proj.weight"] = torch.cat([h[0] for h in halves])
    out[mlp_hf + "up_proj.weight"] = torch.cat([h[1] for h in halves])
    out[mlp_hf + "down_proj.weight"] = cat(mlp_mg + "linear_fc2.weight", 1)
    return out


def megatron_to_hf(shards: dict, config, tp_degree: int, pp_degree: int) -> dict[str, torch.Tensor]:
    """Full Hugging Face weights from every rank's megatron state ({(tp_rank, pp_rank): state})."""
    check_supported(config, tp_degree, pp_degree)
    missing = [key for key in ((t, p) for p in range(pp_degree) for t in range(tp_degree)) if key not in shards]
    if missing:
        raise UserError(f"megatron shards are missing rank (tp {missing[0][0]}, pp {missing[0][1]})")
    out: dict[str, torch.Tensor] = {}
    for p, unit in megatron_units(config, pp_degree):
        out |= unit_to_hf(shards, config, tp_degree, pp_degree, p, unit)
    return {k: v.contiguous().clone() for k, v in out.items()}
