"""3-D rotary positions (mRoPE) of one sample with images, as Qwen2-VL, Qwen2.5-VL, Qwen3-VL and GLM-4V use them.

Each token gets a (temporal, height, width) position. Text tokens get the same running index in all
three rows. An image whose grid is (t, h, w) patches occupies t * (h/m) * (w/m) placeholder tokens
(m = the spatial merge size); starting from the running index s, its tokens get temporal s (a still
image has t = 1), height s + row and width s + column of the merged grid, and the running index then
advances by max(h, w) / m. This equals the models' own `get_rope_index` for images (checked per family
in tests/test_vision.py); rlx computes it per sample on the CPU, so packed rows simply concatenate the
samples' positions, which restart at 0 for every sample.
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


def mrope_positions(
    input_ids: Sequence[int] | torch.Tensor, image_token_id: int, image_grid_thw: torch.Tensor, merge_size: int
) -> torch.Tensor:
    """[3, L] int64 mRoPE positions of one sample's tokens (prompt and response).

    `image_grid_thw` [n, 3]: the grids of the sample's images in the order their placeholders appear.
    Placeholders are consumed image by image (adjacent images need no separator); a run of placeholders
    that does not match the grids is a ValueError.
    """
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
    grids = image_grid_thw.reshape(-1, 3).tolist() if image_grid_thw is not None else []
    is_image = (ids == image_token_id).tolist()
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


def sample_positions(
    input_ids: Sequence[int] | torch.Tensor, prompt_len: int, image_token_id: int, image_grid_thw, merge_size: int
) -> torch.Tensor:
    """[3, L] int64 positions of a prompt and its response: the prompt's mRoPE positions, then one text position
    per response token from one past the prompt's largest (what the rollout engines decode at). A placeholder
    token sampled into the response is text: only the prompt's placeholders are images."""
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
    prompt = mrope_positions(ids[:prompt_len], image_token_id, image_grid_thw, merge_size)
    start = int(prompt.max()) + 1 if prompt.numel() else 0
    response = torch.arange(start, start + len(ids) - prompt_len).expand(3, -1)
    return torch.cat([prompt, response], dim=1)


def left_padded_positions(
    sequences: Sequence[Sequence[int]], grids: Sequence[torch.Tensor], image_token_id: int, merge_size: int, width: int
) -> torch.Tensor:
    """[3, B, width] int64: each sample's mRoPE positions right-aligned in `width` columns (a left-padded batch;
    the padding columns hold 0). `grids[i]` [n_i, 3]: sample i's image grids."""
    out = torch.zeros(3, len(sequences), width, dtype=torch.long)
    for row, (ids, sample_grids) in enumerate(zip(sequences, grids)):
        out[:, row, width - len(ids) :] = mrope_positions(ids, image_token_id, sample_grids, merge_size)
    return out
