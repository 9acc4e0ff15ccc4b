"""Sampling of one native-engine step, launched on the device without waiting for the result.

`launch` draws each sequence's next token from the step's logits (sampling.py's `sample_next`, as the hf
engine does) and starts a non-blocking copy of the tokens and their logprobs to the host; `collect` waits for
that copy. In between, the engine can launch the next decode step, whose input tokens it gathers on the
device from the launched step's `tokens`. The per-sample uniforms live on the device for the whole call and
are indexed there (row: the sequence, column: the token's index in its response), so no step's inputs depend
on the host having read the step before; sequences submitted later (a stream's next turns) add their rows.
A row that samples otherwise than the stream (TokenRequest.sampling_of) keeps its settings here, and a step with
such a row scales and filters each row by its own (`batch_sampling`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rlx.rollout.config import SamplingParams
from rlx.rollout.constraints import mask_constrained
from rlx.rollout.native.blocks import Sequence
from rlx.rollout.native.cohort import Cohort
from rlx.rollout.native.inputs import PinnedPair
from rlx.rollout.sampling import batch_sampling, sample_next, samples_alike, top_logprobs


@dataclass
class Launched:
    """A step whose model forward and sampling are queued on the device."""

    seqs: list[Sequence]
    decode: bool
    tokens: torch.Tensor
    """[B] int64 on the device: the sampled tokens (the inputs of a next step run ahead)."""
    host: torch.Tensor
    """[2 * B] float64 on the host: tokens then logprobs, once `ready` (token ids are exact in float64)."""
    ready: torch.cuda.Event | None
    routes: torch.Tensor | None = None
    """An MoE model's step: [B, L, k] int16 on the host (once `ready`), the experts of each sequence's position."""
    top: list[list[tuple[int, float]]] | None = None
    """Each sequence's most likely (token id, logprob) pairs, for steps with a sequence that asks for them."""
    cohort: Cohort | None = None
    """A decode step's sequences as arrays (cohort.py): set for steps run ahead, and for the step they run ahead of."""


class StepSampler:
    """Launches the sampling of steps and collects their results, for one `generate` call."""

    def __init__(self, sampling: SamplingParams, max_num_seqs: int, device: torch.device, exact: bool = False):
        """`exact`: logprobs from the fixed-order log-softmax (exact mode: the trainer's, bit for bit)."""
        self.cfg, self.device, self.exact = sampling, device, exact
        self.uniforms = torch.zeros(0, sampling.max_new_tokens, dtype=torch.float64, device=device)
        self.num_rows = 0
        self.own: dict[int, SamplingParams] = {}
        """The rows that sample otherwise than the stream, with their settings."""
        self.special: set[int] = set()
        """The rows with a grammar or asking for top logprobs (a step reads them only when one of these runs)."""
        rows = max(max_num_seqs, 1)
        self.inputs = PinnedPair(3 * rows, torch.long, device)
        self.outputs = PinnedPair(2 * rows, torch.float64, device)

    def add_rows(self, uniforms: torch.Tensor, own: SamplingParams | None = None, special: bool = False) -> int:
        """Append draws [k, max_new_tokens] (float64, CPU) for k new sequences (sampling as `own` where given, else
        as the stream; `special`: with a grammar or asking for top logprobs); returns the first one's row."""
        first, needed = self.num_rows, self.num_rows + uniforms.shape[0]
        if needed > self.uniforms.shape[0]:  # grow by doubling: queued steps keep reading the old buffer
            grown = torch.zeros(max(needed, 2 * self.uniforms.shape[0]), *self.uniforms.shape[1:],
                                dtype=torch.float64, device=self.device)  # fmt: skip
            grown[:first] = self.uniforms[:first]
            self.uniforms = grown
        self.uniforms[first:needed] = uniforms.to(self.device)
        self.num_rows = needed
        if own is not None and not samples_alike(own, self.cfg):
            self.own.update(dict.fromkeys(range(first, needed), own))
        if special:
            self.special.update(range(first, needed))
        return first

    def launch(
        self, seqs: list[Sequence], logits: torch.Tensor, decode: bool, ahead: bool,
        routes: torch.Tensor | None = None, cohort: Cohort | None = None,
    ) -> Launched:  # fmt: skip
        """Queue the draw of each sequence's next token (`ahead`: the token after one still on the device) and, for an
        MoE model, the copy of the step's `routes` [B, L, k] to the host (queued before the next step can overwrite
        a graph's output buffer). `cohort`: `seqs` as arrays (their rows read from it)."""
        b = len(seqs)
        greedy = cohort.greedy if cohort is not None else np.fromiter((s.greedy for s in seqs), bool, b)
        draws, mask = None, None
        if not greedy.all():
            staged = self.inputs.next(3 * b).view(3, b)
            rows = staged.numpy()
            if cohort is not None:
                rows[0], rows[1] = cohort.indices, cohort.outputs + ahead
            else:
                rows[0] = [s.index for s in seqs]
                rows[1] = [len(s.output_ids) + ahead for s in seqs]  # the drawn token's index in its response
            rows[2] = greedy
            staged = staged.to(self.device, non_blocking=True)
            draws = self.uniforms[staged[0], staged[1]]
            if greedy.any():
                mask = staged[2].bool()
        # per-row work only where such rows exist: a plain step's host time is what bounds a small model's decode
        own = [self.own.get(s.index, self.cfg) for s in seqs] if self.own else []  # []: the stream's scalars
        rows = batch_sampling(own, self.cfg, self.device)
        special = bool(self.special) and any(s.index in self.special for s in seqs)
        if special and any(s.constraint is not None for s in seqs):  # grammars: their rows keep the allowed tokens
            logits = mask_constrained(logits, [s.constraint for s in seqs])
        tokens, chosen = sample_next(logits, draws, mask, rows.temperature, rows.top_k, rows.top_p, exact=self.exact)
        top = None
        if special and any(s.num_top_logprobs for s in seqs):  # a served request asked (rare): read back at once
            values, ids = top_logprobs(logits, rows.temperature, max(s.num_top_logprobs for s in seqs))
            pairs = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
            top = [row[: s.num_top_logprobs] for s, row in zip(seqs, pairs)]
        host = self.outputs.next(2 * b)
        host.copy_(torch.cat([tokens.double(), chosen.double()]), non_blocking=True)
        if routes is not None:
            routes = routes.to("cpu", non_blocking=True) if routes.device.type != "cpu" else routes.clone()
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        return Launched(seqs, decode, tokens, host, ready, routes=routes, top=top, cohort=cohort)

    @staticmethod
    def collect(step: Launched) -> tuple[list[int], list[float]]:
        """Wait for a launched step; its (tokens, logprobs) in the order of its sequences."""
        tokens, logprobs = StepSampler.collect_arrays(step)
        return tokens.tolist(), logprobs.tolist()

    @staticmethod
    def collect_arrays(step: Launched) -> tuple[np.ndarray, np.ndarray]:
        """Wait for a launched step; its tokens (int64; exact in the float64 buffer) and logprobs (float64)."""
        if step.ready is not None:
            step.ready.synchronize()
        values, b = step.host.numpy(), len(step.seqs)
        return values[:b].astype(np.int64), values[b:]
