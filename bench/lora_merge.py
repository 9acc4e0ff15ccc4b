"""LoRA for rollouts: merging the adapters into a plain replica in place vs running them unmerged.

    python bench/lora_merge.py                   # tiny and ~100M Llama shapes, rank 16 all-linear, CPU float32
    python bench/lora_merge.py --device cuda --dtype bfloat16 --shapes 100M 0.5B --engine-rollout

For each shape it times (best of 7): one in-place refresh of a plain replica from the LoRA model
(`refresh_merged_weights`, adapted weights only, as after each update), and one decode step (a batch of
single tokens on a KV cache of --context tokens) and one prefill (--batch x --context tokens) of the plain
model and of the model with unmerged adapters. The break-even is the number of decode steps after which
the unmerged adapters have cost more than one merge.

--engine-rollout adds the end-to-end comparison that picks `rollout.native.lora_rollout`'s default: the native engine
over the LoRA model as `rlx ppo` runs it, per step: the adapters change (a train step), the engine wakes,
generates --rollout-prompts x --rollout-n samples of --rollout-tokens tokens from --context-token prompts (a
random model rarely stops early), and sleeps. 'merged' refills its merged replica (the adapted weights; the replica,
cache and graphs are kept across steps unless rollout.sleep) and decodes the plain model; 'adapters' decodes the PEFT
module itself (on CUDA both capture decode graphs with compiled layers per
call). The median seconds of --rollout-steps such steps after one warm-up step, and generated tokens/s.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from rlx.models.lora import apply_lora
from rlx.models.lora_config import LoraConfig
from rlx.models.lora_merge import refresh_merged_weights
from rlx.models.tiny import build_char_tokenizer

SHAPES = {
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 19},
    "100M": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 12,
             "num_key_value_heads": 4, "vocab_size": 32000},
    "0.5B": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2, "vocab_size": 151936},
}  # fmt: skip


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: torch.device, warmup: int = 2, iters: int = 7) -> float:
    """Fastest of `iters` calls of fn(), in milliseconds (the minimum: other work on a shared machine only ever
    adds time)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return min(times)


def forward_costs(model, batch: int, context: int, device: torch.device) -> tuple[float, float]:
    """(decode step ms, prefill ms) of `model`."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, model.config.vocab_size, (batch, context), generator=gen).to(device)
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
        token = ids[:, -1:]

        def decode():
            model(input_ids=token, past_key_values=cache, use_cache=True)
            cache.crop(-1)  # drop the step's token: the same context length every time

        return timed(decode, device), timed(lambda: model(input_ids=ids, use_cache=False), device)


def engine_rollout(lora: torch.nn.Module, mode: str, args, device: torch.device, dtype: torch.dtype) -> dict:
    """Steps of (adapters change, wake, generate, sleep) of the native engine in `mode`: median seconds, tokens/s."""
    from rlx.formats.records import PromptRecord
    from rlx.parallel.dist import DistContext
    from rlx.rollout.base import ModuleWeights, build_engine
    from rlx.rollout.config import NativeConfig, RolloutConfig, SamplingParams

    precision = "bfloat16" if dtype == torch.bfloat16 else "float32"
    cfg = RolloutConfig(
        engine="native",
        chat_template="off",
        precision=precision,
        kv_cache_gib=0 if device.type == "cuda" else 1.0,
        native=NativeConfig(lora_rollout=mode),
        sampling=SamplingParams(n=args.rollout_n, max_new_tokens=args.rollout_tokens),
    )
    engine = build_engine(cfg, lora, build_char_tokenizer(), DistContext(device=device))
    prompts = [
        PromptRecord(id=f"p{i}", prompt="1234567890" * (args.context // 10)) for i in range(args.rollout_prompts)
    ]
    adapters_b = [p for n, p in lora.named_parameters() if ".lora_B." in n]
    times, tokens = [], 0
    for step in range(args.rollout_steps + 1):
        with torch.no_grad():  # a train step changes the adapters only
            for p in adapters_b:
                p.mul_(0.99)
        engine.wake()
        engine.update_weights(ModuleWeights(lora))
        sync(device)
        start = time.perf_counter()
        result = engine.generate(prompts, dataclasses.replace(cfg.sampling, seed=step), progress=False)
        sync(device)
        if step:  # the first step compiles
            times.append(time.perf_counter() - start)
            tokens = result.stats.tokens
        engine.sleep()
    seconds = sorted(times)[len(times) // 2]
    return {"mode": mode, "step_s": round(seconds, 3), "tokens_per_s": round(tokens / seconds)}


def measure(name: str, args, device: torch.device, dtype: torch.dtype) -> dict:
    config = LlamaConfig(**SHAPES[name], tie_word_embeddings=True, max_position_embeddings=4096)
    config.update({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    lora = apply_lora(copy.deepcopy(plain), LoraConfig(rank=args.rank, init="random"), dtype).to(device).eval()
    replica = plain.to(device, dtype)
    refresh_merged_weights(replica, lora)  # the first refresh copies everything once
    merge_ms = timed(lambda: refresh_merged_weights(replica, lora, include_frozen=False), device)
    plain_decode, plain_prefill = forward_costs(replica, args.batch, args.context, device)
    lora_decode, lora_prefill = forward_costs(lora, args.batch, args.context, device)
    extra = lora_decode - plain_decode
    out = {
        "shape": name,
        "params_m": round(sum(p.numel() for p in plain.parameters()) / 1e6, 1),
        "merge_in_place_ms": round(merge_ms, 2),
        "decode_step_ms": {"merged": round(plain_decode, 2), "unmerged_lora": round(lora_decode, 2)},
        "prefill_ms": {"merged": round(plain_prefill, 2), "unmerged_lora": round(lora_prefill, 2)},
        "break_even_decode_steps": round(merge_ms / extra, 1) if extra > 0 else None,
    }
    if args.engine_rollout:
        del replica
        out["native_engine"] = [engine_rollout(lora, mode, args, device, dtype) for mode in ("merged", "adapters")]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=16, help="sequences per decode step / prefill")
    parser.add_argument("--context", type=int, default=128, help="tokens in the KV cache / in each prefill row")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (a shared machine: 1 is steadiest)")
    parser.add_argument("--shapes", nargs="+", default=["tiny", "100M"], choices=list(SHAPES))
    parser.add_argument("--engine-rollout", action="store_true", help="native engine end to end, both modes")
    parser.add_argument("--rollout-prompts", type=int, default=64)
    parser.add_argument("--rollout-n", type=int, default=4)
    parser.add_argument("--rollout-tokens", type=int, default=256)
    parser.add_argument("--rollout-steps", type=int, default=3)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    print(f"device {device}, {dtype}, torch threads {torch.get_num_threads()}, rank {args.rank} all-linear")
    for name in args.shapes:
        print(json.dumps(measure(name, args, device, dtype)), flush=True)


if __name__ == "__main__":
    main()
