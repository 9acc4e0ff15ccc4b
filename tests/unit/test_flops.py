"""FLOPs by hand for a tiny config, variable lengths, generation, tied vs untied, each family checked
against torch's own FLOP counter, the device peak table and MFU."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, AutoModelForCausalLM

from rlx.errors import UserError
from rlx.observe.flops import (
    attention_flops,
    causal_pairs,
    count_flops,
    count_generate_flops,
    count_params,
    device_peak_flops,
    mfu,
)
from tests.conftest import REPO

TINY = {  # recipes/tiny-arith/config.json, the sizes that matter
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 19,
    "tie_word_embeddings": True,
}

# per token and layer, 2*m*n*k for each matrix (q width 4*16 = 64, k/v width 2*16 = 32):
Q_PROJ = 2 * 64 * 64  # 8192
K_PROJ = V_PROJ = 2 * 64 * 32  # 4096 each
O_PROJ = 2 * 64 * 64  # 8192
GATE = UP = DOWN = 2 * 64 * 128  # 16384 each
LAYERS = 2 * (Q_PROJ + K_PROJ + V_PROJ + O_PROJ + GATE + UP + DOWN)  # 147456 for both layers
HEAD = 2 * 64 * 19  # 2432: the LM head, once per position


def attention(pairs: int) -> int:
    """QK^T and PV: 2*head_dim FLOPs per (query, key) pair, head and product, both layers."""
    return pairs * 4 * (2 * 16) * 2 * 2  # pairs * heads * (2 products * 2*head_dim) * layers


def test_forward_of_one_sequence_by_hand():
    # length 3, causal: query 0 sees 1 key, query 1 sees 2, query 2 sees 3 -> 6 pairs
    assert LAYERS == 147456 and attention(6) == 3072
    assert count_flops(TINY, [3], "forward") == 3 * (LAYERS + HEAD) + attention(6)
    assert count_flops(TINY, [3], "train") == 3 * count_flops(TINY, [3], "forward")
    assert count_flops(TINY, [3], "train_frozen") == 2 * count_flops(TINY, [3], "forward")  # LoRA: no weight grads


def test_variable_lengths_add_up_per_sequence():
    # [3, 5]: 8 tokens; 6 + 15 pairs (not the 28 pairs of one 8-token sequence, nor padding to 5)
    assert count_flops(TINY, [3, 5], "forward") == 8 * (LAYERS + HEAD) + attention(6 + 15)
    assert count_flops(TINY, [3, 5], "forward") == count_flops(TINY, [3], "forward") + count_flops(TINY, [5], "forward")
    assert count_flops(TINY, [3, 5], "forward") < count_flops(TINY, [8], "forward")
    assert count_flops(TINY, [], "train") == 0.0


def test_generation_is_prefill_plus_decode_steps_by_hand():
    # prompt 3, response 3: prefill 3 tokens (6 pairs, logits at the last position -> response token 1),
    # decode token 1 (sees 4 keys) -> token 2, decode token 2 (sees 5 keys) -> token 3; token 3 is not fed
    expected = (3 + 2) * LAYERS + 3 * HEAD + attention(6 + 4 + 5)
    assert count_generate_flops(TINY, [3], [3]) == expected
    two = count_generate_flops(TINY, [3, 2], [3, 1])  # the second: prefill only, its one token from it
    assert two == expected + 2 * LAYERS + 1 * HEAD + attention(3)


def test_tied_embeddings_change_parameters_not_flops():
    untied = {**TINY, "tie_word_embeddings": False}
    assert count_flops(untied, [4, 7], "train") == count_flops(TINY, [4, 7], "train")
    assert count_params(untied) - count_params(TINY) == 19 * 64
    assert count_params(TINY, include_embeddings=False) == LAYERS // 2


def test_head_dim_defaults_to_hidden_over_heads():
    no_head_dim = {k: v for k, v in TINY.items() if k != "head_dim"}  # 64 / 4 = 16, as given
    assert count_flops(no_head_dim, [5], "forward") == count_flops(TINY, [5], "forward")
    wide = {**TINY, "head_dim": 32}  # Qwen3-style: heads * head_dim != hidden; q width 128, k/v width 64
    wider_q_and_o = 2 * (2 * 64 * (128 - 64))
    wider_k_and_v = 2 * (2 * 64 * (64 - 32))
    twice_the_attention = attention(1)  # one pair, head_dim 32 instead of 16
    assert count_flops(wide, [1], "forward") - count_flops(TINY, [1], "forward") == (
        2 * (wider_q_and_o + wider_k_and_v) + twice_the_attention
    )


def test_bad_configs_are_named():
    with pytest.raises(UserError, match="'vocab_size' must be a positive integer"):
        count_flops({k: v for k, v in TINY.items() if k != "vocab_size"}, [3], "forward")
    with pytest.raises(UserError, match="Mixtral / OLMoE routing only; this config has n_routed_experts=8"):
        count_flops({**TINY, "n_routed_experts": 8}, [3], "forward")
    with pytest.raises(ValueError, match="mode must be one of forward, train"):
        count_flops(TINY, [3], "backward")


@pytest.mark.parametrize("family,extra", [("llama", {}), ("qwen2", {}), ("qwen3", {"head_dim": 24}), ("apertus", {})])
def test_each_family_matches_torch_flop_counter(family, extra):
    """A real HF model of each family: torch counts the same matmuls, except that it also counts the
    full L x L attention square (masked pairs too) and the rotary-frequency product (head_dim/2 x L)."""
    config = AutoConfig.for_model(
        family,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=50,
        tie_word_embeddings=False,
        **extra,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    weights = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    assert count_params(config) == weights
    length, head_dim = 7, extra.get("head_dim", 16)
    ids = torch.randint(0, 50, (1, length))
    with FlopCounterMode(display=False) as counter:
        model(ids).logits.sum().backward()
    ours = count_flops(config, [length], "train")
    full_square = 3 * (attention_flops(config, length * length) - attention_flops(config, causal_pairs(length)))
    rotary = 2 * (head_dim // 2) * length
    assert counter.get_total_flops() == ours + full_square + rotary


def test_tiny_config_file_is_read_as_shipped():
    config = AutoConfig.from_pretrained(REPO / "recipes" / "tiny-arith")
    assert count_flops(config, [3, 5], "train") == count_flops(TINY, [3, 5], "train")


@pytest.mark.parametrize(
    "name,peak",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA H200 141GB HBM3e", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100-PCIE-40GB", 312e12),
        ("Ascend910B2", 376e12),
        ("Ascend 910B", 376e12),
        ("cpu", 1e12),
        ("NVIDIA GeForce GTX 1080", 0.0),
    ],
)
def test_device_peak_table_matches_torch_device_names(name, peak):
    assert device_peak_flops(name) == peak


def test_mfu():
    assert mfu(989e12, 2.0, 989e12) == 0.5
    assert mfu(989e12, 1.0, 989e12, num_devices=4) == 0.25
    with pytest.raises(ValueError, match="peak > 0"):
        mfu(1e12, 1.0, device_peak_flops("unknown gpu"))


def test_moe_layers_count_the_router_and_the_top_k_experts():
    moe = {**TINY, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "mlp_only_layers": [0]}
    h, layers = TINY["hidden_size"], TINY["num_hidden_layers"]
    dense_mlp, routed_mlp = 3 * 2 * h * TINY["intermediate_size"], 2 * h * 8 + 2 * 3 * 2 * h * 16
    routed = layers - 1  # layer 0 stays dense
    assert count_flops(moe, [1], "forward") - count_flops(TINY, [1], "forward") == routed * (routed_mlp - dense_mlp)
