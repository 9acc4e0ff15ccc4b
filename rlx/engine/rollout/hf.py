"""The `hf` rollout engine: batched sampling with a transformers model and its KV cache.

Runs anywhere transformers runs. Prompts are left-padded, responses grow on the right; each row
samples from its own seeded stream (see sampling.py), so outputs are reproducible for a seed.
"""

from __future__ import annotations

import contextlib
import time

import torch
from tqdm import tqdm

from rlx.engine.device import autocast
from rlx.engine.parallel.dist import all_gather_objects, all_reduce, shard_range
from rlx.engine.parallel.ulysses import ULYSSES_ATTENTION
from rlx.engine.records import PromptRecord, RolloutRecord
from rlx.engine.rollout.config import RolloutConfig
from rlx.engine.rollout.prompts import pad_token_id, stop_token_ids
from rlx.engine.rollout.requests import Generated, build_requests, to_record
from rlx.engine.rollout.sampling import draw_tokens, filter_logits, sample_uniforms
from rlx.models.attention import PACKED_ATTENTION, attention_implementation


class HFRolloutEngine:
    """Samples responses with a causal LM held in this process (the trainer's own model in `rlx ppo`)."""

    def __init__(self, model, tokenizer, device: torch.device, dtype: torch.dtype, ctx=None):
        self.model, self.tokenizer, self.device, self.dtype = model, tokenizer, device, dtype
        self.ctx = ctx if ctx is not None and ctx.distributed else None
        self.stop_ids = stop_token_ids(model, tokenizer)
        self.pad_id = pad_token_id(tokenizer)
        self.last_stats: dict[str, float] = {}

    def generate(self, prompts: list[PromptRecord], cfg: RolloutConfig, progress: bool = True) -> list[RolloutRecord]:
        """N responses per prompt, in prompt order then sample order."""
        requests = build_requests(prompts, self.tokenizer, cfg)
        local = shard_range(len(requests), self.ctx.rank, self.ctx.world) if self.ctx else range(len(requests))
        mine = [requests[i] for i in local]
        uniforms = sample_uniforms(cfg.seed, [r.sample_id for r in mine], cfg.max_new_tokens)
        starts = list(range(0, len(mine), cfg.batch_size))
        count = int(all_reduce(len(starts), "max", device=self.device)) if self.ctx else len(starts)
        was_training = self.model.training
        self.model.eval()
        results: list[Generated] = []
        start, generated = time.perf_counter(), 0
        show = progress and (self.ctx is None or self.ctx.is_main)
        bar = tqdm(total=len(mine), desc="rollout", unit="seq", disable=None if show else True, leave=False)
        with self._decoding_attention():
            try:
                for i in range(count):
                    lo = starts[i] if i < len(starts) else 0
                    batch = mine[lo : lo + cfg.batch_size] if i < len(starts) else requests[:1]  # lockstep filler
                    greedy = torch.tensor([r.greedy or cfg.temperature == 0 for r in batch])
                    draws = uniforms[lo : lo + len(batch)] if i < len(starts) else torch.zeros(1, cfg.max_new_tokens)
                    out = self._generate_batch([r.prompt_ids for r in batch], draws, greedy, cfg)
                    if i < len(starts):
                        results.extend(out)
                        generated += sum(len(g.response_ids) for g in out)
                        bar.update(len(batch))
            finally:
                bar.close()
                self.model.train(was_training)
        if self.ctx:
            results = [g for part in all_gather_objects(results) for g in part]
            generated = int(all_reduce(generated, device=self.device))
        seconds = time.perf_counter() - start
        self.last_stats = {
            "rollout/tokens": float(generated),
            "timing/generate_s": seconds,
            "perf/rollout_tokens_per_s": generated / max(seconds, 1e-9),
        }
        return [to_record(r, g, self.tokenizer, cfg.temperature) for r, g in zip(requests, results)]

    def sleep(self) -> float:
        """Nothing to release: the engine decodes with the trainer's own module."""
        return 0.0

    def wake(self, model=None, path=None) -> float:
        """Nothing to refresh: the engine decodes with the trainer's own module."""
        return 0.0

    def close(self) -> None:
        """Nothing to shut down."""

    def _decoding_attention(self):
        """The trainer's packed attention functions take no KV cache: decode with SDPA meanwhile (no backward
        runs in between, so switching back and forth is safe)."""
        if self.model.config._attn_implementation in (PACKED_ATTENTION, ULYSSES_ATTENTION):
            return attention_implementation(self.model, "sdpa")
        return contextlib.nullcontext()

    @torch.no_grad()  # not inference_mode: FSDP would keep inference tensors it must update later
    def _generate_batch(
        self, prompt_ids: list[list[int]], uniforms: torch.Tensor, greedy: torch.Tensor, cfg: RolloutConfig
    ) -> list[Generated]:
        """Decode one batch.  uniforms: [b, max_new_tokens] float64 CPU; greedy: [b] bool (argmax rows)."""
        b, width = len(prompt_ids), max(len(ids) for ids in prompt_ids)
        input_ids = torch.full((b, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((b, width), dtype=torch.long)
        for row, ids in enumerate(prompt_ids):  # left padding: every prompt ends at column width-1
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            mask[row, width - len(ids) :] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        stop = torch.tensor(sorted(self.stop_ids), device=self.device)
        done = torch.zeros(b, dtype=torch.bool, device=self.device)
        greedy = greedy.to(self.device)
        tokens, logprobs = [], []
        with autocast(self.device, self.dtype):
            out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True)
        for step in range(cfg.max_new_tokens):
            logits = out.logits[:, -1, :].float()  # [b, V]
            scaled = logits / cfg.train_temperature
            token_logprobs = torch.log_softmax(scaled, dim=-1)
            token = logits.argmax(dim=-1)
            if not bool(greedy.all()):
                sampled = draw_tokens(filter_logits(scaled, cfg.top_k, cfg.top_p), uniforms[:, step])
                token = torch.where(greedy, token, sampled)
            token = torch.where(done, torch.full_like(token, self.pad_id), token)
            tokens.append(token)
            logprobs.append(token_logprobs.gather(-1, token.unsqueeze(-1)).squeeze(-1))
            done = done | torch.isin(token, stop)
            if self._all_done(done) or step == cfg.max_new_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype, device=self.device)], dim=1)
            positions = positions[:, -1:] + 1
            with autocast(self.device, self.dtype):
                out = self.model(
                    input_ids=token.unsqueeze(-1),
                    attention_mask=mask,
                    position_ids=positions,
                    past_key_values=out.past_key_values,
                    use_cache=True,
                )
        return self._unpack(torch.stack(tokens, 1).cpu(), torch.stack(logprobs, 1).float().cpu())

    def _all_done(self, done: torch.Tensor) -> bool:
        """Whether every row has stopped, on every rank (ranks decode in lockstep under a launcher)."""
        finished = bool(done.all())
        return bool(all_reduce(float(finished), "min", device=self.device)) if self.ctx else finished

    def _unpack(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> list[Generated]:
        """Cut each row after its first stop token.  tokens, logprobs: [b, steps]."""
        out = []
        for row_tokens, row_logprobs in zip(tokens.tolist(), logprobs.tolist()):
            end = next((i + 1 for i, t in enumerate(row_tokens) if t in self.stop_ids), None)
            reason = "stop" if end is not None else "length"
            end = end or len(row_tokens)
            out.append(Generated(row_tokens[:end], row_logprobs[:end], reason))
        return out
