"""torchrun worker of tests/distributed/test_megatron_moe.py (argv: one or more `ep_degree,tp_degree` pairs, run one
after the other in the same launch, any world size they fit):
a tiny Qwen3-MoE (router normalising its top-k or not), Qwen2-MoE (q/k/v biases, gated shared expert split by tp)
and Mixtral as megatron-core stages (its MoE layer, the experts split over ep_degree ranks; under tensor
parallelism sequence parallel, the packed rows padded to a multiple of tp) gives transformers' logprobs and entropy,
scores the same on every rank however rows are split, and gathers
back the Hugging Face weights bit for bit; the gradient of a backward through ranks that run different numbers of
micro-batches (fillers keep the all-to-alls in step) equals transformers'."""

import sys

import torch
from megatron.core import parallel_state
from transformers import AutoModelForCausalLM

from rlx.backends.megatron.forward import head_logprobs
from rlx.backends.megatron.parallel import setup_megatron
from rlx.backends.megatron.schedule import MicroBatch, run_pipeline
from rlx.backends.megatron.stage import MegatronScoringModel, even_micro_batches, load_stage, micro_batches
from rlx.backends.megatron.weights import gather_hf_weights, with_all_experts
from rlx.logprobs import PackedRows, packed_response_logprobs
from rlx.models.attention import enable_packed_attention
from rlx.models.megatron.convert import hf_to_megatron_shard, megatron_to_hf
from rlx.models.megatron.model import tensor_parallel_partial
from rlx.models.moe import tiny_moe_config
from rlx.parallel.dist import exit_process

B, P, R = 5, 7, 6
g = torch.Generator().manual_seed(1)
prompt_mask = torch.ones(B, P, dtype=torch.long)
prompt_mask[0, :3] = 0
response_mask = torch.ones(B, R, dtype=torch.long)
response_mask[3, 2:] = 0


FAMILIES = [("qwen3_moe", {"norm_topk_prob": False}), ("qwen3_moe", {"norm_topk_prob": True}), ("mixtral", {}),
            ("qwen2_moe", {})]  # fmt: skip
"""(model type, config overrides) checked at each layout; Qwen2-MoE's norm_topk_prob defaults to False."""
ROUTED_PARTIAL = {"qwen3_moe": 5, "mixtral": 3, "qwen2_moe": 4}
"""Parameters per layer whose gradient each tensor-parallel rank holds part of: the norms (Qwen3-MoE's q/k norms
too), the router and Qwen2-MoE's shared-expert gate."""


def check(model_type: str, overrides: dict) -> None:
    config = tiny_moe_config(67, model_type, num_experts=4, top_k=2, **overrides)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():  # transformers initialises norms to 1 and biases to 0: random ones check their mapping
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.uniform_(0.5, 1.5)
    enable_packed_attention(hf)
    weights = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # tied
    stage = load_stage(config, hf_to_megatron_shard(weights, config, tp, 1, ctx.tp_rank, 0), ctx, "test")
    assert stage.config.sequence_parallel == (tp > 1)
    experts = [n for n in stage.state_dict() if ".mlp.experts.local_experts." in n and n.endswith("fc1.weight")]
    assert len(experts) == config.num_hidden_layers * 4 // ep, experts
    ids = dict(
        prompt_ids=torch.randint(3, 67, (B, P), generator=g),
        prompt_mask=prompt_mask,
        response_ids=torch.randint(3, 67, (B, R), generator=g),
        response_mask=response_mask,
    )
    # each data-parallel rank its own rows: the all-to-all carries tokens of different counts between ranks
    mine = list(range(ctx.dp_rank, B, ctx.dp_size))
    local = {k: v[mine] for k, v in ids.items()}
    rows = PackedRows.build(**local)
    got = []

    def head(hidden, mb):
        got.append(head_logprobs(stage, ctx, hidden, mb.rows, (len(mine), R), 67, 0.7, torch.float32))

    run_pipeline(stage, ctx, [MicroBatch(rows=rows)], head, torch.float32, forward_only=True)
    want = packed_response_logprobs(hf, **local, temperature=0.7, dtype=torch.float32, with_entropy=True)
    for a, b in zip(got[0], want):
        err = ((a - b) * local["response_mask"]).abs().max().item()
        assert err < 1e-5, (model_type, overrides, ep, tp, err)
    # scoring splits rows over the data-parallel ranks (uneven micro-batch counts: fillers keep the all-to-alls
    # in step) and gives every rank all rows
    scored = MegatronScoringModel(stage, config, ctx).logprobs(ids, 0.7, torch.float32, micro_batch_size=2)
    full = packed_response_logprobs(hf, **ids, temperature=0.7, dtype=torch.float32)[0]
    assert ((scored - full) * response_mask).abs().max().item() < 1e-5
    gathered = gather_hf_weights(stage, config, ctx)
    assert gathered.keys() == weights.keys(), sorted(set(gathered) ^ set(weights))
    differ = [k for k in weights if not torch.equal(gathered[k], weights[k])]
    assert not differ, differ
    check_gradients(hf, stage, config, ids, local, mine)


def check_gradients(hf, stage, config, ids: dict, local: dict, mine: list[int]) -> None:
    """d(sum of response logprobs)/d(weights): data-parallel rank 0 runs its rows as two micro-batches, the others
    as one (and a filler where the expert-parallel group spans data-parallel ranks); dense gradients summed over
    the data-parallel ranks, the norms' and routers' over the tensor-parallel ones (sequence parallel: each rank
    saw its part of the tokens), each expert's over the ranks holding it."""
    parts = [[0], list(range(1, len(mine)))] if ctx.dp_rank == 0 else [list(range(len(mine)))]
    micro = even_micro_batches(micro_batches(local, parts, ctx.device), ctx)
    if tp == 1:
        assert len(micro) == 2 and micro[-1].is_filler == (ctx.rank > 0)
    stage.zero_grad(set_to_none=True)

    def head(hidden, mb):
        if mb.is_filler:
            return hidden.sum() * 0.0
        shape = (len(mb.extra), R)
        logp = head_logprobs(stage, ctx, hidden, mb.rows, shape, 67, 1.0, torch.float32)[0]
        return (logp * local["response_mask"][mb.extra]).sum()

    run_pipeline(stage, ctx, micro, head, torch.float32, forward_only=False)
    partial = {id(p) for p in tensor_parallel_partial(stage)}
    assert len(partial) == (0 if tp == 1 else ROUTED_PARTIAL[config.model_type] * config.num_hidden_layers + 1)
    grads = {}
    for name, p in stage.named_parameters():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        is_expert = ".mlp.experts." in name
        torch.distributed.all_reduce(grad, group=ctx.expert_dp_group if is_expert else ctx.dp_group)
        if id(p) in partial:
            torch.distributed.all_reduce(grad, group=ctx.tp_group)
        grads[name] = grad
    shards = [None] * tp
    torch.distributed.all_gather_object(shards, with_all_experts(grads, config, ctx), group=ctx.tp_group)
    grads = megatron_to_hf({(t, 0): shard for t, shard in enumerate(shards)}, config, tp, 1)
    hf.zero_grad(set_to_none=True)
    logp = packed_response_logprobs(hf, **ids, temperature=1.0, dtype=torch.float32)[0]
    (logp * ids["response_mask"]).sum().backward()
    for name, p in hf.named_parameters():
        if name in grads:
            err = (grads[name] - p.grad).abs().max().item()
            assert err < 1e-5, (name, err)


for pair in sys.argv[1:]:
    ep, tp = (int(d) for d in pair.split(","))
    ctx = setup_megatron("cpu", tp, 1, ep)
    for model_type, overrides in FAMILIES:
        check(model_type, overrides)
    parallel_state.destroy_model_parallel()  # the next pair's degrees (as tests/distributed/workers/rlx_commands.py)
sys.stdout.write(f"rank {ctx.rank} ok\n")  # one write: ranks print at once
sys.stdout.flush()
exit_process(0)
