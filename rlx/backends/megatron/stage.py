"""A model's pipeline stage on this rank: built from the HF config, loaded from a rank state, run over
a batch's micro-batches for logprobs / values (scoring) with results on every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlx.backends.megatron.forward import head_logprobs, head_values
from rlx.backends.megatron.parallel import MegatronContext
from rlx.backends.megatron.schedule import MicroBatch, run_pipeline
from rlx.errors import UserError
from rlx.logprobs import MODEL_INPUTS, ROUTES, PackedRows, flat_routes
from rlx.models.megatron.convert import local_experts
from rlx.models.megatron.model import build_stage, is_critic_config, is_moe, move_stage, num_experts
from rlx.models.megatron.routing import stage_routing


def load_stage(hf_config, state: dict[str, torch.Tensor], ctx: MegatronContext, where: str, **losses):
    """Build this rank's stage and load its megatron state (float32 parameters on ctx.device). An MoE stage keeps
    this expert-parallel rank's experts of `state` (which holds all of them); `losses`: the MoE load-balancing
    and z-loss coefficients (`moe_options`)."""
    model = build_stage(hf_config, ctx.tp_degree, ctx.pp_degree, ctx.pp_rank, ep_degree=ctx.ep_degree, **losses)
    if is_moe(hf_config):
        state = local_experts(state, num_experts(hf_config), ctx.ep_degree, ctx.ep_rank)
    expected = {k for k in model.state_dict() if not k.endswith("_extra_state")}
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        what = f"is missing {missing[0]}" if missing else f"has an unexpected tensor {unexpected[0]}"
        raise UserError(f"{where}: the megatron shard of rank (tp {ctx.tp_rank}, pp {ctx.pp_rank}) {what}")
    for name, tensor in model.state_dict().items():
        if name in state and tuple(state[name].shape) != tuple(tensor.shape):
            raise UserError(
                f"{where}: {name} has shape {tuple(state[name].shape)}, expected {tuple(tensor.shape)} "
                f"for tp {ctx.tp_degree} x pp {ctx.pp_degree}"
            )
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    return move_stage(model, ctx.device)


def check_routes_shape(shape: tuple[int, int], hf_config, where: str = "routed_experts") -> None:
    """UserError unless recorded routes of [layers, k] `shape` fit the MoE model of `hf_config`."""
    want = (hf_config.num_hidden_layers, hf_config.num_experts_per_tok)
    if tuple(shape) != want:
        raise UserError(
            f"{where}: the recorded routed_experts are [layers, k] = {list(shape)}, but the model has {want[0]} MoE "
            f"layers with {want[1]} experts per token (rollouts of another model?)"
        )


def micro_batches(tensors: dict[str, torch.Tensor], parts: list[list[int]], device: torch.device, extra=None):
    """MicroBatch per list of row indices (packed on the CPU, then moved; with the rows' recorded experts when
    `tensors` has routed_experts); its `extra` is `extra(index)`, else the index list."""
    out = []
    for index in parts:
        inputs = [tensors[k][index] for k in MODEL_INPUTS]
        rows = PackedRows.build(*inputs).to(device)
        routes = None
        if ROUTES in tensors:  # [T, L, k] in the packed row's token order
            routes = flat_routes(tensors[ROUTES][index], inputs[1], inputs[3], packed=True).to(device)
        out.append(MicroBatch(rows=rows, extra=index if extra is None else extra(index), routes=routes))
    return out


def even_micro_batches(micro: list[MicroBatch], ctx: MegatronContext) -> list[MicroBatch]:
    """`micro` topped up with filler micro-batches to the most any rank of the expert-parallel group runs (each
    MoE layer's all-to-all is a collective over that group); unchanged without expert parallelism."""
    if ctx.ep_degree == 1:
        return micro
    count = torch.tensor([len(micro)], device=ctx.device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=ctx.ep_group)
    one = torch.ones(1, 1, dtype=torch.long)
    fillers = [
        MicroBatch(rows=PackedRows.build(one * 0, one, one * 0, one).to(ctx.device), is_filler=True)
        for _ in range(int(count) - len(micro))
    ]
    return micro + fillers


def stage_forward_outputs(
    model,
    hf_config,
    ctx: MegatronContext,
    tensors: dict[str, torch.Tensor],
    micro_batch_size: int,
    temperature: float,
    dtype: torch.dtype,
    impl: str = "auto",
    max_tokens: int = 0,
    force_routes: bool = False,
) -> torch.Tensor:
    """Logprobs [B, R] (a causal LM) or values [B, R] (a critic) of every row of `tensors`, float32 on
    the CPU on every rank (computed by this rank's pipeline; the last stage broadcasts them). Micro-batches of
    `micro_batch_size` rows, or with `max_tokens` consecutive rows of at most that many prompt + response tokens
    (the stages of a pipeline see the same rows, so they split them alike). With routed_experts in `tensors` an
    MoE stage compares its routing with them, and forces them with `force_routes`."""
    from rlx.parallel.batching import count_micro_batches, token_budget_micro_batches

    shape = tensors["response_ids"].shape
    result = torch.zeros(shape, dtype=torch.float32)
    if max_tokens:
        lengths = (tensors["prompt_mask"].sum(-1) + tensors["response_mask"].sum(-1)).tolist()
        parts = token_budget_micro_batches(lengths, max_tokens)
    else:
        parts = count_micro_batches(shape[0], micro_batch_size)
    critic = is_critic_config(hf_config)

    def head(hidden, mb):
        if mb.is_filler:
            return
        part_shape = torch.Size((len(mb.extra), shape[1]))
        if critic:
            values = head_values(model, hidden, mb.rows, part_shape)
        else:
            values = head_logprobs(
                model, ctx, hidden, mb.rows, part_shape, hf_config.vocab_size, temperature, dtype, impl
            )[0]
        result[mb.extra] = values.float().cpu()

    model.eval()
    micro = even_micro_batches(micro_batches(tensors, parts, ctx.device), ctx)
    run_pipeline(model, ctx, micro, head, dtype, forward_only=True, force_routes=force_routes)
    if ctx.pp_degree > 1:
        moved = result.to(ctx.device)
        dist.broadcast(moved, src=ctx.groups["last"], group=ctx.pp_group)
        result = moved.cpu()
    return result


class MegatronScoringModel:
    """A megatron-layout checkpoint as `rlx score` uses it: this rank's stage, with logprobs (causal LM)
    or values (critic) for every row computed by the pipelines, rows split over data-parallel ranks."""

    def __init__(self, model, hf_config, ctx: MegatronContext):
        """Wrap a resident stage (e.g. a trainer's; no copy)."""
        self.model, self.config, self.ctx = model, hf_config, ctx

    def logprobs(self, tensors: dict[str, torch.Tensor], temperature: float, dtype: torch.dtype,
                 micro_batch_size: int, impl: str = "auto", desc: str = "logprobs",
                 max_tokens: int = 0) -> torch.Tensor:  # fmt: skip
        """[B, R] float32 on the CPU (zero at masked positions), identical on every rank (the stages run packed
        micro-batches of micro_batch_size rows, or of at most `max_tokens` tokens)."""
        return self._outputs(tensors, temperature, dtype, micro_batch_size, impl, max_tokens)

    def replayed_logprobs(self, tensors: dict[str, torch.Tensor], router_replay: str, temperature: float,
                          dtype: torch.dtype, micro_batch_size: int, impl: str = "auto", desc: str = "logprobs",
                          max_tokens: int = 0) -> tuple[torch.Tensor, float]:  # fmt: skip
        """As `logprobs` for an MoE model and a batch with routed_experts: with router_replay 'rollout' the recorded
        experts are forced (rlx.models.megatron.routing); also the share of recorded (token, layer) pairs the
        stages' own routers sent to another expert set (over every rank)."""
        routing = stage_routing(self.model)
        if routing is None:
            raise UserError("routed_experts: this actor is not a mixture-of-experts model")
        check_routes_shape(tuple(tensors[ROUTES].shape[2:]), self.config)
        routing.reset()
        logp = self._outputs(tensors, temperature, dtype, micro_batch_size, impl, max_tokens, router_replay)
        counts = routing.mismatch_counts
        if dist.is_initialized() and dist.get_world_size() > 1:  # each (token, layer) is routed on one rank
            dist.all_reduce(counts)
        return logp, float(counts[0]) / max(float(counts[1]), 1.0)

    def values(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype, micro_batch_size: int,
               max_tokens: int = 0) -> torch.Tensor:  # fmt: skip
        """[B, R] float32 on the CPU (zero at masked positions), identical on every rank."""
        return self._outputs(tensors, 1.0, dtype, micro_batch_size, max_tokens=max_tokens)

    def _outputs(self, tensors: dict[str, torch.Tensor], temperature: float, dtype: torch.dtype, micro_batch_size: int,
                 impl: str = "auto", max_tokens: int = 0,
                 router_replay: str | None = None) -> torch.Tensor:  # fmt: skip
        """[B, R] float32 on the CPU (zero at masked positions), identical on every rank; `router_replay`: the
        batch's routed_experts are compared ('off') or forced ('rollout'), None: not used."""
        from rlx.parallel.dist import shard_range

        ctx, size = self.ctx, tensors["response_ids"].shape[0]
        mine = list(shard_range(size, ctx.dp_rank, ctx.dp_size))
        keys = (*MODEL_INPUTS, ROUTES) if router_replay is not None else MODEL_INPUTS
        local = {k: tensors[k][mine] for k in keys}
        was_training = self.model.training
        out = stage_forward_outputs(
            self.model, self.config, ctx, local, micro_batch_size, temperature, dtype, impl, max_tokens,
            force_routes=router_replay == "rollout",
        )  # fmt: skip
        self.model.train(was_training)
        if ctx.dp_size > 1:
            parts = [None] * ctx.dp_size
            dist.all_gather_object(parts, (mine, out), group=ctx.dp_group)
            full = torch.zeros(tensors["response_ids"].shape, dtype=torch.float32)
            for rows, values in parts:
                full[rows] = values
            out = full
        return out * tensors["response_mask"]
