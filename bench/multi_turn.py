"""Multi-turn rollouts on the hf and native engines: throughput, time waiting on environments, prompt building.

    python bench/multi_turn.py                                  # 256 samples x 4 turns, native vs hf
    python bench/multi_turn.py --turns 8 --engines native       # prompt-building cost at 8 turns
    python bench/multi_turn.py --samples 16 --hidden-size 64 --num-layers 2   # a CPU smoke run

A random chat model (turns made to stop after a few tokens by biasing <|im_end|>; --hidden-size/--num-layers
size it, 0.5B-like by default) plays a cheap environment that answers every turn with a tool result and a
user message after sleeping --env-ms (uniform in [0, 2 x env-ms], per step), for exactly --turns turns.
Per engine it prints tokens/s (model tokens over the whole rollout), `perf/env_wait_share` (the share of the
rollout in which the engine had nothing to run because every live sample waited on its environment),
`render_share_of_engine` (rlx's token-exact prompt building: the new messages' template tokens per turn,
over the engine's time) and, for the native engine, the prefill tokens per turn against the tokens found in
its prefix cache (a later turn re-uses its earlier turns' KV blocks, so only the new tokens are prefilled).
The two engines give the same trajectories for the seed (checked, greedy runs: --temperature 0).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from rlx.agent.driver import EnvRollout
from rlx.formats.records import PromptRecord
from rlx.models.tiny import SPECIAL_TOKENS
from rlx.models.tiny_chat import MARKUP_TOKENS, build_chat_tokenizer, tiny_chat_config
from rlx.parallel.dist import DistContext
from rlx.rollout.agent_config import AgentConfig
from rlx.rollout.base import build_engine
from rlx.rollout.config import NativeConfig, RolloutConfig, SamplingParams
from rlx.utils.device import resolve_device

ENV = """
import random
import time


class Chatty:
    def __init__(self, record):
        self.turns, self.limit, self.ms = 0, record["turns"], record["env_ms"]
        self.rng = random.Random(record["seed"])

    def reset(self):
        return [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Begin."}]

    def step(self, message):
        time.sleep(self.rng.uniform(0, 2 * self.ms) / 1000)
        self.turns += 1
        if self.turns >= self.limit:
            return [], 1.0, True
        reply = [{"role": "tool", "content": "result " + str(self.turns)}, {"role": "user", "content": "Next."}]
        return reply, 0.0, False
"""


def stopping_chat_model(tokenizer, hidden_size: int, num_layers: int):
    """Random weights; a constant embedding dimension read by the head makes <|im_end|> likely and rules out
    special and markup tokens (no stray tool calls). The constant is large (20) so that it still dominates the
    residual stream after many random layers (with 1.0, a 24-layer model never stopped: p(eos) 0.005); the head's
    <|im_end|> weight 0.25 gives p(eos) ~0.13 per token at the default size (turns of ~8 tokens; 0.6 gave 0.8)."""
    config = tiny_chat_config(tokenizer, hidden_size=hidden_size, num_layers=num_layers, max_positions=4096)
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 20.0
        model.lm_head.weight[:, 0] = 0.0
        banned = tokenizer.convert_tokens_to_ids([*SPECIAL_TOKENS, "<|im_start|>", *MARKUP_TOKENS])
        model.lm_head.weight[banned, 0] = -10.0
        model.lm_head.weight[tokenizer.eos_token_id, 0] = 0.25
    return model


def run(engine_name: str, model, tokenizer, device, args, env_file: Path) -> tuple[dict, list]:
    settings = RolloutConfig(
        engine=engine_name,
        precision=args.precision,
        batch_size=args.samples,
        kv_cache_gib=args.kv_cache_gib,
        native=NativeConfig(max_num_seqs=args.samples),
    )
    engine = build_engine(settings, model, tokenizer, DistContext(device=device))
    sampling = SamplingParams(n=1, max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=1)
    kwargs = {"enable_thinking": False} if args.style == "qwen3" else {}
    cfg = AgentConfig(
        env=f"{env_file}:Chatty", max_turns=args.turns, max_total_tokens=4096, chat_template_kwargs=kwargs
    )
    prompts = [
        PromptRecord(id=str(i), prompt="-", extra={"turns": args.turns, "env_ms": args.env_ms, "seed": i})
        for i in range(args.samples)
    ]
    runner = EnvRollout(engine, tokenizer, sampling, cfg)
    runner.generate(prompts[: max(1, args.samples // 8)])  # warm-up (kernels, caches)
    if device.type == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    result = runner.generate(prompts)
    seconds = time.perf_counter() - began
    records, stats = result.records, result.stats.metrics()
    turns = sum(r.num_turns for r in records)
    out = {
        "tokens_per_s": sum(sum(r.loss_mask) for r in records) / seconds,
        "seconds": seconds,
        "turns_per_sample": turns / len(records),
        "render_share_of_engine": stats["timing/render_s"] / max(stats["timing/engine_s"], 1e-9),
        "render_ms_per_turn": 1000 * stats["timing/render_s"] / max(turns, 1),
        **stats,
    }
    if "rollout/prefill_tokens" in stats:
        out["prefill_tokens_per_turn"] = stats["rollout/prefill_tokens"] / max(turns, 1)
        out["cached_tokens_per_turn"] = stats["rollout/cached_prefix_tokens"] / max(turns, 1)
    engine.close()
    return out, records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="native,hf", help="comma-separated engines to compare")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--env-ms", type=float, default=20.0, help="mean environment step time, milliseconds")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--style", default="qwen3", choices=("qwen2.5", "qwen3"))
    parser.add_argument("--hidden-size", type=int, default=896)
    parser.add_argument("--num-layers", type=int, default=24)
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--kv-cache-gib", type=float, default=0.0)
    args = parser.parse_args()
    tokenizer = build_chat_tokenizer(args.style)
    device = resolve_device("auto")
    model = stopping_chat_model(tokenizer, args.hidden_size, args.num_layers).to(device)
    env_file = Path(tempfile.mkdtemp()) / "chatty.py"
    env_file.write_text(ENV)
    results, trajectories = {}, {}
    for name in args.engines.split(","):
        results[name], records = run(name, model, tokenizer, device, args, env_file)
        trajectories[name] = [(r.prompt_ids, r.response_ids, r.loss_mask) for r in records]
    names = list(trajectories)
    if len(names) > 1:
        results["same_trajectories"] = all(trajectories[n] == trajectories[names[0]] for n in names[1:])
    print(json.dumps({"device": str(device), "args": vars(args), **results}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
