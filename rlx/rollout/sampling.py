"""Token sampling: temperature, top-k, top-p, and seeded inverse-CDF draws, one stream per sample.

Each sample's random numbers come from a CPU generator seeded by (seed, prompt id, sample index),
so a sample's tokens do not depend on which other samples share its batch, on the batch size, or on
how prompts are split across ranks. On CUDA the draw runs as one float32 Triton kernel
(rlx/kernels/sampling.py), elsewhere in float64 PyTorch: the same rule, so a device's engines (hf and
native both call `draw_tokens`) draw the same tokens, while CPU and GPU may differ at near-ties.
"""

from __future__ import annotations

import torch

from rlx.kernels.paged_attention import triton_available
from rlx.kernels.sampling import draw_tokens_triton
from rlx.utils.device import derive_seed


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


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask tokens outside top-k / top-p with -inf.  logits: [B, V] float32, already temperature-scaled."""
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


def sample_next(
    logits: torch.Tensor,
    uniforms: torch.Tensor | None,
    greedy: torch.Tensor | None,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B], logprobs [B] float32 after temperature) for logits [B, V], as the hf engine samples.

    uniforms: [B] draws (None: every row greedy); greedy: [B] bool rows that take the argmax (None: none).
    The tokens of `draw_tokens(filter_logits(logits.float() / temperature, ...), uniforms)`; on CUDA without
    filters one kernel reads the logits (twice) for the draw and the log-normaliser, with no float32 copy."""
    if uniforms is not None and logits.is_cuda and triton_available() and top_k <= 0 and top_p >= 1.0:
        # PyTorch's CUDA division by a scalar multiplies by its float32 reciprocal
        inverse = float(torch.tensor(1.0) / torch.tensor(float(temperature)))
        tokens, _, lse = draw_tokens_triton(logits, uniforms, inverse)
        if greedy is not None:
            tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
        chosen = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).float() * inverse
        return tokens, chosen - lse
    scaled = logits.float() / temperature
    tokens = logits.argmax(dim=-1)
    if uniforms is not None:
        sampled = draw_tokens(filter_logits(scaled, top_k, top_p), uniforms)
        tokens = sampled if greedy is None else torch.where(greedy, tokens, sampled)
    logprobs = torch.log_softmax(scaled, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, logprobs
