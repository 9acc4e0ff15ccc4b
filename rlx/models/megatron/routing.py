"""Routing of a megatron-core MoE stage as rlx drives it: rollout routing replay (R3), routing mismatch, expert load,
a router z-loss that leaves padding tokens out, and the statistics of the FSDP path's router-loss metrics.

megatron-core 0.16.1's `TopKRouter` asks its `router_replay` object for each forward's top-k (`get_replay_topk`,
upstream's own routing-replay hook, which replays whole layers only). `StageRouting` puts one `_LayerTopK` there per
router of the stage: it computes the router's own top-k, compares it with the recorded experts of the tokens that
have a record, and with `force` routes those tokens to their recorded experts. The gate weights are the router's
scores gathered at the chosen experts, as upstream's replay gathers them: with `moe_router_pre_softmax` off (a model
that normalises its top-k) the softmax over the k chosen logits, else the full softmax at them; that is what the
Hugging Face replay (rlx.models.routing) computes. Tokens without a record (-1) route normally.

Each forward's recorded experts [N, L_stage, k] and real-token mask [N] (this rank's slice of the packed row, the
stage's layers) are set with `prepare` before the forward (rlx/backends/megatron/schedule.py). Padding tokens (the
sample that makes a sequence-parallel row a multiple of tp, expert-parallel filler rows) count in neither the
mismatch nor the expert load, and get no z-loss: the z-loss is rlx's (`z_loss_coef` per layer: the mean of
logsumexp(logits)^2 over the row's real tokens, each rank adding its tokens' part), attached to the router's output
with megatron's `MoEAuxLossAutoScaler`, so the sum over the tensor-parallel ranks is the one-process loss (megatron's
own z-loss averages over each rank's tokens, then over the ranks). The load-balancing loss stays megatron's, given
the padding mask by the schedule.

Every training forward also records, per layer of the stage, the statistics the FSDP actor's `actor/moe_aux_loss`,
`actor/moe_router_z_loss` and `actor/moe_max_expert_load` are made of (docs/moe.md), over the real tokens only and
whatever the coefficients: the sum of the router's softmax probabilities [E], the routed (token, slot) counts [E]
(the experts the tokens were sent to, replayed ones included, as the FSDP probe counts) and the sum of
logsumexp(logits)^2. `router_loss_metrics` (rlx/backends/megatron/trainer.py) turns them into the metrics.
"""

from __future__ import annotations

import functools

import torch


class _LayerTopK:
    """megatron's `router_replay` slot of one router: the top-k with the recorded experts forced (see module doc)."""

    def __init__(self, state: StageRouting, index: int):
        self.state, self.index = state, index

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        values, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        state, chosen = self.state, own
        if state.routes is not None:
            recorded = state.routes[:, self.index].to(own.device, torch.long)  # [N, k]
            if recorded.shape != own.shape:
                raise ValueError(f"recorded routes {tuple(recorded.shape)} for a router top-k {tuple(own.shape)}")
            has = (recorded >= 0).all(-1) & state.valid  # [N]
            with torch.no_grad():
                differs = (recorded.sort(-1).values != own.sort(-1).values).any(-1)
                state.mismatched = state.mismatched + (differs & has).sum()
                state.compared = state.compared + has.sum()
            if state.force:
                chosen = torch.where(has[:, None], recorded, own)
                values = scores.gather(1, chosen)
        with torch.no_grad():
            picked = chosen[state.valid].flatten()
            state.load = state.load + torch.bincount(picked, minlength=state.num_experts).double()
            state.chosen[self.index] = chosen
        return values, chosen


class StageRouting:
    """The routing state of one MoE stage (one per stage, made by `attach_routing`; `stage_routing` finds it)."""

    def __init__(self, model, z_loss_coef: float):
        from megatron.core.transformer.moe.router import TopKRouter

        self.routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        self.num_experts = model.config.num_moe_experts
        self.layers = [r.layer_number - 1 for r in self.routers]
        """Global (0-based) layer index of each of the stage's routers, in order."""
        self.z_loss_coef = z_loss_coef
        """rlx's router z-loss coefficient per layer (0: none)."""
        self.routes: torch.Tensor | None = None
        self.num_real = 1
        self.valid = torch.ones(0, dtype=torch.bool)
        self.force = False
        self.share: torch.Tensor | float = 0.0
        self._current: torch.Tensor | None = None
        self.chosen: dict[int, torch.Tensor] = {}
        self.reset()
        for index, router in enumerate(self.routers):
            router.router_replay = _LayerTopK(self, index)
            router.register_forward_hook(functools.partial(self._router_hook, index))

    def reset(self) -> None:
        """Forget the counted mismatches and expert load (every forward counts: scoring's too)."""
        self.mismatched: torch.Tensor | int = 0
        self.compared: torch.Tensor | int = 0
        self.load = torch.zeros(self.num_experts, dtype=torch.float64)
        self.stats: list[tuple[torch.Tensor | float, int, torch.Tensor]] = []
        """Per training forward: (its share of the trained tokens, its real tokens, [L_stage, 2E + 1] float64: each
        layer's summed router probabilities, routed counts and summed logsumexp^2 over this rank's real tokens)."""

    def prepare(self, routes: torch.Tensor | None, valid: torch.Tensor, num_real: int, force: bool, share=0.0) -> None:
        """The next forward's recorded experts [N, L_stage, k] (None: none recorded), real-token mask [N] (this
        rank's tokens), number of real tokens in the whole row, whether recorded experts are forced, and its share of
        the mini-batch's trained tokens (the weight of its router-loss metrics)."""
        self.routes, self.valid, self.num_real, self.force = routes, valid, max(num_real, 1), force
        self.load, self.share, self.chosen = self.load.to(valid.device), share, {}
        self._current = None

    @property
    def mismatch_counts(self) -> torch.Tensor:
        """[mismatched, compared] (token, layer) pairs counted since `reset`, float64 on the valid mask's device."""
        return torch.stack([torch.as_tensor(c, dtype=torch.float64) for c in (self.mismatched, self.compared)]).to(
            self.valid.device
        )

    def _router_hook(self, index: int, router, args, output):
        if not router.training or not torch.is_grad_enabled():  # a training forward (not scoring's)
            return None
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        probs, routing_map = output
        with torch.set_grad_enabled(bool(self.z_loss_coef)):  # no graph where only the metrics read them
            logits = router.gating(args[0]).reshape(-1, self.num_experts).float()  # the router's own, recomputed
            valid = self.valid.to(logits.device)
            squares = torch.logsumexp(logits, dim=-1).square() * valid  # [N]
        self._record(index, logits.detach(), squares.detach(), valid)
        if not self.z_loss_coef:
            return None
        z_loss = self.z_loss_coef * squares.sum() / self.num_real
        return MoEAuxLossAutoScaler.apply(probs, z_loss), routing_map

    @torch.no_grad()
    def _record(self, index: int, logits: torch.Tensor, squares: torch.Tensor, valid: torch.Tensor) -> None:
        """Layer `index`'s router statistics of this forward's real tokens (see the module doc)."""
        if self._current is None:
            self._current = torch.zeros(len(self.routers), 2 * self.num_experts + 1, dtype=torch.float64,
                                        device=logits.device)  # fmt: skip
            self.stats.append((self.share, self.num_real, self._current))
        experts = self.num_experts
        row = self._current[index]
        row[:experts] = (torch.softmax(logits, dim=-1) * valid[:, None]).sum(0).double()
        chosen = self.chosen[index][valid.to(self.chosen[index].device)].flatten()
        row[experts : 2 * experts] = torch.bincount(chosen, minlength=experts).double()
        row[-1] = squares.sum().double()


def attach_routing(model, z_loss_coef: float = 0.0) -> StageRouting:
    """Give an MoE stage's routers rlx's routing (replay, counts, a z-loss of `z_loss_coef` per layer)."""
    routing = StageRouting(model, z_loss_coef)
    model.rlx_routing = routing
    return routing


def stage_routing(model) -> StageRouting | None:
    """The stage's routing state (None for a dense stage)."""
    return getattr(model, "rlx_routing", None)


def set_aux_loss_scale(scale: torch.Tensor) -> None:
    """The weight megatron's router losses get in the next backward (the micro-batch's share of the loss)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    # a copy: megatron keeps the first tensor it is given and copies later scales into it
    MoEAuxLossAutoScaler.set_loss_scale(scale.detach().float().reshape(()).clone())
