"""A multi-turn task with pictures in the environment's replies: shape questions the model may look at again.

    python -m rlx.tasks.shapes_look --out prompts.jsonl --num 200 --seed 0        # rlx.tasks.shapes questions
    rlx rollout --model VLM --prompts prompts.jsonl --env rlx.tasks.shapes_look:LookAgainEnv --max-turns 4 ...

The prompts are `rlx.tasks.shapes` questions (images embedded as data: URIs). `LookAgainEnv` opens with the
prompt's message, picture included, and offers one tool, `look` (no arguments), whose reply is a tool message
holding the picture again at `ZOOM` times its size (rendered in code from the prompt's image: more image tokens,
finer detail) and a line of text. A turn without a tool call is the answer, graded as the `shapes` reward grades it
(the last number, or the last of the two colours named): right -> reward 1 and the episode ends; wrong -> the user
answers "Not quite. Look again:" with the enlarged picture, until `max_answers` answers were given (reward 0).
A model that never calls the tool still sees an image in every reply after a wrong answer.
"""

from __future__ import annotations

import argparse
import re

from PIL import Image

from rlx.models.vision.images import data_uri, image_refs, load_image
from rlx.tasks.shapes import DEFAULT_KINDS, generate_shapes, write_shapes

ZOOM = 2
"""How much larger the picture comes back from `look` and after a wrong answer."""
LOOK_TOOL = {
    "type": "function",
    "function": {
        "name": "look",
        "description": "See the picture again, twice as large",
        "parameters": {"type": "object", "properties": {}},
    },
}
_INTEGER = re.compile(r"-?\d+")


def is_correct(answer: str, truth: str, choices: list[str] | None = None) -> bool:
    """A numeric truth must be the answer's last integer; a colour the last of `choices` (any word without) named."""
    if _INTEGER.fullmatch(truth):
        found = _INTEGER.findall(answer)
    else:
        pattern = r"\b(" + "|".join(re.escape(c) for c in choices) + r")\b" if choices else r"[A-Za-z]+"
        found = re.findall(pattern, answer, flags=re.IGNORECASE)
    return bool(found) and found[-1].lower() == truth.lower()


class LookAgainEnv:
    """One shapes question with its picture; `look` and every wrong answer bring the picture back enlarged."""

    tools = [LOOK_TOOL]
    max_answers = 2
    """Answers graded before the episode ends with reward 0."""

    def __init__(self, record: dict):
        self.opening = [dict(m) for m in record["prompt"]]
        refs = image_refs(self.opening, record.get("id"))
        if len(refs) != 1:
            raise ValueError(f"a shapes question has one picture, record {record.get('id')!r} has {len(refs)}")
        self.picture = refs[0]
        self.truth, self.choices = str(record["ground_truth"]), record.get("choices")
        self.answers = 0

    def reset(self) -> list[dict]:
        return [dict(m) for m in self.opening]

    def enlarged(self) -> dict:
        """The picture at ZOOM times its size (nearest neighbour: the same shapes, sharper edges), as an image part."""
        image = load_image(self.picture)
        size = (image.width * ZOOM, image.height * ZOOM)
        return {"type": "image", "image": data_uri(image.resize(size, Image.Resampling.NEAREST))}

    def step(self, message: dict) -> tuple[list[dict], float, bool]:
        calls = message.get("tool_calls") or []
        if calls:
            return [self._tool_reply(call) for call in calls], 0.0, False
        self.answers += 1
        if is_correct(message.get("content") or "", self.truth, self.choices):
            return [], 1.0, True
        if self.answers >= self.max_answers:
            return [], 0.0, True
        content = [{"type": "text", "text": "Not quite. Look again:"}, self.enlarged()]
        return [{"role": "user", "content": content}], 0.0, False

    def _tool_reply(self, call: dict) -> dict:
        name = call.get("function", {}).get("name")
        if name != "look":
            content = f"error: unknown tool {name!r}"
        else:
            content = [self.enlarged(), {"type": "text", "text": "The picture, enlarged."}]
        return {"role": "tool", "tool_call_id": call.get("id"), "content": content}


def main() -> None:
    parser = argparse.ArgumentParser(description="Write shape questions (images as data: URIs) for LookAgainEnv.")
    parser.add_argument("--out", required=True, help="prompts.jsonl to write ('-' for stdout)")
    parser.add_argument("--num", type=int, default=200, help="number of questions (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--kinds", default=",".join(DEFAULT_KINDS), help="question kinds (as rlx.tasks.shapes)")
    parser.add_argument("--size", type=int, default=32, help="image side in pixels (default 32)")
    parser.add_argument("--grid", type=int, default=2, help="cells per image side (default 2)")
    parser.add_argument("--max-count", type=int, default=2, help="most shapes counted or compared (default 2)")
    args = parser.parse_args()
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    pairs = generate_shapes(args.num, args.seed, kinds, args.max_count, args.size, args.grid, id_prefix="look")
    write_shapes(args.out, pairs, embed=True)


if __name__ == "__main__":
    main()
