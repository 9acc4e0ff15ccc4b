"""Forwards of vision-language models over rlx's token layouts: packed rows ("remove padding", with or without
sequence parallelism) and padded batches.

rlx's packed forward (`rlx.logprobs.packed_response_logprobs`, the value path, Ulysses) calls the
model's backbone with one row of concatenated samples: `input_ids` [1, T/sp] (this rank's slice of the
row padded to T_pad), 1-D `position_ids`, and the attention kwargs `cu_seq_lens_q/k`, `max_length_q/k`
(and `sp_group` under sequence parallelism) describing the whole padded row; the padded forward
(`response_logprobs`) calls it with `input_ids` [B, P+R] and an attention mask. A vision-language model needs
more: the images, 3-D mRoPE positions, and the image embeddings in the image tokens before the decoder.
`vision_forward(model, row)` supplies them without replacing any forward method, through two forward pre-hooks
that live while the context is open:

1. on the backbone (e.g. `Qwen2VLModel`): the vision tower runs on the row's images and its rows replace the
   embeddings of the images' placeholders (`VisionRow.image_mask`); the backbone then takes these
   embeddings (`inputs_embeds`, no pixels) and the row's 3-D positions, and the packing kwargs are held back
   (the vision tower never sees them: its attention stays per image). Only the images' placeholders (a prompt's,
   or a multi-turn sample's where its offsets say) take image rows: a placeholder token sampled into a response
   is embedded as text, as the rollout engines did;
2. on the decoder (`language_model`): the merged embeddings, the 3-D positions and, for Qwen3-VL, the
   DeepStack mask and features are padded to T_pad and cut to this rank's slice (all of them when
   sp = 1), and the held attention kwargs are handed to it. Sample boundaries therefore come from
   `cu_seq_lens_q` explicitly: 3-D positions do not show where samples restart.

Under sequence parallelism every rank runs the vision tower on all of the micro-batch's images (images
may straddle the split) and keeps the embeddings of its own slice; gradients reach the tower only
through the rank's own tokens, so summing over the sp ranks (as for the token embeddings) gives the
one-rank gradient. The padding of the row forms a sample of its own, as in `shard_packed`.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from rlx.errors import UserError
from rlx.models.vision.families import VisionFamily, vision_family_of
from rlx.models.vision.features import image_features
from rlx.models.vision.inputs import VisionInputs
from rlx.models.vision.positions import mrope_positions

# attention kwargs of rlx's packed forward that belong to the decoder only
DECODER_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "sp_group")


@dataclass(frozen=True)
class VisionRow:
    """Samples with their images as `vision_forward` adds them to a token layout: one packed row ([1, T]), or a
    padded batch ([B, T])."""

    input_ids: torch.Tensor
    """[N, T] int64: the tokens (N = 1: the samples one after another; a padded batch: one row per sample)."""
    position_ids: torch.Tensor
    """[3, N, T] int64: each sample's mRoPE positions, restarting at 0 per sample (0 at padding)."""
    image_mask: torch.Tensor
    """[N, T] bool: the images' placeholders (a single-turn sample's prompt's; where a multi-turn sample's images
    sit, `VisionInputs.image_offsets`), which take the images' rows in order."""
    vision: VisionInputs
    """The samples' images, in row order."""

    @property
    def total_len(self) -> int:
        """T, the tokens of the row."""
        return self.input_ids.shape[1]

    @classmethod
    def build(cls, sequences: list, vision: VisionInputs, config, prompt_lengths: list[int] | None = None) -> VisionRow:
        """Token-id sequences (one per sample, each a list or 1-D tensor; `prompt_lengths`: how many of each are
        prompt, default all) and their images -> a packed row."""
        if len(sequences) != vision.num_samples:
            raise ValueError(f"{len(sequences)} sequences but vision inputs for {vision.num_samples} samples")
        family = vision_family_of(config)
        token, merge = family.image_token_id(config), family.merge_size(config)
        ids = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in sequences]
        lengths = prompt_lengths if prompt_lengths is not None else [len(s) for s in ids]
        masks = [vision.image_mask(i, s, token, merge, n) for i, (s, n) in enumerate(zip(ids, lengths))]
        grids = [vision.grids_of(i) for i in range(len(ids))]
        positions = [mrope_positions(s, token, g, merge, m) for s, g, m in zip(ids, grids, masks)]
        return cls(torch.cat(ids)[None], torch.cat(positions, dim=1)[:, None], torch.cat(masks)[None], vision)

    @classmethod
    def from_padded(cls, prompt_ids, prompt_mask, response_ids, response_mask, vision: VisionInputs, config):
        """The row of a padded micro-batch (left-padded prompts, right-padded responses), in the same order
        and with the same tokens as `rlx.logprobs.PackedRows.build` packs it."""
        ids = torch.cat([prompt_ids, response_ids], dim=1).cpu()
        mask = torch.cat([prompt_mask, response_mask], dim=1).bool().cpu()
        prompt_lengths = prompt_mask.sum(-1).tolist()
        return cls.build([row[keep] for row, keep in zip(ids, mask)], vision, config, prompt_lengths)

    @classmethod
    def padded(cls, prompt_ids, prompt_mask, response_ids, response_mask, vision: VisionInputs, config) -> VisionRow:
        """The same micro-batch in its padded layout [B, P+R] (the model's own forward with an attention mask)."""
        row = cls.from_padded(prompt_ids, prompt_mask, response_ids, response_mask, vision, config)
        mask = torch.cat([prompt_mask, response_mask], dim=1).bool().cpu()
        positions = torch.zeros(3, *mask.shape, dtype=torch.long)
        positions[:, mask] = row.position_ids[:, 0]
        image_mask = torch.zeros(mask.shape, dtype=torch.bool)
        image_mask[mask] = row.image_mask[0]
        ids = torch.cat([prompt_ids, response_ids], dim=1).cpu()
        return cls(ids, positions, image_mask, vision)

    def to(self, device, dtype: torch.dtype | None = None) -> VisionRow:
        """The row on `device` (pixels cast to `dtype` when given)."""
        return VisionRow(
            self.input_ids.to(device), self.position_ids.to(device), self.image_mask.to(device),
            self.vision.to(device, dtype),
        )  # fmt: skip


def _pad_and_slice(x: torch.Tensor, dim: int, total: int, rank: int, size: int, fill) -> torch.Tensor:
    """`x` padded along `dim` to `total` with `fill` (a value, or a tensor of the padding), then this rank's
    chunk of `size`."""
    pad = total - x.shape[dim]
    if pad:
        if not isinstance(fill, torch.Tensor):
            shape = list(x.shape)
            shape[dim] = pad
            fill = x.new_full(shape, fill)
        x = torch.cat([x, fill], dim=dim)
    return x.chunk(size, dim=dim)[rank] if size > 1 else x


def _local_decoder_inputs(kwargs: dict, row: VisionRow, rank: int, size: int) -> dict:
    """The decoder's kwargs for this rank: embeddings, positions and DeepStack inputs of its slice."""
    length = row.total_len
    total = -(-length // size) * size
    embeds = kwargs["inputs_embeds"]  # [1, T, H]
    kwargs["inputs_embeds"] = _pad_and_slice(embeds, 1, total, rank, size, 0.0)
    pad_positions = torch.arange(total - length, device=embeds.device).expand(3, 1, -1)  # the padding's own sample
    kwargs["position_ids"] = _pad_and_slice(kwargs["position_ids"], 2, total, rank, size, pad_positions)
    mask = kwargs.get("visual_pos_masks")
    if mask is not None and size > 1:  # Qwen3-VL DeepStack: features of the visual tokens in this slice
        before = torch.cat([mask.new_zeros(1), mask.reshape(-1).long().cumsum(0)])
        chunk = total // size
        lo, hi = (int(before[min(x, length)]) for x in (rank * chunk, (rank + 1) * chunk))
        kwargs["visual_pos_masks"] = _pad_and_slice(mask, 1, total, rank, size, False)
        kwargs["deepstack_visual_embeds"] = [e[lo:hi] for e in kwargs["deepstack_visual_embeds"]]
    return kwargs


def set_decoder_attention(model: torch.nn.Module, name: str) -> None:
    """Switch only the decoder of a vision-language `model` to the registered attention function `name` (e.g.
    "rlx_varlen", "rlx_ulysses"); the vision tower keeps its own (sdpa or flash attention per image), which is
    what it needs on GPUs. Switching the whole model works too: the tower then calls `name` once per image."""
    model.set_attn_implementation({"text_config": name})
    if vision_family_of(model.config).decoder(model).config._attn_implementation != name:
        raise UserError(f"{type(model).__name__}: its decoder does not take the attention function {name!r}")


def _merged_embeddings(model: torch.nn.Module, row: VisionRow, held: dict) -> torch.Tensor:
    """The row's token embeddings [N, T, H] with the images' placeholders replaced by the vision tower's
    rows; DeepStack features (Qwen3-VL) go into `held` for the decoder."""
    embeds = model.get_input_embeddings()(row.input_ids)
    if row.vision.pixel_values is None:
        return embeds
    features = image_features(model, row.vision)
    if int(row.image_mask.sum()) != features.embeds.shape[0]:
        raise ValueError(f"{int(row.image_mask.sum())} image placeholders for {features.embeds.shape[0]} image rows")
    embeds = embeds.masked_scatter(row.image_mask[..., None], features.embeds.to(embeds.dtype))
    if features.deepstack:
        held.update(visual_pos_masks=row.image_mask, deepstack_visual_embeds=list(features.deepstack))
    return embeds


@contextmanager
def vision_forward(model: torch.nn.Module, row: VisionRow, sp_rank: int = 0, sp_degree: int = 1):
    """While open, forwards of `model` over `row`'s layout (packed rows as rlx's packed path builds them, this
    rank's slice under sequence parallelism `sp_rank` of `sp_degree`; or the padded batch of `VisionRow.padded`) run
    as the vision-language forward of `row`, which must hold the same samples (it is moved to the model's
    device)."""
    family: VisionFamily = vision_family_of(model.config)
    backbone = getattr(model, model.base_model_prefix)
    row = row.to(next(model.parameters()).device)  # a no-op when it is there already
    held: dict = {}
    local_len = -(-row.total_len // sp_degree)

    def on_backbone(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None or ids.shape != (row.input_ids.shape[0], local_len):
            shape = None if ids is None else tuple(ids.shape)
            want = (row.input_ids.shape[0], local_len)
            raise ValueError(f"vision_forward: input_ids {shape} are not this rank's slice of the row {want}")
        held.clear()
        held.update({k: kwargs.pop(k) for k in DECODER_KWARGS if k in kwargs})
        embeds = _merged_embeddings(model, row, held)
        kwargs.update(input_ids=None, inputs_embeds=embeds, position_ids=row.position_ids)
        return (), kwargs

    def on_decoder(module, args, kwargs):
        kwargs.update(held)
        return args, _local_decoder_inputs(kwargs, row, sp_rank, sp_degree)

    handles = [
        backbone.register_forward_pre_hook(on_backbone, with_kwargs=True),
        family.decoder(model).register_forward_pre_hook(on_decoder, with_kwargs=True),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
