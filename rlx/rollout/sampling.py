"""Token sampling: temperature, top-k, top-p, and seeded inverse-CDF draws, one stream per sample.

Each sample's random numbers come from a CPU generator seeded by (seed, prompt id, sample index),
so a sample's tokens do not depend on which other samples share its batch, on the batch size, or on
how prompts are split across ranks. A batch whose requests sample differently (a served client's own temperature,
top_p or top_k: TokenRequest.sampling_of) filters and scales each row by its own settings (`batch_sampling`
gives [B] tensors); a batch that samples as its stream keeps the scalar path. On CUDA the draw runs as one float32
Triton kernel (rlx/kernels/sampling.py), elsewhere in float64 PyTorch: the same rule, so a device's engines (hf and
native both call `draw_tokens`) draw the same tokens, while CPU and GPU may differ at near-ties.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlx.kernels.exact import log_softmax as exact_log_softmax
from rlx.kernels.exact_triton import exact_logprobs, inverse_temperature, use_triton
from rlx.kernels.paged_attention import triton_available
from rlx.kernels.sampling import draw_tokens_triton, picked_logprobs
from rlx.rollout.config import SamplingParams
from rlx.utils.device import derive_seed


@dataclass(frozen=True)
class BatchSampling:
    """How a batch's rows are scaled and filtered: scalars when every row samples alike, else [B] tensors."""

    temperature: float | torch.Tensor
    """What logits are divided by (1 for a greedy row): a float, or float32 [B]."""
    top_k: int | torch.Tensor
    """Top-k filter (0 or -1 = off): an int, or int64 [B]."""
    top_p: float | torch.Tensor
    """Nucleus threshold (1 = off): a float, or float32 [B]."""


def batch_sampling(rows: list[SamplingParams], stream: SamplingParams, device=None) -> BatchSampling:
    """The settings of a batch whose row i samples as `rows[i]` (TokenRequest.sampling_of): the stream's scalars
    when every row samples as the stream does (the batched fast path), else per-row tensors on `device`."""
    if all(samples_alike(r, stream) for r in rows):
        return BatchSampling(stream.train_temperature, stream.top_k, stream.top_p)
    temperature = torch.tensor([r.train_temperature for r in rows], dtype=torch.float32, device=device)
    top_k = torch.tensor([max(r.top_k, 0) for r in rows], dtype=torch.long, device=device)
    top_p = torch.tensor([r.top_p for r in rows], dtype=torch.float32, device=device)
    return BatchSampling(temperature, top_k, top_p)


def samples_alike(row: SamplingParams, stream: SamplingParams) -> bool:
    """Whether `row` scales and filters logits as `stream` does (seeds aside)."""
    same_k = max(row.top_k, 0) == max(stream.top_k, 0)
    return row.train_temperature == stream.train_temperature and same_k and row.top_p == stream.top_p


def scale_logits(logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """logits [B, V] as float32 divided by the temperature (a float, or each row's: [B])."""
    if isinstance(temperature, torch.Tensor):
        return logits.float() / temperature.to(logits.device).unsqueeze(-1)
    return logits.float() / temperature


def sample_uniforms(seed: int, sample_ids: list[str], num_steps: int) -> torch.Tensor:
    """Uniform draws in [0, 1) for each sample and decoding step: float64 [B, num_steps] on CPU."""
    if not sample_ids:
        return torch.zeros((0, num_steps), dtype=torch.float64)
    rows = []
    for sample_id in sample_ids:
        gen = torch.Generator(device="cpu").manual_seed(derive_seed("rollout", seed, sample_id))
        rows.append(torch.rand(num_steps, generator=gen, dtype=torch.float64))
    return torch.stack(rows)


def request_uniforms(requests, seed: int, num_steps: int) -> torch.Tensor:
    """`sample_uniforms` for token requests, each with its own seed where it has one (TokenRequest.seed)."""
    rows = [sample_uniforms(seed if r.seed is None else r.seed, [r.key], num_steps) for r in requests]
    return torch.cat(rows) if rows else sample_uniforms(seed, [], num_steps)


def filter_logits(logits: torch.Tensor, top_k: int | torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """Mask tokens outside top-k / top-p with -inf.  logits: [B, V] float32, already temperature-scaled; top_k,
    top_p: scalars, or each row's ([B] tensors, BatchSampling)."""
    if isinstance(top_k, torch.Tensor):
        return _filter_rows(logits, top_k.to(logits.device), top_p.to(logits.device))
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked before it already reach top_p (the top token always stays)
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _filter_rows(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`filter_logits` with each row's own top_k [B] (0 = off) and top_p [B]: the same masks row by row."""
    width = logits.shape[-1]
    if bool((top_k > 0).any()):
        k = torch.where(top_k > 0, top_k.clamp(max=width), width)  # [B]; off: keep all
        kth = torch.sort(logits, dim=-1, descending=True).values.gather(-1, (k - 1).unsqueeze(-1))  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if bool((top_p < 1.0).any()):
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop_sorted = ((probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(-1)) & (top_p < 1.0).unsqueeze(-1)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def draw_tokens(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Sample one token per row by inverse CDF.  logits: [B, V] (filtered), uniforms: [B] in [0, 1)."""
    if logits.is_cuda and triton_available():
        return draw_tokens_triton(logits, uniforms)[0]
    return draw_tokens_torch(logits, uniforms)


def draw_tokens_torch(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The float64 reference of `draw_tokens`."""
    probs = torch.softmax(logits.double(), dim=-1)
    cdf = probs.cumsum(dim=-1)
    target = uniforms.to(cdf.device, torch.float64).unsqueeze(-1) * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    # rounding can push the target past the last positive-probability token: take the most likely then
    overflow = tokens >= logits.shape[-1]
    if overflow.any():
        tokens = torch.where(overflow, probs.argmax(dim=-1), tokens)
    return tokens


def top_logprobs(logits: torch.Tensor, temperature: float | torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens of each row and their logprobs after temperature (the distribution the sampled
    tokens' logprobs come from): (logprobs [B, k] float32, token ids [B, k]), most likely first.  logits: [B, V]."""
    return torch.log_softmax(scale_logits(logits, temperature), dim=-1).topk(min(k, logits.shape[-1]), dim=-1)


def sample_next(
    logits: torch.Tensor,
    uniforms: torch.Tensor | None,
    greedy: torch.Tensor | None,
    temperature: float | torch.Tensor,
    top_k: int | torch.Tensor = 0,
    top_p: float | torch.Tensor = 1.0,
    exact: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B], logprobs [B] float32 after temperature) for logits [B, V], as the hf engine samples.

    uniforms: [B] draws (None: every row greedy); greedy: [B] bool rows that take the argmax (None: none);
    temperature, top_k, top_p: scalars, or each row's [B] (BatchSampling: no fused kernel then).
    The tokens of `draw_tokens(filter_logits(logits.float() / temperature, ...), uniforms)`; on CUDA without
    filters one kernel reads the logits (twice) for the draw and the log-normaliser, with no float32 copy. `exact`:
    the logprobs from the fixed-order log-softmax of exact mode (rlx/kernels/exact.py; CUDA: the draw kernels'
    log-normaliser, `exact_logprobs`), as the trainer computes them."""
    per_row = isinstance(temperature, torch.Tensor)
    kernel = exact and not per_row and use_triton(logits)  # the trainer's kernel, on the logits as they are
    fused_draw = (kernel or not exact and logits.is_cuda and triton_available()) and not per_row
    if uniforms is not None and fused_draw and top_k <= 0 and top_p >= 1.0:  # one program a row: batch-invariant
        # PyTorch's CUDA division by a scalar multiplies by its float32 reciprocal
        inverse = inverse_temperature(temperature)
        tokens, _, lse, _ = draw_tokens_triton(logits, uniforms, inverse)
        if greedy is not None:
            tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
        return tokens, picked_logprobs(logits, tokens, inverse, lse)  # exact mode's too (`exact_logprobs`)
    tokens = logits.argmax(dim=-1)
    scaled = None if kernel and uniforms is None else scale_logits(logits, temperature)
    if uniforms is not None:
        sampled = draw_tokens(filter_logits(scaled, top_k, top_p), uniforms)
        tokens = sampled if greedy is None else torch.where(greedy, tokens, sampled)
    if kernel:  # the temperature applied inside the kernel: no float32 copy of the logits for the logprobs
        return tokens, exact_logprobs(logits, tokens, temperature=temperature)[0]
    if exact and use_triton(scaled):  # each row's temperature: the kernel on the scaled logits
        return tokens, exact_logprobs(scaled, tokens)[0]
    log_probs = exact_log_softmax(scaled) if exact else torch.log_softmax(scaled, dim=-1)
    return tokens, log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
