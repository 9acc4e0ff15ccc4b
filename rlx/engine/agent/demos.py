"""Demonstrations as multi-turn rollouts: an environment's episodes whose assistant turns a script writes.

    python -m rlx.engine.agent.demos --model DIR --env rlx.tasks.calculator:CalculatorEnv \
        --teacher rlx.tasks.calculator:teacher --prompts prompts.jsonl --out demos.jsonl

`teacher(context) -> str` gets the conversation so far as the chat template rendered it (the opening prompt,
earlier turns and the environment's replies, as text) and returns the next assistant message's text. The
episodes run through the same driver as model rollouts (tool calls parsed, environment stepped, limits), with a
scripted engine in place of the model: each turn is the teacher's text tokenised, then the end-of-turn token,
with loss_mask 1 and logprob 0. A small model that cannot find a tool-call format by chance can then be warm
started on them through the usual commands: `rlx score --reward env --old-logprobs rollout` (one sample per
prompt: the advantage is the reward) and `rlx train-step --policy-loss gpg` (the loss is -advantage * logprob,
so the update raises the likelihood of the demonstrated turns).
"""

from __future__ import annotations

import argparse
from collections import deque
from collections.abc import Callable

from rlx.engine.agent.config import AgentConfig
from rlx.engine.agent.driver import EnvRollout
from rlx.engine.agent.environment import load_object
from rlx.engine.records import PromptRecord, RolloutRecord, read_prompts, write_records
from rlx.engine.rollout.base import TokenStream
from rlx.engine.rollout.config import SamplingParams
from rlx.engine.rollout.requests import Generated, TokenRequest
from rlx.errors import UserError


class ScriptedEngine:
    """The part of a rollout engine the driver uses (`stop_ids`, `open_stream`), answering with a teacher's text."""

    ctx = None

    def __init__(self, teacher: Callable[[str], str], tokenizer, name: str = "teacher"):
        if tokenizer.eos_token_id is None:
            raise UserError("demonstrations need a tokenizer with an end-of-turn (EOS) token")
        self.teacher, self.tokenizer, self.name = teacher, tokenizer, name
        self.stop_ids = {tokenizer.eos_token_id}

    def open_stream(self, sampling: SamplingParams, max_context: int, num_seqs: int) -> TokenStream:
        return ScriptedStream(self, sampling)


class ScriptedStream(TokenStream):
    """Every submitted request answered at the next step."""

    def __init__(self, engine: ScriptedEngine, sampling: SamplingParams):
        super().__init__(sampling)
        self.engine = engine
        self.queue: deque[tuple[object, TokenRequest]] = deque()

    def submit(self, tag, request: TokenRequest) -> None:
        self.check(request)
        self.queue.append((tag, request))

    @property
    def has_work(self) -> bool:
        return bool(self.queue)

    def step(self) -> list[tuple[object, Generated]]:
        out = []
        while self.queue:
            tag, request = self.queue.popleft()
            out.append((tag, self._turn(request)))
        return out

    def _turn(self, request: TokenRequest) -> Generated:
        engine, tokenizer = self.engine, self.engine.tokenizer
        text = engine.teacher(tokenizer.decode(request.prompt_ids))
        if not isinstance(text, str):
            raise UserError(f"teacher {engine.name} returned {type(text).__name__} for {request.key}, expected text")
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
        if len(ids) > request.max_new_tokens:
            ids = ids[: request.max_new_tokens]
            return Generated(ids, [0.0] * len(ids), "length")
        return Generated(ids, [0.0] * len(ids), "stop")


def demonstrate(
    tokenizer, teacher: Callable[[str], str] | str, prompts: list[PromptRecord], cfg: AgentConfig,
    max_new_tokens: int = 256,
) -> list[RolloutRecord]:  # fmt: skip
    """One demonstrated episode of `cfg.env` per prompt (sample index 0), as rollout records."""
    name = teacher if isinstance(teacher, str) else getattr(teacher, "__name__", "teacher")
    fn = load_object(teacher, "--teacher") if isinstance(teacher, str) else teacher
    engine = ScriptedEngine(fn, tokenizer, name)
    sampling = SamplingParams(n=1, max_new_tokens=max_new_tokens, temperature=0.0)
    return EnvRollout(engine, tokenizer, sampling, cfg).generate(prompts)


def main() -> None:
    from rlx.models.loading import load_tokenizer, resolve_source

    parser = argparse.ArgumentParser(description="Write demonstrated episodes of an environment as rollouts.jsonl.")
    parser.add_argument("--model", required=True, help="model dir or checkpoint whose tokenizer and template to use")
    parser.add_argument("--env", required=True, help="the environment, path/file.py:NAME or package.module:NAME")
    parser.add_argument("--teacher", required=True, help="teacher(context) -> text, path/file.py:NAME or module:NAME")
    parser.add_argument("--prompts", required=True, help="prompts.jsonl")
    parser.add_argument("--out", required=True, help="rollouts.jsonl to write")
    parser.add_argument("--num-prompts", type=int, default=0, help="use this many prompts (0 = all)")
    parser.add_argument("--max-turns", type=int, default=8, help="most assistant turns per episode (default 8)")
    parser.add_argument("--max-total-tokens", type=int, default=4096, help="most tokens per episode (default 4096)")
    args = parser.parse_args()
    prompts = read_prompts(args.prompts)
    prompts = prompts[: args.num_prompts] if args.num_prompts else prompts
    cfg = AgentConfig(env=args.env, max_turns=args.max_turns, max_total_tokens=args.max_total_tokens)
    records = demonstrate(load_tokenizer(resolve_source(args.model)), args.teacher, prompts, cfg)
    write_records(args.out, records)


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        raise SystemExit(f"demos: {e}") from None
