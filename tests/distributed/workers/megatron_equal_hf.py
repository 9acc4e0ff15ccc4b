"""torchrun worker of tests/distributed/test_megatron.py (argv: tp pp [tp pp ...]): megatron stages built from tiny
Qwen2/Llama weights give the Hugging Face model's logprobs, entropy and values, gather and stream back the HF weights,
and score the same by rows or by a token budget; each (tp, pp) in turn in this launch, megatron's groups rebuilt for
each (one launch pays the start-up and the imports once), "ok" printed after each."""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, LlamaConfig, Qwen2Config

from rlx.backends.megatron.forward import head_logprobs, head_values
from rlx.backends.megatron.parallel import setup_megatron
from rlx.backends.megatron.schedule import MicroBatch, run_pipeline
from rlx.backends.megatron.stage import MegatronScoringModel, load_stage
from rlx.backends.megatron.weights import gather_hf_weights, stream_hf_weights
from rlx.logprobs import PackedRows, packed_model_inputs, packed_response_logprobs, unpack_responses
from rlx.models.attention import enable_packed_attention
from rlx.models.megatron.convert import hf_to_megatron_shard
from rlx.models.value import value_config
from rlx.parallel.dist import exit_process

common = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    num_hidden_layers=4,
    max_position_embeddings=64,
)
configs = [  # Qwen2: QKV bias, tied, a vocabulary tp does not divide; Llama: untied, 8 heads
    Qwen2Config(vocab_size=67, tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"], **common),
    LlamaConfig(
        vocab_size=64,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
        **{**common, "num_attention_heads": 8, "num_key_value_heads": 4},
    ),
]
B, P, R = 5, 7, 6
prompt_mask = torch.ones(B, P, dtype=torch.long)
prompt_mask[0, :3] = 0
prompt_mask[2, :1] = 0
response_mask = torch.ones(B, R, dtype=torch.long)
response_mask[1, 4:] = 0
response_mask[3, 2:] = 0


def check(config, critic: bool, ids: dict, rows: PackedRows, ctx, tp: int, pp: int) -> None:
    """One model (policy or critic) of `config`: megatron stages == the Hugging Face model on this rank's slices."""
    torch.manual_seed(0)
    cfg = value_config(config) if critic else config
    hf = (AutoModelForTokenClassification if critic else AutoModelForCausalLM).from_config(cfg).float()
    enable_packed_attention(hf)
    tied = config.tie_word_embeddings
    weights = {k: v for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    stage = load_stage(cfg, hf_to_megatron_shard(weights, cfg, tp, pp, ctx.tp_rank, ctx.pp_rank), ctx, "test")
    got = []

    def head(hidden, mb):
        if critic:
            got.append((head_values(stage, hidden, mb.rows, (B, R)),))
        else:
            got.append(head_logprobs(stage, ctx, hidden, mb.rows, (B, R), cfg.vocab_size, 0.7, torch.float32))

    run_pipeline(stage, ctx, [MicroBatch(rows=rows)], head, torch.float32, forward_only=True)
    # every rank's slices broadcast over the model-parallel group give back the HF weights exactly
    gathered = gather_hf_weights(stage, cfg, ctx)
    assert gathered.keys() == weights.keys(), sorted(set(gathered) ^ set(weights))
    assert all(torch.equal(gathered[k], weights[k]) for k in weights)
    # streamed (what the rollout engine's sync reads): each name once, the same values, whether a bucket
    # holds one layer or several
    for bucket in (0, 3 * 96 * 64 * 4 * 2):
        streamed = [(k, v.clone()) for k, v in stream_hf_weights(stage, cfg, ctx, bucket)]
        assert sorted(k for k, _ in streamed) == sorted(weights), [k for k, _ in streamed]
        assert all(torch.equal(v, weights[k]) for k, v in streamed)
    # scoring through the stage, micro-batches by rows or by a token budget: the same outputs on every rank
    scorer = MegatronScoringModel(stage, cfg, ctx)

    def run(**kw):
        return scorer.values(ids, torch.float32, **kw) if critic else scorer.logprobs(ids, 0.7, torch.float32, **kw)

    by_rows, by_tokens = run(micro_batch_size=2), run(micro_batch_size=2, max_tokens=20)
    assert (by_rows - by_tokens).abs().max().item() < 2e-5, (by_rows - by_tokens).abs().max().item()
    if not ctx.is_last_stage:
        return
    if critic:
        logits = hf(**packed_model_inputs(rows)).logits
        want = (unpack_responses(logits[0, :, 0], rows, (B, R)),)
    else:
        want = packed_response_logprobs(hf, **ids, temperature=0.7, dtype=torch.float32, with_entropy=True, rows=rows)
    for a, b in zip(got[0], want):
        err = ((a - b) * response_mask).abs().max().item()
        assert err < 2e-5, (type(config).__name__, critic, tp, pp, err)
    err = ((by_tokens - want[0]) * response_mask).abs().max().item()
    assert err < 2e-5, ("token budget", type(config).__name__, critic, tp, pp, err)


def check_degrees(tp: int, pp: int) -> None:
    """Every config, policy and critic, at tp x pp (dp = the rest of the launch)."""
    from megatron.core import parallel_state

    ctx = setup_megatron("cpu", tp, pp)
    g = torch.Generator().manual_seed(1)
    for config in configs:
        ids = dict(
            prompt_ids=torch.randint(0, config.vocab_size, (B, P), generator=g),
            prompt_mask=prompt_mask,
            response_ids=torch.randint(0, config.vocab_size, (B, R), generator=g),
            response_mask=response_mask,
        )
        rows = PackedRows.build(**ids)
        for critic in (False, True):
            check(config, critic, ids, rows, ctx, tp, pp)
    sys.stdout.write(f"rank {ctx.rank} tp {tp} pp {pp} ok\n")  # one write: ranks print at once
    sys.stdout.flush()
    parallel_state.destroy_model_parallel()  # the next degrees build their own groups (the process group stays)
    # megatron-core 0.16's destroy keeps these rank lists (see tests/distributed/workers/rlx_commands.py)
    parallel_state._EMBEDDING_GLOBAL_RANKS = None
    parallel_state._POSITION_EMBEDDING_GLOBAL_RANKS = None


degrees = [int(a) for a in sys.argv[1:]]
for tp, pp in zip(degrees[::2], degrees[1::2]):
    check_degrees(tp, pp)
exit_process(0)
