"""The `hf` rollout engine: batched sampling with a transformers model and its KV cache.

Runs anywhere transformers runs. Prompts are left-padded, responses grow on the right; each row
samples from its own seeded stream (see sampling.py), so outputs are reproducible for a seed. A
vision-language model gets its images in the prefill (the model runs its vision tower and places the image
embeddings) and 3-D mRoPE positions throughout: each prompt's own, then one more per generated token.
"""

from __future__ import annotations

import contextlib

import torch
from tqdm import tqdm

from rlx.engine.parallel.dist import all_reduce
from rlx.engine.parallel.ulysses import ULYSSES_ATTENTION
from rlx.engine.rollout.base import LocalGeneration, RolloutEngine
from rlx.engine.rollout.config import SamplingParams
from rlx.engine.rollout.prompts import pad_token_id
from rlx.engine.rollout.requests import Generated, Request
from rlx.engine.rollout.sampling import draw_tokens, filter_logits, sample_uniforms
from rlx.engine.rollout.stops import StopStrings
from rlx.models.attention import PACKED_ATTENTION, attention_implementation
from rlx.models.vision.families import family_of, is_vision_config
from rlx.models.vision.inputs import VisionInputs
from rlx.models.vision.positions import left_padded_positions
from rlx.utils.device import autocast


class HFRolloutEngine(RolloutEngine):
    """Samples responses with a causal LM held in this process (the trainer's own model in `rlx ppo`)."""

    name = "hf"
    takes_images = True

    def __init__(self, model, tokenizer, cfg, ctx, processor=None):
        super().__init__(model.to(ctx.device), tokenizer, cfg, ctx, processor)
        self.pad_id = pad_token_id(tokenizer)
        self.family = family_of(model.config) if is_vision_config(model.config) else None

    def generate_local(self, requests: list[Request], sampling: SamplingParams, progress: bool) -> LocalGeneration:
        """Batches of `batch_size` requests; under a launcher every rank decodes the same number of batches in
        lockstep (a sharded model's forward is a collective), a rank with fewer repeating a filler batch."""
        batch_size = self.cfg.batch_size
        uniforms = sample_uniforms(sampling.seed, [r.sample_id for r in requests], sampling.max_new_tokens)
        starts = list(range(0, len(requests), batch_size))
        count = int(all_reduce(len(starts), "max", device=self.device)) if self.ctx else len(starts)
        was_training = self.model.training
        self.model.eval()
        results: list[Generated] = []
        show = progress and (self.ctx is None or self.ctx.is_main)
        bar = tqdm(total=len(requests), desc="rollout", unit="seq", disable=None if show else True, leave=False)
        with self._decoding_attention():
            try:
                for i in range(count):
                    if i < len(starts):
                        batch = requests[starts[i] : starts[i] + batch_size]
                        greedy = torch.tensor([r.greedy or sampling.temperature == 0 for r in batch])
                        draws = uniforms[starts[i] : starts[i] + len(batch)]
                        ids, vision = [r.prompt_ids for r in batch], [r.vision for r in batch]
                        results += self._generate_batch(ids, draws, greedy, sampling, vision)
                        bar.update(len(batch))
                    else:  # lockstep filler: one pad-token prompt, its output discarded
                        draws = torch.zeros(1, sampling.max_new_tokens)
                        self._generate_batch([[self.pad_id]], draws, torch.tensor([True]), sampling)
            finally:
                bar.close()
                self.model.train(was_training)
        return LocalGeneration(results)

    def _decoding_attention(self):
        """The trainer's packed attention functions take no KV cache: decode with SDPA meanwhile (no backward
        runs in between, so switching back and forth is safe)."""
        if self.model.config.get_text_config()._attn_implementation in (PACKED_ATTENTION, ULYSSES_ATTENTION):
            return attention_implementation(self.model, "sdpa")
        return contextlib.nullcontext()

    def _prefill_inputs(self, prompt_ids: list[list[int]], vision: list | None) -> dict:
        """Model inputs of a left-padded batch of prompts (with a vision-language model's images and 3-D
        positions), on the device."""
        b, width = len(prompt_ids), max(len(ids) for ids in prompt_ids)
        input_ids = torch.full((b, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((b, width), dtype=torch.long)
        for row, ids in enumerate(prompt_ids):  # left padding: every prompt ends at column width-1
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            mask[row, width - len(ids) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        inputs = {"input_ids": input_ids, "attention_mask": mask, "position_ids": positions}
        if self.family is not None:  # [3, b, width] mRoPE positions and the rows' images in row order
            images = VisionInputs.concat([v if v is not None else VisionInputs.empty(1) for v in vision or [None] * b])
            config = self.model.config
            grids = [images.grids_of(i) for i in range(b)]
            token, merge = self.family.image_token_id(config), self.family.merge_size(config)
            inputs["position_ids"] = left_padded_positions(prompt_ids, grids, token, merge, width)
            inputs.update(images.to(self.device).model_kwargs())
        return {k: v.to(self.device) for k, v in inputs.items()}

    @torch.no_grad()  # not inference_mode: FSDP would keep inference tensors it must update later
    def _generate_batch(
        self, prompt_ids: list[list[int]], uniforms: torch.Tensor, greedy: torch.Tensor, cfg: SamplingParams,
        vision: list | None = None,
    ) -> list[Generated]:  # fmt: skip
        """Decode one batch.  uniforms: [b, max_new_tokens] float64 CPU; greedy: [b] bool (argmax rows);
        vision: each prompt's VisionInputs or None."""
        b = len(prompt_ids)
        inputs = self._prefill_inputs(prompt_ids, vision)
        mask, positions = inputs["attention_mask"], inputs["position_ids"]
        stop = torch.tensor(sorted(self.stop_ids), device=self.device)
        done = torch.zeros(b, dtype=torch.bool, device=self.device)
        greedy = greedy.to(self.device)
        tokens, logprobs = [], []
        stops = StopStrings(self.tokenizer, cfg.stop) if cfg.stop else None
        with autocast(self.device, self.dtype):
            out = self.model(**inputs, use_cache=True)
        # the next token's position: one past the prompt's largest (an image's rows and columns may exceed its
        # last token's, mRoPE; text positions: the last + 1)
        positions = positions.amax(dim=-1, keepdim=True) + 1
        if positions.dim() == 3:
            positions = positions.amax(dim=0, keepdim=True).expand(3, -1, -1)
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
            if stops is not None:  # stop strings: decode each running row's tail (the text needs the host)
                done = done | self._stop_string_hits(stops, tokens, done)
            if self._all_done(done) or step == cfg.max_new_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype, device=self.device)], dim=1)
            positions = positions + (step > 0)  # [b, 1] (or [3, b, 1]): the prefill set the first one
            with autocast(self.device, self.dtype):
                out = self.model(
                    input_ids=token.unsqueeze(-1),
                    attention_mask=mask,
                    position_ids=positions,
                    past_key_values=out.past_key_values,
                    use_cache=True,
                )
        generated = self._unpack(torch.stack(tokens, 1).cpu(), torch.stack(logprobs, 1).float().cpu())
        return [stops.cut(g) for g in generated] if stops is not None else generated  # drop the padding after

    def _stop_string_hits(self, stops: StopStrings, tokens: list[torch.Tensor], done: torch.Tensor) -> torch.Tensor:
        """[b] bool: rows not yet done whose response so far contains a stop string."""
        recent = torch.stack(tokens[-stops.window :], 1).tolist()
        hits = [not was_done and stops.hit(row) for row, was_done in zip(recent, done.tolist())]
        return torch.tensor(hits, device=self.device)

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
