"""One MoE layer's local experts, forward and backward: the grouped GEMMs of expert-parallel training against the
per-expert loop they replaced (rlx/parallel/experts.py `run_sorted_experts`, impl 'grouped' and 'loop').

The experts are a transformers Qwen3-MoE layer's (Qwen3-30B-A3B's shape by default: 128 experts, hidden 2048,
expert MLP 768, 8 per token), in bf16 as FSDP's mixed precision computes them. Each token's experts are the top-k
of random router scores, so every expert gets ~T*k/E rows. Reports the median and p90 of `--iters` timed
forward+backward passes after a warm-up, and the achieved TFLOP/s (18 x rows x hidden x expert MLP per pass).

impl 'hf' is what one GPU without FSDP ran at ep_degree 1 before rlx's own forward: transformers' experts forward
(`experts_implementation = "grouped_mm"`, the tokens unsorted, its routing weights applied) on float32 weights
under bf16 autocast, the trainer's precision there (transformers casts the tokens to float32: float32 grouped GEMMs).
impl 'autocast' is what runs there now (rlx.parallel.experts.autocast_experts_forward, set by apply_parallelism):
the same float32 weights and autocast, the grouped GEMMs in bf16.

    python3 bench/moe_experts.py                         # 8,192 tokens, the 30B-A3B layer, both impls
    python3 bench/moe_experts.py --experts 64 --tokens 4096   # e.g. an EP rank's half of the experts
    python3 bench/moe_experts.py --impls grouped,hf,autocast   # one GPU without FSDP (float32 weights): before, now
    python3 bench/moe_experts.py --small --cpu           # a check of the script
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from rlx.parallel.experts import run_sorted_experts


def build(args, device: torch.device) -> tuple[Qwen3MoeExperts, torch.Tensor, torch.Tensor]:
    """(experts in bf16, rows [T*k, H] sorted by expert with grad, sizes [E] on the device)."""
    config = Qwen3MoeConfig(
        hidden_size=args.hidden, moe_intermediate_size=args.expert_mlp, num_experts=args.experts,
        num_experts_per_tok=args.top_k,
    )  # fmt: skip
    experts = Qwen3MoeExperts(config).to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        for weight in (experts.gate_up_proj, experts.down_proj):
            weight.normal_(0, 0.02)
    generator = torch.Generator(device=device).manual_seed(0)
    scores = torch.rand(args.tokens, args.experts, generator=generator, device=device)
    chosen = scores.topk(args.top_k, dim=-1).indices.reshape(-1)
    order = chosen.argsort(stable=True)
    sizes = torch.bincount(chosen, minlength=args.experts)
    tokens = torch.randn(args.tokens, args.hidden, generator=generator, device=device, dtype=torch.bfloat16)
    rows = tokens.repeat_interleave(args.top_k, dim=0)[order].detach().requires_grad_()
    return experts, rows, sizes


def hf_pass(experts, args, device: torch.device, impl: str):
    """One forward + backward of the experts forward of one process without FSDP on a float32 copy under bf16
    autocast: transformers' grouped_mm ('hf') or rlx's ('autocast')."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from rlx.parallel.experts import AUTOCAST_IMPLEMENTATION, autocast_experts_forward

    fp32 = Qwen3MoeExperts(experts.config).to(device)
    with torch.no_grad():
        fp32.gate_up_proj.copy_(experts.gate_up_proj)
        fp32.down_proj.copy_(experts.down_proj)
    ALL_EXPERTS_FUNCTIONS.register(AUTOCAST_IMPLEMENTATION, autocast_experts_forward)
    fp32.config._experts_implementation = AUTOCAST_IMPLEMENTATION if impl == "autocast" else "grouped_mm"
    generator = torch.Generator(device=device).manual_seed(1)
    scores = torch.rand(args.tokens, args.experts, generator=generator, device=device)
    weights, chosen = scores.softmax(-1).topk(args.top_k, dim=-1)
    hidden = torch.randn(args.tokens, args.hidden, generator=generator, device=device, requires_grad=True)
    grad = torch.randn(args.tokens, args.hidden, generator=generator, device=device)

    def one_pass() -> None:
        with torch.autocast(device.type, torch.bfloat16):
            out = fp32(hidden, chosen, weights)
        out.float().backward(grad)
        fp32.zero_grad(set_to_none=True)
        hidden.grad = None

    return one_pass


def time_impl(impl: str, experts, rows, sizes, args) -> dict:
    """Forward + backward of `run_sorted_experts` with `impl` ('hf', 'autocast': see the module doc): seconds of each
    pass."""
    grad = torch.randn_like(rows)

    def sorted_pass() -> None:
        out = run_sorted_experts(experts, experts.gate_up_proj, experts.down_proj, rows, sizes, impl=impl)
        out.backward(grad)
        experts.zero_grad(set_to_none=True)
        rows.grad = None

    one_pass = hf_pass(experts, args, rows.device, impl) if impl in ("hf", "autocast") else sorted_pass

    for _ in range(args.warmup):
        one_pass()
    times = []
    for _ in range(args.iters):
        if rows.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        one_pass()
        if rows.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    flops = 18 * rows.shape[0] * args.hidden * args.expert_mlp
    return {
        "impl": impl,
        "median_ms": median * 1e3,
        "p90_ms": sorted(times)[int(0.9 * (len(times) - 1))] * 1e3,
        "tflops": flops / median / 1e12,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens in the layer's micro-batch")
    parser.add_argument("--experts", type=int, default=128, help="local experts (E / ep_degree on an EP rank)")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--expert-mlp", type=int, default=768, help="each expert's intermediate size")
    parser.add_argument("--impls", default="grouped,loop", help="comma-separated: grouped, loop, hf, autocast")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--small", action="store_true", help="a small layer (a check of the script)")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if args.small:
        args.tokens, args.experts, args.hidden, args.expert_mlp, args.iters, args.warmup = 64, 8, 64, 32, 3, 1
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    experts, rows, sizes = build(args, device)
    name = "cpu" if device.type == "cpu" else torch.cuda.get_device_name()
    print(f"{name}: {args.tokens} tokens x top-{args.top_k} over {args.experts} experts, hidden {args.hidden}, "
          f"expert MLP {args.expert_mlp}, bf16, forward + backward")  # fmt: skip
    results = []
    for impl in args.impls.split(","):
        result = time_impl(impl, experts, rows, sizes, args)
        results.append(result)
        print(f"  {impl:8s} median {result['median_ms']:8.2f} ms  p90 {result['p90_ms']:8.2f} ms  "
              f"{result['tflops']:6.1f} TFLOP/s")  # fmt: skip
    if len(results) > 1:
        first, second = results[0], results[1]
        print(f"  {second['impl']} / {first['impl']}: {second['median_ms'] / first['median_ms']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
