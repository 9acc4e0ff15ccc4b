"""Per-token logprobs and entropy of response tokens under a causal LM, for scoring and training.

Both `rlx score` (old / ref logprobs) and `rlx train-step` (new logprobs) call `response_logprobs`,
so the two sides compute the ratio's numerator and denominator the same way. Logits are upcast to
float32 and divided by the rollout temperature before the softmax.

`impl` picks how logits become logprobs: 'naive' runs the model's own head and softmax over
[B, R, V]; 'chunked' and 'triton' run the backbone and then the fused kernels of rlx/kernels on the
hidden states and the LM-head weight (tied or untied), never materialising [tokens, vocab] logits;
'auto' is 'triton' on CUDA with Triton installed, else 'naive'.
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from rlx.engine.device import autocast
from rlx.kernels.logprob_entropy import IGNORE_INDEX, logprob_entropy, resolve_impl


def logprobs_from_logits(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits: [..., V], targets: [...] -> (logprob of each target, entropy of each row), float32."""
    scaled = logits.float() / temperature
    log_probs = torch.log_softmax(scaled, dim=-1)
    picked = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        entropy = -(log_probs.exp() * log_probs).sum(dim=-1)
    return picked, entropy


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs [B, R] (and entropy [B, R]) of the response tokens given the prompts.

    prompt_ids/mask: [B, P] left-padded; response_ids/mask: [B, R] right-padded; all on the
    model's device. Values at masked response positions are meaningless (0 on the fused paths)
    and must be masked by the caller.
    """
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)  # [B, P+R]
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).long()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    r = response_ids.shape[1]
    impl = resolve_impl(impl, input_ids.device)
    weight = lm_head_weight(model) if impl != "naive" else None
    if weight is None:
        with autocast(input_ids.device, dtype):
            # logits for positions P-1 .. P+R-1 predict response tokens 0 .. R-1 (plus one spare at the end)
            logits = model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
                logits_to_keep=r + 1,
            ).logits[:, :-1, :]
        return logprobs_from_logits(logits, response_ids, temperature, with_entropy)
    backbone = getattr(model, model.base_model_prefix)
    with autocast(input_ids.device, dtype):
        hidden = backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state[:, -r - 1 : -1, :]  # [B, R, H]
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


def packed_inputs(prompt_ids, prompt_mask, response_ids, response_mask):
    """One packed row from a padded micro-batch: (input_ids [1, T], position_ids [1, T], rows [n], cols [n],
    predictor positions [n]) where response token (rows[k], cols[k]) is predicted at packed position pred[k]."""
    device = prompt_ids.device
    pieces, positions, rows, cols, pred = [], [], [], [], []
    offset = 0
    for i in range(prompt_ids.shape[0]):
        prompt = prompt_ids[i][prompt_mask[i].bool()]
        response = response_ids[i][response_mask[i].bool()]
        n_p, n_r = prompt.shape[0], response.shape[0]
        pieces += [prompt, response]
        positions.append(torch.arange(n_p + n_r, device=device))
        rows.append(torch.full((n_r,), i, device=device))
        cols.append(torch.arange(n_r, device=device))
        pred.append(torch.arange(offset + n_p - 1, offset + n_p + n_r - 1, device=device))
        offset += n_p + n_r
    return (
        torch.cat(pieces).unsqueeze(0),
        torch.cat(positions).unsqueeze(0),
        torch.cat(rows),
        torch.cat(cols),
        torch.cat(pred),
    )


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
):
    """As `response_logprobs`, but the micro-batch runs as one packed row without padding: samples are
    concatenated, positions restart per sample, and attention stays within each sample (transformers
    reads the packing from the restarting position_ids; the KV cache stays off so nothing leaks)."""
    input_ids, position_ids, rows, cols, pred = packed_inputs(prompt_ids, prompt_mask, response_ids, response_mask)
    targets = response_ids[rows, cols]
    impl = resolve_impl(impl, input_ids.device)
    weight = lm_head_weight(model) if impl != "naive" else None
    with autocast(input_ids.device, dtype):
        if weight is None:
            logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits[0, pred]
        else:
            backbone = getattr(model, model.base_model_prefix)
            hidden = backbone(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
    if weight is None:
        logp, entropy = logprobs_from_logits(logits, targets, temperature, with_entropy)
    else:
        hidden = hidden[0, pred]
        compute = dtype if dtype != torch.float32 else hidden.dtype
        logp, entropy = logprob_entropy(hidden.to(compute), weight.to(compute), targets, temperature, impl=impl)
    shape = response_ids.shape
    out_lp = torch.zeros(shape, dtype=torch.float32, device=input_ids.device).index_put((rows, cols), logp.float())
    if not with_entropy:
        return out_lp, None
    out_ent = torch.zeros(shape, dtype=torch.float32, device=input_ids.device).index_put((rows, cols), entropy.float())
    return out_lp, out_ent


def sharded_forward(
    fn, tensors: dict[str, torch.Tensor], micro_batch_size: int, ctx=None, desc: str = "forward"
) -> torch.Tensor:
    """Apply `fn(part) -> [b, ...] CPU tensor` to micro-batches of the rows of `tensors`; under a launcher
    each rank takes a contiguous share of the rows and the results are gathered back in row order.

    Ranks run the same number of micro-batches (repeating their first when they have fewer), so a
    sharded (FSDP) model's collectives stay in step."""
    from rlx.engine.parallel.dist import all_gather_objects, all_reduce, shard_range

    b = next(iter(tensors.values())).shape[0]
    rows = shard_range(b, ctx.rank, ctx.world) if ctx is not None and ctx.distributed else range(b)
    starts = list(range(rows.start, rows.stop, micro_batch_size))
    count = len(starts)
    if ctx is not None and ctx.distributed:
        count = int(all_reduce(count, "max", device=ctx.device))
    out = []
    bar = tqdm(total=count, desc=desc, unit="batch", leave=False, disable=None if ctx is None or ctx.is_main else True)
    for i in range(count):
        lo = starts[i] if i < len(starts) else (starts[0] if starts else 0)
        hi = min(lo + micro_batch_size, rows.stop) if i < len(starts) else min(lo + 1, b)
        result = fn({k: v[lo:hi] for k, v in tensors.items()})
        if i < len(starts):
            out.append(result)
        bar.update(1)
    bar.close()
    local = torch.cat(out) if out else None
    if ctx is None or not ctx.distributed:
        return local
    return torch.cat([part for part in all_gather_objects(local) if part is not None])


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
) -> torch.Tensor:
    """Logprobs [B, R] (float32, CPU, zero at masked positions) computed in micro-batches without grad,
    split across ranks under a launcher (see `sharded_forward`)."""
    keys = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")

    def forward(part):
        part = {k: part[k].to(device) for k in keys}
        logp, _ = response_logprobs(model, **part, temperature=temperature, dtype=dtype, impl=impl)
        return (logp * part["response_mask"]).cpu()

    was_training = model.training
    model.eval()
    try:
        return sharded_forward(forward, {k: tensors[k] for k in keys}, micro_batch_size, ctx, desc)
    finally:
        model.train(was_training)
