"""3-D rotary positions (mRoPE) of one sample with images, as Qwen2-VL, Qwen2.5-VL, Qwen3-VL and GLM-4V use them.

Each token gets a (temporal, height, width) position. Text tokens get the same running index in all
three rows. An image whose grid is (t, h, w) patches occupies t * (h/m) * (w/m) placeholder tokens
(m = the spatial merge size); starting from the running index s, its tokens get temporal s (a still
image has t = 1), height s + row and width s + column of the merged grid, and the running index then
advances by max(h, w) / m. This equals the models' own `get_rope_index` for images (checked per family
in tests/unit/test_vision.py); rlx computes it per sample on the CPU, so packed rows simply concatenate the
samples' positions, which restart at 0 for every sample.

Which placeholder tokens are images: a single-turn sample's are its prompt's (a placeholder sampled into the
response is text); a multi-turn sample's images may also sit in its response (an environment's reply inserted
them), so it names each image's first token (`image_offsets`) and every other placeholder is text.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def image_token_count(grid_thw: Sequence[int], merge_size: int) -> int:
    """Placeholder tokens of one image with patch grid (t, h, w)."""
    t, h, w = (int(x) for x in grid_thw)
    return t * (h // merge_size) * (w // merge_size)


def _image_positions(grid_thw: Sequence[int], merge_size: int, start: int) -> torch.Tensor:
    """[3, count] positions of one image's tokens starting at running index `start`."""
    t, h, w = (int(x) for x in grid_thw)
    rows, cols = h // merge_size, w // merge_size
    temporal = torch.arange(t).view(t, 1, 1).expand(t, rows, cols)
    height = torch.arange(rows).view(1, rows, 1).expand(t, rows, cols)
    width = torch.arange(cols).view(1, 1, cols).expand(t, rows, cols)
    return torch.stack([temporal, height, width]).reshape(3, -1) + start


def image_token_mask(
    input_ids: Sequence[int] | torch.Tensor,
    image_token_id: int,
    image_grid_thw: torch.Tensor,
    merge_size: int,
    image_offsets: Sequence[int],
) -> torch.Tensor:
    """[L] bool: the tokens of one sample's images, image k's `image_token_count` tokens from `image_offsets[k]`
    (increasing; every token of each run must be the placeholder, else a ValueError)."""
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
    grids = image_grid_thw.reshape(-1, 3).tolist() if image_grid_thw is not None else []
    if len(grids) != len(image_offsets):
        raise ValueError(f"{len(image_offsets)} image offsets for {len(grids)} images")
    mask = torch.zeros(len(ids), dtype=torch.bool)
    end = 0
    for k, (offset, grid) in enumerate(zip(image_offsets, grids)):
        count = image_token_count(grid, merge_size)
        run = ids[offset : offset + count]
        if offset < end or len(run) != count or not bool((run == image_token_id).all()):
            raise ValueError(f"image {k} (grid {grid}) needs {count} placeholders from token {offset}")
        mask[offset : offset + count] = True
        end = offset + count
    return mask


def find_image_offsets(
    input_ids: Sequence[int] | torch.Tensor, image_token_id: int, counts: Sequence[int], candidates=None
) -> list[int]:
    """Where each image's tokens start: the placeholders among `candidates` ([L] bool, default all tokens) taken
    image by image, `counts[k]` tokens for image k (adjacent images need no separator); a ValueError when the
    placeholders do not make exactly these runs (an image's tokens are consecutive)."""
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
    found = ids == image_token_id
    if candidates is not None:
        found &= torch.as_tensor(candidates, dtype=torch.bool).reshape(-1)
    places = found.nonzero().squeeze(1).tolist()
    if len(places) != sum(counts):
        raise ValueError(f"{len(places)} image tokens for images of {list(counts)} tokens")
    offsets, at = [], 0
    for k, count in enumerate(counts):
        run = places[at : at + count]
        if run and run[-1] - run[0] != count - 1:
            raise ValueError(f"image {k}'s {count} tokens from token {run[0]} are not consecutive")
        offsets.append(run[0])
        at += count
    return offsets


def mrope_positions(
    input_ids: Sequence[int] | torch.Tensor,
    image_token_id: int,
    image_grid_thw: torch.Tensor,
    merge_size: int,
    image_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """[3, L] int64 mRoPE positions of one sample's tokens (prompt and response).

    `image_grid_thw` [n, 3]: the grids of the sample's images in the order their placeholders appear.
    Placeholders are consumed image by image (adjacent images need no separator); a run of placeholders
    that does not match the grids is a ValueError. `image_mask` [L] bool: which tokens are image tokens (see
    `image_token_mask`; other placeholders are text); default every placeholder.
    """
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
    grids = image_grid_thw.reshape(-1, 3).tolist() if image_grid_thw is not None else []
    is_image = (ids == image_token_id) if image_mask is None else image_mask.reshape(-1).bool()
    is_image = is_image.tolist()
    parts, cursor, running, image = [], 0, 0, 0
    length = len(is_image)
    while cursor < length:
        if not is_image[cursor]:
            end = cursor
            while end < length and not is_image[end]:
                end += 1
            parts.append(torch.arange(running, running + end - cursor).expand(3, -1))
            running += end - cursor
            cursor = end
            continue
        if image >= len(grids):
            raise ValueError(f"image placeholder at token {cursor} but only {len(grids)} image grids")
        count = image_token_count(grids[image], merge_size)
        if cursor + count > length or not all(is_image[cursor : cursor + count]):
            raise ValueError(f"image {image} (grid {grids[image]}) needs {count} placeholders from token {cursor}")
        parts.append(_image_positions(grids[image], merge_size, running))
        running += max(grids[image][1], grids[image][2]) // merge_size
        cursor += count
        image += 1
    if image != len(grids):
        raise ValueError(f"{len(grids)} image grids but placeholders for {image} images")
    return torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)


def left_padded_positions(
    sequences: Sequence[Sequence[int]], grids: Sequence[torch.Tensor], image_token_id: int, merge_size: int, width: int,
    masks: Sequence[torch.Tensor | None] | None = None,
) -> torch.Tensor:  # fmt: skip
    """[3, B, width] int64: each sample's mRoPE positions right-aligned in `width` columns (a left-padded batch;
    the padding columns hold 0). `grids[i]` [n_i, 3]: sample i's image grids; `masks[i]`: its image tokens (see
    `mrope_positions`)."""
    out = torch.zeros(3, len(sequences), width, dtype=torch.long)
    masks = masks if masks is not None else [None] * len(sequences)
    for row, (ids, sample_grids, mask) in enumerate(zip(sequences, grids, masks)):
        out[:, row, width - len(ids) :] = mrope_positions(ids, image_token_id, sample_grids, merge_size, mask)
    return out
