"""Generated questions about coloured shapes in an image, with exact answers, graded by the `shapes` reward.

    python -m rlx.tasks.shapes --out prompts.jsonl --num 1000 --seed 0
    python -m rlx.tasks.shapes --out prompts.jsonl --num 200 --data-uri --size 448 --grid 6
    python -m rlx.tasks.shapes --out prompts.jsonl --kinds total --max-count 3 --size 32 --grid 2 --min-side 0.75

Each prompt is one user message with an image part and a question. The image (rendered with Pillow:
circles, squares and triangles in four colours on a white canvas, one shape per cell of a grid at a
random size and offset, never touching) is needed to answer:

- 'count': "How many red shapes are there?" or "How many circles are there?" -> a number ('3');
- 'total': "How many shapes are there?" -> the number of shapes drawn, 1 to max_count, each equally likely: the
  question is always the same, so a model that does not look at the image cannot beat chance (1 / max_count);
  with big shapes in a 2 x 2 grid (the third command above) it is the data of recipes/tiny_vlm_shapes.toml;
- 'compare': "Are there more red or blue shapes?" -> the colour with more (never a tie), e.g. 'blue'.

Images are PNG files in a folder next to the prompts file (default `<stem>_images/`), referenced by paths
relative to the prompts file (rlx resolves them against its folder), or with `--data-uri` embedded in the
record as `data:image/png;base64,...` (needed for `--out -`).
"""

from __future__ import annotations

import argparse
import os
import random
from pathlib import Path

from PIL import Image, ImageDraw

from rlx.models.vision.images import data_uri
from rlx.utils.io import write_jsonl

COLOURS = {"red": (220, 30, 30), "green": (30, 160, 40), "blue": (30, 60, 220), "yellow": (230, 200, 20)}
SHAPES = ("circle", "square", "triangle")
KINDS = ("count", "compare", "total")
DEFAULT_KINDS = ("count", "compare")


def draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], colour: str) -> None:
    """Draw a filled `shape` inside `box` (left, top, right, bottom)."""
    fill = COLOURS[colour]
    left, top, right, bottom = box
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([((left + right) // 2, top), (right, bottom), (left, bottom)], fill=fill)


def render(
    items: list[tuple[str, str]], size: int, grid: int, rng: random.Random, min_side: float = 0.5
) -> Image.Image:
    """A `size` x `size` white image with one (shape, colour) item in each of distinct random grid cells, each
    shape's side between `min_side` of its cell and the cell less one pixel."""
    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    cell = size // grid
    for (shape, colour), index in zip(items, rng.sample(range(grid * grid), len(items))):
        # the last row and column of each cell stay white: shapes never touch
        side = rng.randint(min(int(cell * min_side), cell - 1), cell - 1)
        left = (index % grid) * cell + rng.randint(0, cell - 1 - side)
        top = (index // grid) * cell + rng.randint(0, cell - 1 - side)
        draw_shape(draw, shape, (left, top, left + side - 1, top + side - 1), colour)
    return image


def _count_question(rng: random.Random, max_count: int, cells: int) -> tuple[list, str, str]:
    """Items, question and answer of a counting question (by colour or by shape)."""
    by_colour = rng.random() < 0.5
    target = rng.choice(list(COLOURS)) if by_colour else rng.choice(SHAPES)
    count = rng.randint(0, max_count)
    others = rng.randint(0 if count else 1, min(max_count, cells - count))
    items = []
    for _ in range(count):
        items.append((rng.choice(SHAPES), target) if by_colour else (target, rng.choice(list(COLOURS))))
    while len(items) < count + others:
        shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
        if (colour if by_colour else shape) != target:
            items.append((shape, colour))
    noun = f"{target} shapes" if by_colour else f"{target}s"
    return items, f"How many {noun} are there? Answer with a number.", str(count)


def _total_question(rng: random.Random, max_count: int, cells: int) -> tuple[list, str, str]:
    """Items, question and answer of a question about every shape drawn."""
    count = rng.randint(1, min(max_count, cells))
    items = [(rng.choice(SHAPES), rng.choice(list(COLOURS))) for _ in range(count)]
    return items, "How many shapes are there? Answer with a number.", str(count)


def _compare_question(rng: random.Random, max_count: int, cells: int) -> tuple[list, str, str, list[str]]:
    """Items, question, answer and the two choices of a comparison question (never a tie)."""
    first, second = rng.sample(list(COLOURS), 2)
    more = rng.randint(1, min(max_count, cells))
    fewer = rng.randint(0, more - 1)
    counts = {first: more, second: fewer} if rng.random() < 0.5 else {first: fewer, second: more}
    items = [(rng.choice(SHAPES), colour) for colour, n in counts.items() for _ in range(n)]
    rng.shuffle(items)
    answer = max(counts, key=counts.get)
    question = f"Are there more {first} or {second} shapes? Answer with the colour."
    return items, question, answer, [first, second]


def generate_shapes(
    num: int,
    seed: int = 0,
    kinds: tuple[str, ...] = DEFAULT_KINDS,
    max_count: int = 4,
    size: int = 64,
    grid: int = 4,
    id_prefix: str = "shapes",
    min_side: float = 0.5,
) -> list[tuple[dict, Image.Image]]:
    """`num` (record, image) pairs, deterministic for a seed. The record's prompt holds an image part whose
    'image' is left empty for the caller to fill (a file path or a data: URI). Shapes' sides are between
    `min_side` of a grid cell and the cell less one pixel."""
    if unknown := set(kinds) - set(KINDS):
        raise ValueError(f"kinds must be among {', '.join(KINDS)}, got {sorted(unknown)}")
    most = max_count if set(kinds) == {"total"} else 2 * max_count  # shapes one image may need
    if not kinds or max_count < 1 or grid < 2 or size < 4 * grid or most > grid * grid or not 0 < min_side <= 1:
        raise ValueError(
            f"need kinds, max_count >= 1, grid >= 2, size >= 4 x grid, {most // max_count} x max_count <= grid^2"
            " and 0 < min_side <= 1"
        )
    rng = random.Random(seed)
    width = len(str(num - 1))
    out = []
    for i in range(num):
        kind = rng.choice(kinds)
        extra = {}
        if kind == "count":
            items, question, answer = _count_question(rng, max_count, grid * grid)
        elif kind == "total":
            items, question, answer = _total_question(rng, max_count, grid * grid)
        else:
            items, question, answer, extra["choices"] = _compare_question(rng, max_count, grid * grid)
        content = [{"type": "image", "image": ""}, {"type": "text", "text": question}]
        record = {"id": f"{id_prefix}-{i:0{width}d}", "prompt": [{"role": "user", "content": content}],
                  "data_source": "shapes", "ground_truth": answer, "kind": kind, **extra}  # fmt: skip
        out.append((record, render(items, size, grid, rng, min_side)))
    return out


def write_shapes(out: str | Path, pairs: list[tuple[dict, Image.Image]], embed: bool, image_dir=None) -> Path | None:
    """Write the prompts file; images go into `image_dir` (default `<stem>_images` next to `out`) as PNG files
    referenced relative to `out`'s folder, or into the records as data: URIs with `embed`. Returns the folder."""
    folder = None
    if not embed:
        if str(out) == "-":
            raise ValueError("--out - needs --data-uri (image files are referenced relative to the prompts file)")
        folder = Path(image_dir) if image_dir else Path(out).with_name(Path(out).stem + "_images")
        folder.mkdir(parents=True, exist_ok=True)
    for record, image in pairs:
        part = record["prompt"][0]["content"][0]
        if embed:
            part["image"] = data_uri(image)
        else:
            image.save(folder / f"{record['id']}.png", format="PNG")
            part["image"] = os.path.relpath(folder / f"{record['id']}.png", Path(out).parent)
    write_jsonl(out, [record for record, _ in pairs])
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description="Write generated shape questions with images as prompts.jsonl.")
    parser.add_argument("--out", required=True, help="prompts.jsonl to write ('-' for stdout, with --data-uri)")
    parser.add_argument("--num", type=int, default=1000, help="number of questions (default 1000)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument(
        "--kinds",
        default=",".join(DEFAULT_KINDS),
        help=f"question kinds, comma-separated, among {', '.join(KINDS)} (default count,compare)",
    )
    parser.add_argument("--max-count", type=int, default=4, help="most shapes counted or compared (default 4)")
    parser.add_argument("--size", type=int, default=64, help="image side in pixels (default 64)")
    parser.add_argument("--grid", type=int, default=4, help="cells per image side, one shape per cell (default 4)")
    parser.add_argument(
        "--min-side", type=float, default=0.5, help="smallest shape side, as a fraction of a grid cell (default 0.5)"
    )
    parser.add_argument("--data-uri", action="store_true", help="embed images as data: URIs instead of PNG files")
    parser.add_argument("--image-dir", default=None, help="folder for the PNG files (default <stem>_images)")
    args = parser.parse_args()
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    pairs = generate_shapes(args.num, args.seed, kinds, args.max_count, args.size, args.grid, min_side=args.min_side)
    write_shapes(args.out, pairs, args.data_uri, args.image_dir)


if __name__ == "__main__":
    main()
