"""Sampling of one native-engine step, launched on the device without waiting for the result.

`launch` draws each sequence's next token from the step's logits (sampling.py's `sample_next`, as the hf
engine does) and starts a non-blocking copy of the tokens and their logprobs to the host; `collect` waits for
that copy. In between, the engine can launch the next decode step, whose input tokens it gathers on the
device from the launched step's `tokens`. The per-sample uniforms are kept on the host for the whole call (row: the
sequence, column: the token's index in its response); a step's draws are picked there from the lengths the host
knows (not from tokens it has read), so no step's inputs depend on the host having read the step before; sequences
submitted later (a stream's next turns) add their rows. A row that samples otherwise than the stream
(TokenRequest.sampling_of) keeps its settings here, and a step with such a row scales and filters each row by its own
(`batch_sampling`).

A plain decode step on CUDA (every row sampled at the stream's temperature, no top-k / top-p, grammar, top logprobs or
greedy row: what a training rollout is) replays its draw as a CUDA graph (`SamplingGraphs`, captured beside the model's
decode graphs, one per batch size): the two Triton draw kernels and the logprob and output copies, ~15 launches from
Python that took ~0.4 ms of the host's time a step (bench/rollout.py --host-split), become one replay. It runs the
same kernels on the same inputs as the eager path, so it draws the same tokens with the same logprobs, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rlx.kernels.exact_triton import inverse_temperature
from rlx.kernels.sampling import draw_tokens_triton, picked_logprobs
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
    """[2, W] float64 on the host (W >= B: a captured draw's batch size): tokens then logprobs in the first B columns,
    once `ready` (token ids are exact in float64)."""
    ready: torch.cuda.Event | None
    routes: torch.Tensor | None = None
    """An MoE model's step: [B, L, k] int16 on the host (once `ready`), the experts of each sequence's position."""
    top: list[list[tuple[int, float]]] | None = None
    """Each sequence's most likely (token id, logprob) pairs, for steps with a sequence that asks for them."""
    cohort: Cohort | None = None
    """A decode step's sequences as arrays (cohort.py): set for steps run ahead, and for the step they run ahead of."""


class SamplingGraphs:
    """The draw of a plain decode step captured as CUDA graphs, one per decode graph batch size, each reading that
    graph's logits: the draws (uniforms) and the temperature are inputs in device memory, the sampled tokens and the
    [tokens, logprobs] read back are outputs at fixed addresses."""

    def __init__(self, sizes: list[int], device: torch.device):
        top = max(sizes)
        self.draws = torch.zeros(top, dtype=torch.float64, device=device)
        self.inverse = torch.ones(1, dtype=torch.float32, device=device)
        """1 / temperature in float32 (`inverse_temperature`), read by the draw kernels."""
        self.held = 1.0
        self.tokens = torch.zeros(top, dtype=torch.long, device=device)
        """The sampled tokens (a next step's inputs, gathered on the device)."""
        self.out = torch.zeros(2 * top, dtype=torch.float64, device=device)
        """Batch size g: tokens in [:g], logprobs in [g:2g] (contiguous, one copy to the host)."""
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = 0

    def _draw(self, logits: torch.Tensor) -> None:
        g = logits.shape[0]
        tokens, _, lse, _ = draw_tokens_triton(logits, self.draws[:g], self.inverse)
        self.tokens[:g].copy_(tokens)
        self.out[:g].copy_(tokens)
        self.out[g : 2 * g].copy_(picked_logprobs(logits, tokens, self.inverse, lse))

    def capture(self, size: int, logits: torch.Tensor, pool) -> None:
        """Capture the draw over `logits` (the decode graph's output of batch size `size`) into the memory pool."""
        stream = torch.cuda.Stream(logits.device)
        stream.wait_stream(torch.cuda.current_stream(logits.device))
        with torch.cuda.stream(stream):
            self._draw(logits)  # outside the graph first: the kernels' compilation
        torch.cuda.current_stream(logits.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self._draw(logits)
        self.graphs[size] = graph

    def replay(self, size: int, draws: torch.Tensor, inverse: float) -> None:
        """Copy `draws` ([size] float64, pinned host) in and replay (the temperature written only when it changed)."""
        if inverse != self.held:
            self.inverse.fill_(inverse)
            self.held = inverse
        self.draws[:size].copy_(draws, non_blocking=True)
        self.graphs[size].replay()
        self.replays += 1


class StepSampler:
    """Launches the sampling of steps and collects their results, for one `generate` call."""

    def __init__(
        self, sampling: SamplingParams, max_num_seqs: int, device: torch.device, exact: bool = False,
        graphs: SamplingGraphs | None = None,
    ):  # fmt: skip
        """`exact`: logprobs from the fixed-order log-softmax (exact mode: the trainer's, bit for bit); `graphs`: the
        runner's captured draws (plain decode steps replay them)."""
        self.cfg, self.device, self.exact, self.graphs = sampling, device, exact, graphs
        self.uniforms = np.zeros((0, sampling.max_new_tokens), np.float64)
        self.num_rows = 0
        self.own: dict[int, SamplingParams] = {}
        """The rows that sample otherwise than the stream, with their settings."""
        self.special: set[int] = set()
        """The rows with a grammar or asking for top logprobs (a step reads them only when one of these runs)."""
        rows = max(max_num_seqs, 1)
        self.inputs = PinnedPair(2 * rows, torch.float64, device)
        self.outputs = PinnedPair(2 * rows, torch.float64, device)
        self.plain = graphs is not None and sampling.top_k <= 0 and sampling.top_p >= 1.0
        """Whether the stream's own settings allow the captured draw (its rows may still not)."""
        self.inverse = inverse_temperature(sampling.train_temperature) if self.plain else 1.0

    def add_rows(self, uniforms: torch.Tensor, own: SamplingParams | None = None, special: bool = False) -> int:
        """Append draws [k, max_new_tokens] (float64, CPU) for k new sequences (sampling as `own` where given, else
        as the stream; `special`: with a grammar or asking for top logprobs); returns the first one's row."""
        first, needed = self.num_rows, self.num_rows + uniforms.shape[0]
        if needed > self.uniforms.shape[0]:  # grow by doubling
            grown = np.zeros((max(needed, 2 * self.uniforms.shape[0]), self.uniforms.shape[1]), np.float64)
            grown[:first] = self.uniforms[:first]
            self.uniforms = grown
        self.uniforms[first:needed] = uniforms.numpy()
        self.num_rows = needed
        if own is not None and not samples_alike(own, self.cfg):
            self.own.update(dict.fromkeys(range(first, needed), own))
        if special:
            self.special.update(range(first, needed))
        return first

    def launch(
        self, seqs: list[Sequence], logits: torch.Tensor, decode: bool, ahead: bool,
        routes: torch.Tensor | None = None, cohort: Cohort | None = None, graph_size: int | None = None,
    ) -> Launched:  # fmt: skip
        """Queue the draw of each sequence's next token (`ahead`: the token after one still on the device) and, for an
        MoE model, the copy of the step's `routes` [B, L, k] to the host (queued before the next step can overwrite
        a graph's output buffer). `cohort`: `seqs` as arrays (their rows read from it); `graph_size`: the batch size
        of the decode graph that computed `logits` (None: not a graph)."""
        b = len(seqs)
        greedy = cohort.greedy if cohort is not None else np.fromiter((s.greedy for s in seqs), bool, b)
        # per-row work only where such rows exist: a plain step's host time is what bounds a small model's decode
        special = bool(self.special) and any(s.index in self.special for s in seqs)
        own = [self.own.get(s.index, self.cfg) for s in seqs] if self.own else []  # []: the stream's scalars
        captured = self.plain and graph_size is not None and not special and not greedy.any()
        if captured and own:
            captured = all(samples_alike(r, self.cfg) for r in own)
        width = graph_size if captured else b
        draws = None
        if not greedy.all():  # each row's uniform at the drawn token's index in its response
            staged = self.inputs.next(width)
            columns = cohort.outputs + ahead if cohort is not None else [len(s.output_ids) + ahead for s in seqs]
            indices = cohort.indices if cohort is not None else [s.index for s in seqs]
            values = staged.numpy()
            values[:b] = self.uniforms[indices, columns]
            values[b:] = 0.0
            draws = staged
        if captured:
            self.graphs.replay(graph_size, draws, self.inverse)
            tokens, results = self.graphs.tokens, self.graphs.out[: 2 * width]
            top = None
        else:
            tokens, chosen, top = self._sample(seqs, logits, draws, greedy, special, own)
            results = torch.cat([tokens.double(), chosen.double()])
        host = self.outputs.next(2 * width)
        host.copy_(results, non_blocking=True)
        if routes is not None:
            routes = routes.to("cpu", non_blocking=True) if routes.device.type != "cpu" else routes.clone()
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        return Launched(seqs, decode, tokens, host.view(2, width), ready, routes=routes, top=top, cohort=cohort)

    def _sample(self, seqs, logits, draws, greedy: np.ndarray, special: bool, own: list[SamplingParams]):
        """The eager draw: (tokens, logprobs, top logprobs or None) on the device."""
        mask = None
        if draws is not None:
            draws = draws.to(self.device, non_blocking=True)
            if greedy.any():
                mask = torch.from_numpy(greedy).to(self.device, non_blocking=True)
        rows = batch_sampling(own, self.cfg, self.device)
        if special and any(s.constraint is not None for s in seqs):  # grammars: their rows keep the allowed tokens
            logits = mask_constrained(logits, [s.constraint for s in seqs])
        tokens, chosen = sample_next(logits, draws, mask, rows.temperature, rows.top_k, rows.top_p, exact=self.exact)
        top = None
        if special and any(s.num_top_logprobs for s in seqs):  # a served request asked (rare): read back at once
            values, ids = top_logprobs(logits, rows.temperature, max(s.num_top_logprobs for s in seqs))
            pairs = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
            top = [row[: s.num_top_logprobs] for s, row in zip(seqs, pairs)]
        return tokens, chosen, top

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
        return values[0, :b].astype(np.int64), values[1, :b]
