"""Multi-turn rollout cost split: generation vs building each turn's prompt tokens vs waiting for environments.

    python bench/multi_turn.py --turns 8 --samples 32 --max-new-tokens 16 --style qwen3

A tiny random chat model (turns made to stop after a few tokens by biasing <|im_end|>) plays an
environment that answers every turn with a tool result and a user message, for exactly --turns
turns. Prints the driver's timings: `timing/render_s` is the template work of rlx's token-exact
prompt building (the new messages' tokens per turn), `timing/generate_s` the engine calls (their
prefill included), `timing/env_s` the environment steps. Runs on the hf engine (CPU or one GPU).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from rlx.engine.agent.hf_tokens import HFTokenEngine
from transformers import AutoModelForCausalLM

from rlx.engine.agent.config import AgentConfig
from rlx.engine.agent.driver import EnvRollout
from rlx.engine.parallel.dist import DistContext
from rlx.engine.records import PromptRecord
from rlx.engine.rollout.base import build_engine
from rlx.engine.rollout.config import RolloutConfig
from rlx.models.tiny import SPECIAL_TOKENS
from rlx.models.tiny_chat import MARKUP_TOKENS, build_chat_tokenizer, tiny_chat_config
from rlx.utils.device import resolve_device

ENV = """
class Chatty:
    def __init__(self, record):
        self.turns, self.limit = 0, record["turns"]

    def reset(self):
        return [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Begin."}]

    def step(self, message):
        self.turns += 1
        if self.turns >= self.limit:
            return [], 1.0, True
        reply = [{"role": "tool", "content": "result " + str(self.turns)}, {"role": "user", "content": "Next."}]
        return reply, 0.0, False
"""


def stopping_chat_model(tokenizer, hidden_size: int, num_layers: int):
    """Random weights; a constant embedding dimension read by the head makes <|im_end|> likely and rules out
    special and markup tokens (no stray tool calls)."""
    config = tiny_chat_config(tokenizer, hidden_size=hidden_size, num_layers=num_layers, max_positions=4096)
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        model.lm_head.weight[:, 0] = 0.0
        banned = tokenizer.convert_tokens_to_ids([*SPECIAL_TOKENS, "<|im_start|>", *MARKUP_TOKENS])
        model.lm_head.weight[banned, 0] = -10.0
        model.lm_head.weight[tokenizer.eos_token_id, 0] = 0.6
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--style", default="qwen3", choices=("qwen2.5", "qwen3"))
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    args = parser.parse_args()
    tokenizer = build_chat_tokenizer(args.style)
    device = resolve_device("auto")
    model = stopping_chat_model(tokenizer, args.hidden_size, args.num_layers).to(device)
    engine = build_engine(RolloutConfig(precision="float32"), model, tokenizer, DistContext(device=device))
    env_file = Path(tempfile.mkdtemp()) / "chatty.py"
    env_file.write_text(ENV)
    sampling = RolloutConfig(n=1, max_new_tokens=args.max_new_tokens, temperature=1.0, batch_size=args.samples)
    kwargs = {"enable_thinking": False} if args.style == "qwen3" else {}
    cfg = AgentConfig(
        env=f"{env_file}:Chatty", max_turns=args.turns, max_total_tokens=4096, chat_template_kwargs=kwargs
    )
    prompts = [PromptRecord(id=str(i), prompt="-", extra={"turns": args.turns}) for i in range(args.samples)]
    runner = EnvRollout(HFTokenEngine(engine), tokenizer, engine.stop_ids, sampling, cfg)
    began = time.perf_counter()
    runner.generate(prompts)
    stats = {**runner.last_stats, "timing/total_s": time.perf_counter() - began}
    stats["render_share_of_generate"] = stats["timing/render_s"] / stats["timing/generate_s"]
    stats["render_ms_per_turn"] = 1000 * stats["timing/render_s"] / (args.samples * stats["rollout/turns_mean"])
    print(json.dumps({"device": str(device), "args": vars(args), **stats}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
