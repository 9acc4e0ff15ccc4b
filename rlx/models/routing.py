"""Rollout routing replay (R3) for mixture-of-experts models: record the experts each token was routed to while
sampling, and force those experts in the scoring / training forward.

Both sides use forward hooks on transformers' `*TopKRouter` modules (`rlx.models.moe.router_modules`), whose
output is (router_logits [N, E], top-k weights [N, k], top-k experts [N, k]) over the forward's N flattened tokens.
`RouterRecorder` keeps the experts; `RouterReplay` swaps in recorded ones (the weights are recomputed from the
router's own softmax at those experts, so the router still gets gradients) and counts where the router's own
choice differs. Recorded routes are int16 [N, layers, k]; -1 marks a token with no record (it routes normally).

On disk (rollouts.jsonl) a sample's routes are one base64 string of little-endian int16, shape [R, layers, k]:
entry i holds the experts of the position whose output predicts response token i (the last prompt token for i=0,
response token i-1 after it), so every entry of a finished response is recorded.
"""

from __future__ import annotations

import base64

import torch

from rlx.models.moe import router_modules


def encode_routes(routes: torch.Tensor) -> str:
    """[R, L, k] integer experts -> base64 of little-endian int16."""
    return base64.b64encode(routes.to(torch.int16).contiguous().numpy().astype("<i2").tobytes()).decode("ascii")


def decode_routes(text: str, shape: tuple[int, int, int]) -> torch.Tensor:
    """`encode_routes`'s string -> int16 [R, L, k]; ValueError when it is not base64 of that many int16."""
    import numpy as np

    raw = base64.b64decode(text.encode("ascii"), validate=True)
    count = shape[0] * shape[1] * shape[2]
    if len(raw) != 2 * count:
        raise ValueError(f"{len(raw)} bytes, expected {2 * count} (int16 of shape {list(shape)})")
    return torch.from_numpy(np.frombuffer(raw, dtype="<i2").astype(np.int16).reshape(shape).copy())


class RouterRecorder:
    """While open, keeps the experts [N, k] each router chose in each forward, per forward call, in layer order."""

    def __init__(self, model: torch.nn.Module):
        self.routers = router_modules(model)
        self.calls: list[list[torch.Tensor]] = []
        self._handles: list = []

    def __enter__(self) -> RouterRecorder:
        self.calls = []
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, index: int):
        def hook(module, args, output):
            if index == 0:
                self.calls.append([])
            self.calls[-1].append(output[2].detach().to(torch.int16))

        return hook

    def pop(self) -> torch.Tensor:
        """The last forward's experts [N, L, k] (int16, on the routers' device), forgotten afterwards."""
        layers = self.calls.pop()
        self.calls.clear()
        return torch.stack(layers, dim=1)


class RouterReplay:
    """While open, forward hooks on every router compare its own top-k experts with `routes` ([N, L, k] in the
    forward's flattened token order, set before each forward; None = leave the forward alone) and, with `force`,
    route each recorded token to its recorded experts with the router's own softmax weights at them (renormalised
    over the k when the router normalises its top-k). Tokens with -1 route normally. `mismatched` / `compared`
    count (token, layer) pairs whose expert set differs from the record / that have a record. Under activation
    checkpointing the recomputed forward is forced the same way (the same `routes`)."""

    def __init__(self, model: torch.nn.Module, force: bool):
        self.routers = router_modules(model)
        self.force = force
        self.routes: torch.Tensor | None = None
        self.mismatched: torch.Tensor | int = 0  # device tensors once counted: no host sync per forward
        self.compared: torch.Tensor | int = 0
        self._handles: list = []
        self._counted: set[int] = set()

    def __enter__(self) -> RouterReplay:
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.routes = None

    def check_shape(self, shape: tuple[int, int], top_k: int) -> None:
        """UserError unless recorded routes of [layers, k] `shape` fit this model (its routers, `top_k`)."""
        from rlx.errors import UserError

        if tuple(shape) != (len(self.routers), top_k):
            raise UserError(
                f"the recorded routed_experts are [layers, k] = {list(shape)}, but the model has "
                f"{len(self.routers)} MoE layers with {top_k} experts per token (rollouts of another model?)"
            )

    def set_routes(self, routes: torch.Tensor | None) -> None:
        """The next forward's recorded experts [N, L, k] (None: no replay, no counting)."""
        self.routes, self._counted = routes, set()

    @property
    def mismatch(self) -> float:
        """The share of compared (token, layer) pairs routed to another expert set than recorded (0 when none)."""
        return float(self.mismatched) / max(int(self.compared), 1)

    def _hook(self, index: int):
        def hook(module, args, output):
            if self.routes is None:
                return None
            logits, weights, experts = output
            recorded = self.routes[:, index, :].to(experts.device, torch.long)  # [N, k]
            if recorded.shape != experts.shape:
                raise ValueError(f"recorded routes {tuple(recorded.shape)} for a router output {tuple(experts.shape)}")
            has = (recorded >= 0).all(-1)  # [N]
            if index not in self._counted:  # a recomputation (activation checkpointing) is not a second forward
                self._counted.add(index)
                differs = (recorded.sort(-1).values != experts.sort(-1).values).any(-1)
                self.mismatched = self.mismatched + (differs & has).sum()
                self.compared = self.compared + has.sum()
            if not self.force:
                return None
            chosen = torch.where(has[:, None], recorded, experts)
            probs = torch.softmax(logits.float(), dim=-1).gather(-1, chosen)  # [N, k]
            if _normalises_top_k(module):
                probs = probs / probs.sum(-1, keepdim=True)
            return logits, probs.to(weights.dtype), chosen.to(experts.dtype)

        return hook


def _normalises_top_k(router: torch.nn.Module) -> bool:
    """Whether the router rescales its top-k weights to sum to 1 (Mixtral always; the others by config)."""
    return bool(getattr(router, "norm_topk_prob", True))
