"""Per-token logprobs and entropy of response tokens under a causal LM (and values under a value model), for
scoring and training.

Both `rlx score` (old / ref logprobs) and `rlx train-step` (new logprobs) call `response_logprobs`,
so the two sides compute the ratio's numerator and denominator the same way; `sequence_logprobs` scores one
sequence's own tokens (a served prompt's logprobs, rlx serve's prompt_logprobs and echo). Logits are upcast to
float32 and divided by the rollout temperature before the softmax.

`impl` picks how logits become logprobs: 'naive' runs the model's own head and softmax over
[B, R, V]; 'chunked' and 'triton' run the backbone and then the fused kernels of rlx/kernels on the
hidden states and the LM-head weight (tied or untied), never materialising [tokens, vocab] logits;
'auto' is 'triton' on CUDA with Triton installed, else 'naive'.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist
from tqdm import tqdm

from rlx.kernels.exact import target_logprobs
from rlx.kernels.exact_triton import exact_target_logprobs, use_triton
from rlx.kernels.logprob_entropy import IGNORE_INDEX, logprob_entropy, resolve_impl
from rlx.models.attention import PACKED_ATTENTION, PackedBatch, enable_packed_attention
from rlx.models.exact import EXACT_ATTENTION, is_exact
from rlx.models.family import family_of
from rlx.models.vision.packing import VisionRow, vision_forward
from rlx.parallel.fsdp import kept_gathered
from rlx.parallel.ulysses import (
    ULYSSES_ATTENTION,
    gather_sequence,
    group_rank_size,
    sequence_parallel_inputs,
    slice_sequence,
)
from rlx.utils.device import autocast


def logprobs_from_logits(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits: [..., V], targets: [...] -> (logprob of each target, entropy of each row), float32. Inside an
    `exact_forward` block, with the fixed-order log-softmax (rlx/kernels/exact.py; CUDA: its Triton kernel), as
    exact-mode rollouts."""
    if is_exact():
        compute = exact_target_logprobs if use_triton(logits) else target_logprobs
        return compute(logits, targets, temperature, with_entropy)
    scaled = logits.float() / temperature
    log_probs = torch.log_softmax(scaled, dim=-1)
    picked = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        entropy = -(log_probs.exp() * log_probs).sum(dim=-1)
    return picked, entropy


def _resolve(impl: str, device: torch.device) -> str:
    """The logprob implementation to run: 'naive' in exact mode (the model's head through its blocked GEMMs)."""
    return "naive" if is_exact() else resolve_impl(impl, device)


def lm_head_weight(model) -> torch.Tensor | None:
    """The LM-head weight [V, H] when the head is a plain bias-free linear map (else None: use 'naive')."""
    head = model.get_output_embeddings()
    if head is None or getattr(head, "bias", None) is not None or not isinstance(head, torch.nn.Linear):
        return None
    config = model.config
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
        return None
    return head.weight


def response_logprobs(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float,
    dtype: torch.dtype,
    with_entropy: bool = False,
    impl: str = "naive",
    vision=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs [B, R] (and entropy [B, R]) of the response tokens given the prompts.

    prompt_ids/mask: [B, P] left-padded; response_ids/mask: [B, R] right-padded; all on the
    model's device. Values at masked response positions are meaningless (0 on the fused paths)
    and must be masked by the caller. `vision`: the rows' VisionInputs (a vision-language model: its
    images and 3-D positions go into the forward).
    """
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)  # [B, P+R]
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).long()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
    images = contextlib.nullcontext()
    if vision is not None:  # the images and 3-D positions, hooked into the model's forward
        row = VisionRow.padded(prompt_ids, prompt_mask, response_ids, response_mask, vision, model.config)
        images = vision_forward(model, row)
    with images:
        return _padded_logprobs(model, inputs, response_ids, response_mask, temperature, dtype, with_entropy, impl)


def _padded_logprobs(model, inputs: dict, response_ids, response_mask, temperature, dtype, with_entropy, impl):
    """`response_logprobs` of the model inputs of a padded micro-batch."""
    input_ids = inputs["input_ids"]
    r = response_ids.shape[1]
    impl = _resolve(impl, input_ids.device)
    weight = lm_head_weight(model) if impl != "naive" else None
    if weight is None:
        with autocast(input_ids.device, dtype):
            # logits for positions P-1 .. P+R-1 predict response tokens 0 .. R-1 (plus one spare at the end)
            logits = model(**inputs, use_cache=False, logits_to_keep=r + 1).logits[:, :-1, :]
        return logprobs_from_logits(logits, response_ids, temperature, with_entropy)
    with autocast(input_ids.device, dtype):
        hidden, _ = hidden_states(model, **inputs, use_cache=False)
    hidden = hidden[:, -r - 1 : -1, :]  # [B, R, H]
    weight = lm_head_weight(model)  # after the forward: FSDP's root keeps it unsharded until the backward
    compute = dtype if dtype != torch.float32 else hidden.dtype
    targets = torch.where(response_mask.bool(), response_ids, torch.full_like(response_ids, IGNORE_INDEX))
    logprob, entropy = logprob_entropy(
        hidden.reshape(-1, hidden.shape[-1]).to(compute),
        weight.to(compute),
        targets.reshape(-1),
        temperature,
        impl=impl,
    )
    shape = response_ids.shape
    return logprob.float().view(shape), entropy.float().view(shape) if with_entropy else None


def hidden_states(model, keep: torch.Tensor | None = None, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(the backbone's last hidden states [B, T, H], logits at positions `keep` [B, len(keep), V]).

    The whole model runs, not its backbone alone, so that FSDP's root hooks gather the root's parameters
    (embeddings, final norm, LM head) and reduce their gradients; the head runs on `keep` only (none by
    default: the fused kernels then take the hidden states and the head's weight)."""
    captured = []
    backbone = getattr(model, model.base_model_prefix)
    handle = backbone.register_forward_hook(lambda module, args, out: captured.append(out[0]))
    try:
        empty = torch.zeros(0, dtype=torch.long, device=inputs["input_ids"].device)
        logits = model(**inputs, logits_to_keep=empty if keep is None else keep).logits
    finally:
        handle.remove()
    return captured[0], logits


@torch.no_grad()
def sequence_logprobs(
    model, ids: torch.Tensor, temperature: float, num_top: int, dtype: torch.dtype, chunk: int = 512
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence's own tokens scored teacher-forced (a served prompt's logprobs): ids [T] on the model's device ->
    (logprobs [T-1] of tokens 1..T-1, each given the tokens before it (`logprobs_from_logits`: float32, divided by
    `temperature`); their ranks [T-1] int64 (1: the most likely; tokens as likely count as ahead, as vLLM ranks);
    the `num_top` most likely tokens' logprobs [T-1, k] and ids [T-1, k]), on the CPU. One forward of the whole
    sequence; where the head is a plain linear map (`lm_head_weight`) it runs `chunk` positions at a time on the
    hidden states, so no [T, V] logits are held at once."""
    weight = lm_head_weight(model)
    with autocast(ids.device, dtype):
        if weight is None:  # a head of its own (bias, soft-capping): the model's logits, whole
            rows_of = model(input_ids=ids[None], use_cache=False).logits[0, :-1]  # [T-1, V]: t predicts t + 1
        else:
            rows_of = hidden_states(model, input_ids=ids[None], use_cache=False)[0][0, :-1]  # [T-1, H]
    targets = ids[1:]
    k = min(num_top, weight.shape[0] if weight is not None else rows_of.shape[-1])
    parts = [(torch.zeros(0), torch.zeros(0, dtype=torch.long), torch.zeros(0, k), torch.zeros(0, k, dtype=torch.long))]
    for start in range(0, targets.numel(), chunk):
        rows, wanted = rows_of[start : start + chunk], targets[start : start + chunk]
        if weight is not None:
            with autocast(ids.device, dtype):
                rows = torch.nn.functional.linear(rows, weight)  # [c, V]
        picked, _ = logprobs_from_logits(rows, wanted, temperature)
        scaled = rows.float() / temperature
        ranks = (scaled >= scaled.gather(-1, wanted[:, None])).sum(-1)
        top = scaled.topk(k, dim=-1)
        top_logprobs = top.values - torch.logsumexp(scaled, -1, keepdim=True)
        parts.append(tuple(t.cpu() for t in (picked.float(), ranks, top_logprobs, top.indices)))
    logprobs, ranks, top_logprobs, top_ids = (torch.cat(column) for column in zip(*parts))
    return logprobs, ranks, top_logprobs, top_ids


@dataclass(frozen=True)
class PackedRows:
    """A padded micro-batch (left-padded prompts, right-padded responses) as one packed row, with the
    index bookkeeping done once (on the CPU, before the tensors go to the device: no GPU syncs)."""

    packed: PackedBatch
    """input_ids / position_ids [1, T], cu_seqlens, lengths: prompt + response tokens of each row."""
    rows: torch.Tensor
    """[n] row of each response token."""
    cols: torch.Tensor
    """[n] column of each response token in response_ids."""
    pred: torch.Tensor
    """[n] packed position whose output predicts (or values) that response token."""
    local_targets: torch.Tensor
    """[T_pad / sp] the response token each position of this rank's slice predicts, IGNORE_INDEX elsewhere."""
    keep: torch.Tensor
    """[k] positions of the slice that predict a response token."""

    @classmethod
    def build(cls, prompt_ids, prompt_mask, response_ids, response_mask, sp_rank: int = 0, sp_degree: int = 1):
        ids = torch.cat([prompt_ids, response_ids], dim=1)
        mask = torch.cat([prompt_mask, response_mask], dim=1).bool()
        index = mask.reshape(-1).cumsum(0).view(mask.shape) - 1  # packed position of each kept token
        lengths = mask.sum(-1)
        rows, cols = response_mask.bool().nonzero(as_tuple=True)
        packed = PackedBatch(
            input_ids=ids[mask].unsqueeze(0),
            position_ids=(mask.cumsum(-1) - 1)[mask].unsqueeze(0),
            cu_seqlens=torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0)),
            max_len=int(lengths.max()),
            lengths=lengths.tolist(),
        )
        pred = index[rows, prompt_ids.shape[1] + cols] - 1
        targets = torch.full((1, packed.total_len), IGNORE_INDEX, dtype=torch.long, device=ids.device)
        targets[0, pred] = response_ids[rows, cols]
        local = slice_sequence(targets, sp_rank, sp_degree, IGNORE_INDEX)[0]
        return cls(packed, rows, cols, pred, local, (local != IGNORE_INDEX).nonzero().squeeze(1))

    def to(self, device: torch.device) -> PackedRows:
        move = {"non_blocking": True}
        return PackedRows(
            self.packed.to(device),
            *(t.to(device, **move) for t in (self.rows, self.cols, self.pred, self.local_targets, self.keep)),
        )


def packed_model_inputs(rows: PackedRows, sp_group=None) -> dict:
    """Model kwargs for a packed row (this rank's slice of it under sequence parallelism)."""
    return sequence_parallel_inputs(rows.packed, sp_group)


def unpack_responses(values: torch.Tensor, rows: PackedRows, shape: torch.Size, sp_group=None) -> torch.Tensor:
    """Per-position values of a packed row's slice [T_pad/sp] -> [B, R] float32 at the response tokens
    (gathered over the sequence-parallel group; the backward keeps each rank's own positions)."""
    if sp_group is not None and torch_dist.get_world_size(sp_group) > 1:
        values = gather_sequence(values.float()[None], sp_group)[0]
    full = torch.zeros(shape, dtype=torch.float32, device=values.device)
    return full.index_put((rows.rows, rows.cols), values.float()[rows.pred])


def packed_response_logprobs(
    model,
    prompt_ids,
    prompt_mask,
    response_ids,
    response_mask,
    temperature: float,
    dtype: torch.dtype,
    with_entropy: bool = False,
    impl: str = "naive",
    sp_group=None,
    rows: PackedRows | None = None,
):
    """As `response_logprobs`, but the micro-batch runs as one packed row without padding: samples are
    concatenated, positions restart per sample, and attention stays within each sample (the model runs
    "rlx_varlen" / "rlx_ulysses" attention: see `enable_packed_training`). With `sp_group`, each rank
    runs a slice of the row; logprobs are computed on the slice and gathered (the backward sends each
    rank the gradient of its own tokens). `rows`: the micro-batch's PackedRows, when built beforehand
    on the CPU (the index work then costs no device syncs)."""
    device = response_ids.device
    if rows is None:
        rows = PackedRows.build(prompt_ids, prompt_mask, response_ids, response_mask, *group_rank_size(sp_group))
    local, keep = rows.local_targets, rows.keep
    impl = _resolve(impl, device)
    fused = impl != "naive" and lm_head_weight(model) is not None
    with autocast(device, dtype):
        hidden, logits = hidden_states(model, None if fused else keep, **packed_model_inputs(rows, sp_group))
    if fused:  # the head and softmax only at `keep`, without [tokens, vocab] logits
        compute = dtype if dtype != torch.float32 else hidden.dtype
        weight = lm_head_weight(model)  # after the forward: FSDP's root keeps it unsharded until the backward
        picked, picked_entropy = logprob_entropy(
            hidden[0, keep].to(compute), weight.to(compute), local[keep], temperature, impl=impl
        )
    else:
        # squeeze, not [0]: a view both ways (select's backward writes a zeroed [1, keep, vocab] copy)
        picked, picked_entropy = logprobs_from_logits(logits.squeeze(0), local[keep], temperature, with_entropy)
    logp = picked.float().new_zeros(local.shape).index_put((keep,), picked.float())
    if with_entropy:
        entropy = picked_entropy.float().new_zeros(local.shape).index_put((keep,), picked_entropy.float())
    logp_out = unpack_responses(logp, rows, response_ids.shape, sp_group)
    return logp_out, unpack_responses(entropy, rows, response_ids.shape, sp_group) if with_entropy else None


def response_values(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    dtype: torch.dtype,
    vision=None,
) -> torch.Tensor:
    """V(s_t) for each response token t: the head's output at the position before t.  -> [B, R] float32.

    Same alignment as the logprobs (verl: values = output[:, -R - 1:-1]); `vision`: the rows' VisionInputs (a
    vision-language value model: its images and 3-D positions go into the forward, as in `response_logprobs`).
    """
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).long()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    r = response_ids.shape[1]
    images = contextlib.nullcontext()
    if vision is not None:
        row = VisionRow.padded(prompt_ids, prompt_mask, response_ids, response_mask, vision, model.config)
        images = vision_forward(model, row)
    with images, autocast(input_ids.device, dtype):
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    return logits[:, -r - 1 : -1, 0].float()


def packed_response_values(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    dtype: torch.dtype,
    sp_group=None,
    rows=None,
) -> torch.Tensor:
    """As `response_values`, with the micro-batch run as one packed row (sliced over `sp_group`; `rows`:
    its PackedRows built beforehand)."""
    if rows is None:
        rows = PackedRows.build(prompt_ids, prompt_mask, response_ids, response_mask, *group_rank_size(sp_group))
    with autocast(prompt_ids.device, dtype):
        logits = model(**packed_model_inputs(rows, sp_group)).logits  # [1, T_pad/sp, 1]
    return unpack_responses(logits[0, :, 0], rows, response_ids.shape, sp_group)


def sharded_forward(
    fn, tensors: dict[str, torch.Tensor], micro_batch_size: int, ctx=None, desc: str = "forward", max_tokens: int = 0
) -> torch.Tensor:
    """Apply `fn(part) -> [b, ...] CPU tensor` to micro-batches of the rows of `tensors` (`micro_batch_size` rows,
    or with `max_tokens` consecutive rows of at most that many prompt + response tokens); under a launcher each
    rank takes a contiguous share of the rows and the results are gathered back in row order.

    Ranks run the same number of micro-batches (repeating their first when they have fewer), so a
    sharded (FSDP) model's collectives stay in step."""
    from rlx.parallel.batching import count_micro_batches, token_budget_micro_batches
    from rlx.parallel.dist import all_gather_objects, all_reduce, shard_range

    b = next(iter(tensors.values())).shape[0]
    rows = shard_range(b, ctx.rank, ctx.world) if ctx is not None and ctx.distributed else range(b)
    if max_tokens:
        lengths = (tensors["prompt_mask"][rows.start : rows.stop].sum(-1) + tensors["response_mask"][
            rows.start : rows.stop].sum(-1)).tolist()  # fmt: skip
        groups = token_budget_micro_batches(lengths, max_tokens)
    else:
        groups = count_micro_batches(len(rows), micro_batch_size)
    spans = [(rows.start + g[0], rows.start + g[-1] + 1) for g in groups]
    count = len(spans)
    if ctx is not None and ctx.distributed:
        count = int(all_reduce(count, "max", device=ctx.device))
    out = []
    bar = tqdm(total=count, desc=desc, unit="batch", leave=False, disable=None if ctx is None or ctx.is_main else True)
    for i in range(count):
        lo, hi = spans[i] if i < len(spans) else (spans[0][0] if spans else 0, (spans[0][0] if spans else 0) + 1)
        result = fn({k: v[lo:hi] for k, v in tensors.items()})
        if i < len(spans):
            out.append(result)
        bar.update(1)
    bar.close()
    local = torch.cat(out) if out else None
    if ctx is None or not ctx.distributed:
        return local
    return torch.cat([part for part in all_gather_objects(local) if part is not None])


MODEL_INPUTS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
_ROW = "row_index"  # a micro-batch's row numbers in the whole batch (picks its images)
ROUTES = "routed_experts"  # [B, P+R, L, k] the rollout's experts (rlx.models.routing)


def flat_routes(routes: torch.Tensor, prompt_mask: torch.Tensor, response_mask: torch.Tensor, packed: bool):
    """A micro-batch's recorded experts [b, P+R, L, k] in the order its forward flattens tokens: every column
    (padded: [b*(P+R), L, k]) or the real tokens only, row after row (packed, as `PackedRows` lays them out)."""
    if not packed:
        return routes.flatten(0, 1)
    return routes[torch.cat([prompt_mask, response_mask], dim=1).bool()]


@torch.no_grad()
def batched_response_logprobs(
    model,
    tensors: dict[str, torch.Tensor],
    temperature: float,
    device: torch.device,
    dtype: torch.dtype,
    micro_batch_size: int,
    desc: str = "logprobs",
    impl: str = "naive",
    ctx=None,
    max_tokens: int = 0,
    vision=None,
    replay=None,
) -> torch.Tensor:
    """Logprobs [B, R] (float32, CPU, zero at masked positions) computed in micro-batches without grad,
    split across ranks under a launcher (see `sharded_forward`); with `max_tokens`, each micro-batch runs as one
    packed row of at most that many tokens (the model's attention must be the packed one); `vision`: the rows'
    VisionInputs (a packed micro-batch takes its rows' images through `vision_forward`); `replay`: an open
    `RouterReplay` given each micro-batch's `tensors["routed_experts"]`."""
    compute = packed_response_logprobs if max_tokens else response_logprobs

    def forward(part):
        routes = part.pop(ROUTES, None)
        if replay is not None:
            replay.set_routes(flat_routes(routes, part["prompt_mask"], part["response_mask"], bool(max_tokens)))
        with _micro_batch_images(model, part, vision, max_tokens) as images:
            part = {k: part[k].to(device) for k in MODEL_INPUTS}
            padded_images = {"vision": images} if images is not None and not max_tokens else {}
            logp, _ = compute(model, **part, temperature=temperature, dtype=dtype, impl=impl, **padded_images)
        return (logp * part["response_mask"]).cpu()

    inputs = _with_rows(tensors, vision)
    if replay is not None:
        inputs[ROUTES] = tensors[ROUTES]
    return _eval_forward(model, forward, inputs, micro_batch_size, ctx, desc, max_tokens)


@torch.no_grad()
def batched_response_values(
    model, tensors: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype, micro_batch_size: int, ctx=None,
    max_tokens: int = 0, vision=None,
) -> torch.Tensor:  # fmt: skip
    """Value-model values [B, R] (float32, CPU, zero at masked positions), as `batched_response_logprobs` (`vision`:
    the rows' VisionInputs, for a vision-language value model)."""
    compute = packed_response_values if max_tokens else response_values

    def forward(part):
        with _micro_batch_images(model, part, vision, max_tokens) as images:
            part = {k: part[k].to(device) for k in MODEL_INPUTS}
            padded_images = {"vision": images} if images is not None and not max_tokens else {}
            values = compute(model, **part, dtype=dtype, **padded_images)
        return (values * part["response_mask"]).cpu()

    return _eval_forward(model, forward, _with_rows(tensors, vision), micro_batch_size, ctx, "values", max_tokens)


def _with_rows(tensors: dict[str, torch.Tensor], vision) -> dict[str, torch.Tensor]:
    """The model inputs of `tensors`, with each row's number when there are images (a micro-batch picks its own)."""
    inputs = {k: tensors[k] for k in MODEL_INPUTS}
    if vision is not None:
        inputs[_ROW] = torch.arange(len(inputs["response_ids"]))
    return inputs


@contextlib.contextmanager
def _micro_batch_images(model, part: dict, vision, packed: bool):
    """Yields the images of the micro-batch `part` (None without `vision`; its row numbers are taken out of `part`);
    a packed micro-batch's images and 3-D positions are hooked into the model's forward while open (a padded one's
    go to the forward as `vision`)."""
    rows = part.pop(_ROW, None)
    images = vision.select(rows.tolist()) if vision is not None else None
    if images is None or not packed:
        yield images
        return
    row = VisionRow.from_padded(**{k: part[k] for k in MODEL_INPUTS}, vision=images, config=model.config)
    with vision_forward(model, row):
        yield images


def _eval_forward(model, forward, tensors, micro_batch_size: int, ctx, desc: str, max_tokens: int) -> torch.Tensor:
    was_training = model.training
    model.eval()
    try:
        inputs = {k: tensors[k] for k in (*MODEL_INPUTS, _ROW, ROUTES) if k in tensors}
        return sharded_forward(forward, inputs, micro_batch_size, ctx, desc, max_tokens)
    finally:
        model.train(was_training)


class ModuleScorer:
    """A Hugging Face module (plain or FSDP-sharded) as scoring uses it: logprobs or values of every row of a
    batch, split across the ranks of `ctx` and gathered back. The megatron backend's stages offer the same two
    methods (rlx/backends/megatron/stage.py)."""

    def __init__(self, module: torch.nn.Module, ctx, keep_gathered: bool = False):
        """`keep_gathered`: an FSDP module's layers stay gathered over a call's micro-batches (train.keep_gathered)."""
        self.module, self.ctx, self.keep_gathered = module, ctx, keep_gathered

    @property
    def config(self):
        return self.module.config

    def logprobs(self, tensors: dict[str, torch.Tensor], temperature: float, dtype: torch.dtype,
                 micro_batch_size: int, impl: str = "auto", desc: str = "logprobs",
                 max_tokens: int = 0, vision=None) -> torch.Tensor:  # fmt: skip
        """[B, R] float32 on the CPU, zero at masked positions, on every rank; with `max_tokens`, micro-batches
        are packed rows of at most that many tokens (`vision`: the rows' VisionInputs)."""
        max_tokens = self._packing(max_tokens)
        with kept_gathered(self.module, self.keep_gathered):
            return batched_response_logprobs(
                self.module, tensors, temperature, self.ctx.device, dtype, micro_batch_size, desc, impl, self.ctx,
                max_tokens, vision,
            )  # fmt: skip

    def replayed_logprobs(self, tensors: dict[str, torch.Tensor], router_replay: str, temperature: float,
                          dtype: torch.dtype, micro_batch_size: int, impl: str = "auto", desc: str = "logprobs",
                          max_tokens: int = 0, vision=None) -> tuple[torch.Tensor, float]:  # fmt: skip
        """As `logprobs` for an MoE module and a batch with `routed_experts`: with router_replay 'rollout' the
        recorded experts are forced; also the share of recorded (token, layer) pairs the module's own routers sent
        to another expert set (over every rank)."""
        from rlx.models.moe import moe_sizes
        from rlx.models.routing import RouterReplay
        from rlx.parallel.dist import all_reduce

        max_tokens = self._packing(max_tokens)
        with (
            RouterReplay(self.module, force=router_replay == "rollout") as replay,
            kept_gathered(self.module, self.keep_gathered),
        ):
            replay.check_shape(tuple(tensors[ROUTES].shape[2:]), (moe_sizes(self.module.config) or (0, 0))[1])
            logp = batched_response_logprobs(
                self.module, tensors, temperature, self.ctx.device, dtype, micro_batch_size, desc, impl, self.ctx,
                max_tokens, vision, replay,
            )  # fmt: skip
        counts = [float(replay.mismatched), float(replay.compared)]
        if self.ctx is not None and self.ctx.distributed:
            counts = [all_reduce(c, "sum", device=self.ctx.device) for c in counts]
        return logp, float(counts[0]) / max(float(counts[1]), 1.0)

    def values(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype, micro_batch_size: int,
               max_tokens: int = 0, vision=None) -> torch.Tensor:  # fmt: skip
        """[B, R] float32 on the CPU, zero at masked positions, on every rank (`vision`: the rows' VisionInputs)."""
        max_tokens = self._packing(max_tokens)
        with kept_gathered(self.module, self.keep_gathered):
            return batched_response_values(
                self.module, tensors, self.ctx.device, dtype, micro_batch_size, self.ctx, max_tokens, vision
            )

    def _packing(self, max_tokens: int) -> int:
        """The token budget packed micro-batches may use here (0: padded ones, e.g. under sequence parallelism, whose
        ranks share each row), with the packed attention plugged into the module."""
        if not max_tokens or self.ctx.sp_degree > 1:
            return 0
        packed = (PACKED_ATTENTION, ULYSSES_ATTENTION, EXACT_ATTENTION)  # exact attention takes packed rows too
        if self.module.config.get_text_config()._attn_implementation not in packed:
            enable_packed_attention(
                self.module, decoder_only=family_of(self.module.config).attention_scope == "decoder"
            )
        return max_tokens
