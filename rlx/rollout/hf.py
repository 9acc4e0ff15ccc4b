"""The `hf` rollout engine: batched sampling with a transformers model and its KV cache.

Runs anywhere transformers runs. Requests are decoded in batches of `batch_size`, in the order they were
submitted (a stream's step decodes one batch to its end); prompts are left-padded, responses grow on the
right; each row samples from its own seeded stream (see sampling.py), so outputs are reproducible for a seed
whatever the batching. Under a launcher every rank decodes the same number of batches in lockstep (a sharded
model's forward is a collective), a rank with fewer repeating a filler batch. A vision-language model gets its
images in the prefill (its vision tower runs on them and rlx places the rows into the images' own placeholders,
`vision_forward`: a multi-turn context's earlier sampled placeholder tokens stay text) and 3-D mRoPE positions
throughout: each prompt's own, then one more per generated token.
"""

from __future__ import annotations

import contextlib
from collections import deque

import torch

from rlx.errors import UserError
from rlx.models.attention import PACKED_ATTENTION, attention_implementation
from rlx.models.family import family_of
from rlx.models.routing import RouterRecorder
from rlx.models.vision.inputs import VisionInputs
from rlx.models.vision.packing import VisionRow, vision_forward
from rlx.models.vision.positions import left_padded_positions
from rlx.parallel.dist import all_reduce
from rlx.parallel.ulysses import ULYSSES_ATTENTION
from rlx.rollout.base import RolloutEngine, TokenStream, teacher_forced
from rlx.rollout.config import SamplingParams
from rlx.rollout.constraints import mask_constrained
from rlx.rollout.prompts import pad_token_id
from rlx.rollout.requests import Generated, PromptLogprobs, TokenRequest
from rlx.rollout.sampling import (
    BatchSampling,
    batch_sampling,
    draw_tokens,
    filter_logits,
    request_uniforms,
    scale_logits,
)
from rlx.rollout.stops import StopStrings
from rlx.utils.device import autocast


class HFRolloutEngine(RolloutEngine):
    """Samples responses with a causal LM held in this process (the trainer's own model in `rlx ppo`)."""

    name = "hf"
    gives_top_logprobs = True
    gives_prompt_logprobs = True
    takes_constraints = True
    takes_images = True

    def __init__(self, model, tokenizer, cfg, ctx, processor=None):
        super().__init__(model.to(ctx.device), tokenizer, cfg, ctx, processor)
        self.pad_id = pad_token_id(tokenizer)
        self.family = family_of(model.config)

    def open_stream(self, sampling: SamplingParams, max_context: int, num_seqs: int) -> TokenStream:
        return HFStream(self, sampling)

    def decoding(self):
        """Eval mode and a KV-cache attention for the stream's lifetime. The trainer's packed attention functions
        take no KV cache: decode with SDPA meanwhile (no backward runs in between, so switching is safe)."""
        stack = contextlib.ExitStack()
        was_training = self.model.training
        self.model.eval()
        stack.callback(self.model.train, was_training)
        if self.model.config.get_text_config()._attn_implementation in (PACKED_ATTENTION, ULYSSES_ATTENTION):
            stack.enter_context(attention_implementation(self.model, "sdpa"))
        return stack

    @torch.no_grad()  # not inference_mode: FSDP would keep inference tensors it must update later
    def generate_batch(self, requests: list[TokenRequest], cfg: SamplingParams) -> list[Generated]:
        """Decode one batch to its end (each row to its own max_new_tokens or first stop token). Draws are made for
        the call's max_new_tokens, so ranks in lockstep run the same number of steps whatever their requests."""
        uniforms = request_uniforms(requests, cfg.seed, cfg.max_new_tokens)  # [b, W] float64 CPU
        own = [r.sampling_of(cfg) for r in requests]  # each request's sampling (a served client's own values)
        greedy = torch.tensor([r.greedy or o.is_greedy for r, o in zip(requests, own)])
        limits = torch.tensor([r.max_new_tokens for r in requests])
        ids, vision = [r.prompt_ids for r in requests], [r.vision for r in requests]
        rows = batch_sampling(own, cfg, self.device)
        recorder = RouterRecorder(self.model) if self.family.routed_experts else None
        recorder = recorder if recorder is not None and recorder.routers else None
        num_top = max(r.num_top_logprobs for r in requests)
        top = (num_top, []) if num_top else None
        num_prompt = [r.num_prompt_routes for r in requests]
        with recorder if recorder is not None else contextlib.nullcontext():
            tokens, logprobs, routes = self._decode(
                ids, uniforms, greedy, limits, cfg, vision, rows, recorder, top, [r.constraint for r in requests],
                max(num_prompt),
            )  # fmt: skip
        generated = self._unpack(tokens, logprobs, limits.tolist(), routes, num_prompt)
        if top is not None:
            _add_top_logprobs(generated, requests, top[1])
        if cfg.stop:  # drop the tokens after a stop string
            stops = StopStrings(self.tokenizer, cfg.stop)
            generated = [stops.cut(g) for g in generated]
        return generated

    def _prefill_inputs(self, prompt_ids: list[list[int]], vision: list | None) -> tuple[dict, VisionRow | None]:
        """Model inputs of a left-padded batch of prompts, on the device, and for a vision-language model with
        images the row `vision_forward` places them with (3-D positions in the inputs for any vision-language
        model)."""
        b, width = len(prompt_ids), max(len(ids) for ids in prompt_ids)
        input_ids = torch.full((b, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((b, width), dtype=torch.long)
        for row, ids in enumerate(prompt_ids):  # left padding: every prompt ends at column width-1
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            mask[row, width - len(ids) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        inputs = {"input_ids": input_ids, "attention_mask": mask, "position_ids": positions}
        row = None
        if self.family.takes_images:  # [3, b, width] mRoPE positions and the rows' images in row order
            vision = [v if v is not None else VisionInputs.empty(1) for v in vision or [None] * b]
            images = VisionInputs.concat(vision)
            config = self.model.config
            grids = [images.grids_of(i) for i in range(b)]
            token, merge = self.family.image_token_id(config), self.family.merge_size(config)
            masks = [v.image_mask(0, ids, token, merge) for v, ids in zip(vision, prompt_ids)]
            inputs["position_ids"] = left_padded_positions(prompt_ids, grids, token, merge, width, masks)
            if images.num_images:
                image_mask = torch.zeros((b, width), dtype=torch.bool)
                for i, (ids, sample_mask) in enumerate(zip(prompt_ids, masks)):
                    image_mask[i, width - len(ids) :] = sample_mask
                row = VisionRow(input_ids, inputs["position_ids"], image_mask, images)
        return {k: v.to(self.device) for k, v in inputs.items()}, row

    def _decode(
        self, prompt_ids: list[list[int]], uniforms: torch.Tensor, greedy: torch.Tensor, limits: torch.Tensor,
        cfg: SamplingParams, vision: list | None = None, rows: BatchSampling | None = None,
        recorder: RouterRecorder | None = None, top: tuple[int, list] | None = None, constraints: list | None = None,
        num_prompt_routes: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """Tokens and logprobs [b, steps] (CPU), and with an open `recorder` (an MoE model) the experts [b,
        num_prompt_routes + steps, L, k] int16 of the positions that predicted the prompts' last num_prompt_routes
        tokens (prompts are left-padded: a shorter prompt's first columns are padding) and then each sampled token
        (rlx.models.routing), else None.  uniforms: [b, width];
        greedy: [b] bool rows that take the argmax; limits: [b] each row's max_new_tokens (a row past its limit is
        done); vision: each prompt's VisionInputs or None; rows: each row's temperature / top_k / top_p (None: the
        call's); top: (k, list) to append each step's k most likely (logprobs [b, k], ids [b, k]) to; constraints:
        each row's grammar (rlx.rollout.constraints) or None."""
        constraints = constraints if constraints and any(constraints) else None
        rows = rows or batch_sampling([], cfg)
        b = len(prompt_ids)
        inputs, row = self._prefill_inputs(prompt_ids, vision)
        mask, positions = inputs["attention_mask"], inputs["position_ids"]
        stop = torch.tensor(sorted(self.stop_ids), device=self.device)
        done = torch.zeros(b, dtype=torch.bool, device=self.device)
        greedy, limits = greedy.to(self.device), limits.to(self.device)
        tokens, logprobs = [], []
        stops = StopStrings(self.tokenizer, cfg.stop) if cfg.stop else None
        images = vision_forward(self.model, row) if row is not None else contextlib.nullcontext()
        with images, autocast(self.device, self.dtype):
            out = self.model(**inputs, use_cache=True)
        # [b, m + 1, L, k]: the experts of each prompt's last m + 1 columns (every prompt ends at the last column)
        columns, m = inputs["input_ids"].shape[1], num_prompt_routes
        routes = [recorder.pop().unflatten(0, (b, columns))[:, columns - 1 - m :]] if recorder is not None else []
        # the next token's position: one past the prompt's largest (an image's rows and columns may exceed its
        # last token's, mRoPE; text positions: the last + 1)
        positions = positions.amax(dim=-1, keepdim=True) + 1
        if positions.dim() == 3:
            positions = positions.amax(dim=0, keepdim=True).expand(3, -1, -1)
        for step in range(uniforms.shape[1]):
            logits = out.logits[:, -1, :].float()  # [b, V]
            if constraints is not None:
                logits = mask_constrained(logits, constraints)
            scaled = scale_logits(logits, rows.temperature)
            token_logprobs = torch.log_softmax(scaled, dim=-1)
            if top is not None:
                top[1].append(token_logprobs.topk(min(top[0], token_logprobs.shape[-1]), dim=-1))
            token = logits.argmax(dim=-1)
            if not bool(greedy.all()):
                sampled = draw_tokens(filter_logits(scaled, rows.top_k, rows.top_p), uniforms[:, step])
                token = torch.where(greedy, token, sampled)
            token = torch.where(done, torch.full_like(token, self.pad_id), token)
            if constraints is not None:
                for constraint, row_token, row_done in zip(constraints, token.tolist(), done.tolist()):
                    if constraint is not None and not row_done:
                        constraint.advance(row_token)
            tokens.append(token)
            logprobs.append(token_logprobs.gather(-1, token.unsqueeze(-1)).squeeze(-1))
            done = done | torch.isin(token, stop) | (limits <= step + 1)
            if stops is not None:  # stop strings: decode each running row's tail (the text needs the host)
                done = done | self._stop_string_hits(stops, tokens, done)
            if self._all_done(done) or step == uniforms.shape[1] - 1:
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
            if recorder is not None:
                routes.append(recorder.pop().unsqueeze(1))  # [b, 1, L, k]: the experts of the token just fed
        routed = torch.cat(routes, 1).cpu() if routes else None
        return torch.stack(tokens, 1).cpu(), torch.stack(logprobs, 1).float().cpu(), routed

    def _stop_string_hits(self, stops: StopStrings, tokens: list[torch.Tensor], done: torch.Tensor) -> torch.Tensor:
        """[b] bool: rows not yet done whose response so far contains a stop string."""
        recent = torch.stack(tokens[-stops.window :], 1).tolist()
        hits = [not was_done and stops.hit(row) for row, was_done in zip(recent, done.tolist())]
        return torch.tensor(hits, device=self.device)

    def _all_done(self, done: torch.Tensor) -> bool:
        """Whether every row has stopped, on every rank (ranks decode in lockstep under a launcher)."""
        finished = bool(done.all())
        return bool(all_reduce(float(finished), "min", device=self.device)) if self.ctx else finished

    def _unpack(
        self, tokens: torch.Tensor, logprobs: torch.Tensor, limits: list[int], routes: torch.Tensor | None = None,
        num_prompt: list[int] | None = None,
    ) -> list[Generated]:  # fmt: skip
        """Cut each row at its limit, then after its first stop token.  tokens, logprobs: [b, steps]; routes:
        [b, m + steps, L, k] (`_decode`'s, m = max(num_prompt)) or None; num_prompt: each row's
        TokenRequest.num_prompt_routes."""
        num_prompt = num_prompt or [0] * len(limits)
        m, out = max(num_prompt), []
        for i, (row_tokens, row_logprobs, limit) in enumerate(zip(tokens.tolist(), logprobs.tolist(), limits)):
            row_tokens = row_tokens[:limit]
            end = next((i + 1 for i, t in enumerate(row_tokens) if t in self.stop_ids), None)
            reason = "stop" if end is not None else "length"
            end = end or len(row_tokens)
            routed, prompt_routed = None, None
            if routes is not None:
                routed = routes[i, m : m + end]
                prompt_routed = routes[i, m - num_prompt[i] : m] if num_prompt[i] else None
            out.append(Generated(row_tokens[:end], row_logprobs[:end], reason, routed_experts=routed,
                                 prompt_routed_experts=prompt_routed))  # fmt: skip
        return out


def _add_top_logprobs(generated: list[Generated], requests: list[TokenRequest], steps: list) -> None:
    """Give each generated row that asked for them its top (token id, logprob) pairs.  steps: per decode step,
    (logprobs [b, k], ids [b, k])."""
    values = torch.stack([v for v, _ in steps], 1).tolist()  # [b, steps, k]
    ids = torch.stack([i for _, i in steps], 1).tolist()
    for row, (gen, request) in enumerate(zip(generated, requests)):
        k = request.num_top_logprobs
        if k:
            pairs = zip(ids[row][: len(gen.response_ids)], values[row])
            gen.top_logprobs = [list(zip(i[:k], v[:k])) for i, v in pairs]


class HFStream(TokenStream):
    """Submitted requests decoded a batch at a time, oldest first (a step decodes one batch to its end)."""

    def __init__(self, engine: HFRolloutEngine, sampling: SamplingParams):
        super().__init__(sampling, engine.device)
        self.engine = engine
        self.lockstep = engine.ctx is not None
        self.queue: deque[tuple[object, TokenRequest]] = deque()
        self._decoding = engine.decoding()

    def submit(self, tag, request: TokenRequest) -> None:
        self.check(request)
        self.queue.append((tag, request))

    @property
    def has_work(self) -> bool:
        return bool(self.queue)

    def step(self) -> list[tuple[object, Generated]]:
        size = min(len(self.queue), self.engine.cfg.batch_size)
        batch = [self.queue.popleft() for _ in range(size)]
        if self.lockstep and not int(all_reduce(len(batch), "max", device=self.device)):
            return []  # nobody has a batch: no forward
        if not batch:  # lockstep filler: one pad-token prompt, its output discarded
            self.engine.generate_batch([TokenRequest("filler", [self.engine.pad_id], 1, greedy=True)], self.sampling)
            return []
        generated = self.engine.generate_batch([r for _, r in batch], self.sampling)
        return [(tag, g) for (tag, _), g in zip(batch, generated)]

    def prompt_logprobs(self, request: TokenRequest, num_top: int) -> PromptLogprobs:
        if self.lockstep:  # one process's forward of a sharded model would wait for the others forever
            raise UserError("the hf engine scores prompts in one process only (not under a launcher)")
        engine = self.engine
        return teacher_forced(engine.model, request, self.sampling, num_top, engine.device, engine.dtype)

    def close(self) -> None:
        self._decoding.close()
