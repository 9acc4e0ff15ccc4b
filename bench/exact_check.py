"""Exact mode check: the native engine's logprobs against the training forward's, with exact mode off and on.

    python bench/exact_check.py                          # GPU: Qwen2-0.5B shape, bf16 autocast, batches 1, 8, 64
    python bench/exact_check.py --shape small --cpu      # a quick check of the script
    python bench/exact_check.py --shape 7b --batch-sizes 1,8,64   # GPU: the Qwen2.5-7B shape (float32 weights, 30 GB)

A model of --shape (random init, float32 weights as a trainer holds them) generates --response-len tokens for each
of B prompts of --prompt-len random token ids (B from --batch-sizes, temperature 1) with the native engine; the
training forward (rlx.logprobs, padded micro-batches of --micro-batch rows, the same precision) then scores the
same tokens. Per (mode, B): the largest |rollout logprob - trainer logprob|, the share of bit-identical tokens,
and the wall time of the rollout and of the forward. Exact mode (docs/exact.md) should give 0 and 100%; on CUDA
with triton it runs the Triton kernels (rlx/kernels/exact_triton.py), elsewhere the PyTorch scheme.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.train_step import QWEN2_05B  # noqa: E402 (the Qwen2-0.5B shape of the other benchmarks)
from rlx.kernels.exact_triton import HAS_TRITON  # noqa: E402
from rlx.logprobs import response_logprobs  # noqa: E402
from rlx.models.exact import exact_forward  # noqa: E402
from rlx.models.tiny import build_char_tokenizer  # noqa: E402
from rlx.parallel.dist import DistContext  # noqa: E402
from rlx.rollout.base import build_engine  # noqa: E402
from rlx.rollout.config import RolloutConfig, SamplingParams  # noqa: E402
from rlx.rollout.requests import TokenRequest  # noqa: E402

QWEN25_7B = dict(QWEN2_05B, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)  # fmt: skip
SHAPES = {
    "0.5b": QWEN2_05B,
    "7b": QWEN25_7B,
    "small": dict(QWEN2_05B, hidden_size=128, intermediate_size=256, num_hidden_layers=2),
}
SHAPES["small"].update(num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=512)


def build_model(shape: str, device: torch.device):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**SHAPES[shape], bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with device:  # initialised where it runs (a 7B float32 init on the host takes minutes)
        return Qwen2ForCausalLM(config).eval()


def make_requests(count: int, prompt_len: int, response_len: int, vocab: int) -> list[TokenRequest]:
    rng = random.Random(0)  # the same prompts at every batch size (a batch of B takes the first B)
    return [
        TokenRequest(key=f"s{i}", prompt_ids=[1] + [rng.randrange(3, vocab) for _ in range(prompt_len - 1)],
                     max_new_tokens=response_len)
        for i in range(count)
    ]  # fmt: skip


def collate(requests, generated):
    """Left-padded prompts, right-padded responses (as rlx score collates them)."""
    width_p = max(len(r.prompt_ids) for r in requests)
    width_r = max(max(len(g.response_ids) for g in generated), 1)
    widths = {"prompt_ids": width_p, "prompt_mask": width_p, "response_ids": width_r, "response_mask": width_r}
    t = {k: torch.zeros(len(requests), w, dtype=torch.long) for k, w in widths.items()}
    rollout = torch.zeros(len(requests), width_r)
    for i, (r, g) in enumerate(zip(requests, generated)):
        p, n = len(r.prompt_ids), len(g.response_ids)
        t["prompt_ids"][i, width_p - p :], t["prompt_mask"][i, width_p - p :] = torch.tensor(r.prompt_ids), 1
        if n:
            t["response_ids"][i, :n], t["response_mask"][i, :n] = torch.tensor(g.response_ids), 1
            rollout[i, :n] = torch.tensor(g.logprobs, dtype=torch.float32)
    return t, rollout


def trainer_logprobs(model, tensors, dtype, micro_batch: int, exact: bool, device) -> torch.Tensor:
    out = []
    with torch.no_grad(), exact_forward(model) if exact else contextlib.nullcontext():
        for lo in range(0, tensors["prompt_ids"].shape[0], micro_batch):
            part = {k: v[lo : lo + micro_batch].to(device) for k, v in tensors.items()}
            logp, _ = response_logprobs(model, **part, temperature=1.0, dtype=dtype, impl="auto")
            out.append(logp.float().cpu())
    return torch.cat(out)


def measure(model, tokenizer, args, device, dtype, exact: bool, batch: int) -> dict:
    precision = "bfloat16" if dtype == torch.bfloat16 else "float32"
    sampling = SamplingParams(max_new_tokens=args.response_len)
    cfg = RolloutConfig(engine="native", exact=exact, precision=precision, device=device.type,
                        kv_cache_gib=args.kv_cache_gib, sampling=sampling)  # fmt: skip
    engine = build_engine(cfg, model, tokenizer, DistContext(device=device))
    requests = make_requests(batch, args.prompt_len, args.response_len, model.config.vocab_size)
    sampling = dataclasses.replace(cfg.sampling, seed=0)
    engine.generate_tokens(requests[:2], sampling)  # warm-up (kernels, lazy inits)
    start = time.perf_counter()
    generated = engine.generate_tokens(requests, sampling)
    rollout_s = time.perf_counter() - start
    tensors, rollout = collate(requests, generated)
    start = time.perf_counter()
    trained = trainer_logprobs(model, tensors, dtype, args.micro_batch, exact, device)
    forward_s = time.perf_counter() - start
    mask = tensors["response_mask"].bool()
    diff = (rollout - trained).abs()[mask]
    return {
        "exact": exact, "batch": batch, "tokens": int(mask.sum()),
        "max_abs_diff": float(diff.max()) if diff.numel() else 0.0,
        "identical_share": float((diff == 0).float().mean()) if diff.numel() else 1.0,
        "rollout_s": rollout_s, "forward_s": forward_s,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--batch-sizes", default="1,8,64", help="comma-separated rollout batch sizes")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--response-len", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=8, help="rows per training forward")
    parser.add_argument("--precision", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="auto: bfloat16 autocast on CUDA, float32 on CPU")  # fmt: skip
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(args.precision)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model, tokenizer = build_model(args.shape, device), build_char_tokenizer()
    rows = []
    for exact in (False, True):
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            rows.append(measure(model, tokenizer, args, device, dtype, exact, batch))
            print(json.dumps(rows[-1]), flush=True)
    kernels = "Triton kernels" if HAS_TRITON and device.type == "cuda" else "PyTorch scheme"  # docs/exact.md
    print(f"\n{args.shape} on {device.type} ({str(dtype).removeprefix('torch.')}; exact mode: {kernels})")
    print(f"{'exact':<6} {'batch':>5} {'tokens':>7} {'max |diff|':>11} {'identical':>10} {'rollout':>9} {'forward':>9}")
    for r in rows:
        print(f"{str(r['exact']):<6} {r['batch']:>5} {r['tokens']:>7} {r['max_abs_diff']:>11.3g} "
              f"{100 * r['identical_share']:>9.1f}% {r['rollout_s']:>8.2f}s {r['forward_s']:>8.2f}s")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"shape": args.shape, "device": device.type, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
