"""Fused logprob + entropy: time and peak extra memory of naive, chunked, Triton, and the bare matmuls.

    python bench/logprob_entropy.py                 # the two shapes of the issue, bf16, on CUDA
    python bench/logprob_entropy.py --small --cpu   # a quick check of the script itself

Each implementation runs forward + backward of sum(a * logprob + b * entropy) with random row
weights a, b (as a PPO loss would); times are medians of CUDA-event timings after warm-up. The
floor is the three matmuls any implementation must do (hidden @ W.T, dlogits @ W, dlogits.T @ hidden)
on a precomputed dlogits. "extra" is the peak allocation above inputs and their gradients.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from rlx.kernels.logprob_entropy import logprob_entropy

SHAPES = [(16384, 896, 151936), (16384, 3584, 152064)]
GIB = 2**30


def make(n, h, v, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * 0.5).to(device, dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.02).to(device, dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    a, b = torch.randn(n, generator=g).to(device), (torch.randn(n, generator=g) * 0.01).to(device)
    return hidden, weight, targets, a, b


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, warmup=2, iters=5) -> float:
    """Median milliseconds of fn()."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run_impl(impl, hidden, weight, targets, a, b):
    hidden.grad = weight.grad = None
    logprob, entropy = logprob_entropy(hidden, weight, targets, 1.0, impl=impl)
    (logprob * a + entropy * b).sum().backward()
    return logprob.detach(), entropy.detach()


def floor(hidden, weight, dlogits):
    with torch.no_grad():
        _ = hidden @ weight.T
        _ = dlogits @ weight
        _ = dlogits.T @ hidden


def measure_floor(hidden, weight, dtype, device) -> dict:
    n, h, v = hidden.shape[0], hidden.shape[1], weight.shape[0]
    dlogits = torch.randn(n, v, device=device, dtype=dtype)
    ms = timed(lambda: floor(hidden, weight, dlogits), device)
    tflops = 3 * 2 * n * h * v / 1e12
    return {"ms": ms, "tflops": tflops, "tflop_per_s": tflops / ms * 1e3}


def peak_extra(fn, device, base_bytes) -> float:
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before - base_bytes) / GIB


TRITON_VARIANTS = {"triton (cublas logits)": ("cublas", "cublas"), "triton (fused matmul)": ("fused", "fused")}


def forward_only(impl, hidden, weight, targets):
    with torch.no_grad():
        logprob_entropy(hidden, weight, targets, 1.0, impl=impl)


def measure_impl(label, impl, hidden, weight, targets, a, b, device, grads_bytes):
    """Time (fwd+bwd and fwd only), peak extra memory and outputs of one implementation."""
    fwd, bwd = TRITON_VARIANTS.get(label, ("cublas", "cublas"))
    os.environ["RLX_LOGPROB_FWD"], os.environ["RLX_LOGPROB_BWD"] = fwd, bwd
    try:
        ms = timed(lambda: run_impl(impl, hidden, weight, targets, a, b), device)
        fwd_ms = timed(lambda: forward_only(impl, hidden, weight, targets), device)
        hidden.grad = weight.grad = None
        extra = peak_extra(lambda: run_impl(impl, hidden, weight, targets, a, b), device, grads_bytes)
        out = (*run_impl(impl, hidden, weight, targets, a, b), hidden.grad.float(), weight.grad.float())
        return {"ms": ms, "fwd_ms": fwd_ms, "extra_gib": extra}, out
    except torch.OutOfMemoryError:
        return {"ms": float("nan"), "fwd_ms": float("nan"), "extra_gib": float("nan"), "error": "out of memory"}, None
    finally:
        hidden.grad = weight.grad = None
        if device.type == "cuda":
            torch.cuda.empty_cache()


def measure_shape(n, h, v, dtype, device, impls):
    hidden, weight, targets, a, b = make(n, h, v, dtype, device)
    grads_bytes = hidden.numel() * hidden.element_size() + weight.numel() * weight.element_size()
    labels = [(label, "triton") for label in TRITON_VARIANTS if "triton" in impls]
    labels = [(i, i) for i in impls if i != "triton"] + labels
    rows, outputs = {}, {}
    for label, impl in labels:
        rows[label], out = measure_impl(label, impl, hidden, weight, targets, a, b, device, grads_bytes)
        if out is not None:
            outputs[label] = out
    rows["floor (3 matmuls)"] = measure_floor(hidden, weight, dtype, device)
    ref = outputs.get("naive")
    for label, out in outputs.items():
        if ref is not None and label != "naive":
            names = ("logprob", "entropy", "dhidden", "dweight")
            rows[label]["max_abs_diff_vs_naive"] = {
                name: float((x.float() - y.float()).abs().max()) for name, x, y in zip(names, out, ref)
            }
            rows[label]["rel_norm_diff_vs_naive"] = {
                name: float((x.float() - y.float()).norm() / y.float().norm().clamp(min=1e-30))
                for name, x, y in zip(names, out, ref)
            }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes (script check)")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (naive and chunked only)")
    parser.add_argument("--impls", default="naive,chunked,triton")
    parser.add_argument("--json", help="write all numbers here")
    parser.add_argument("--shape", type=int, default=-1, help="only this shape (0 or 1)")
    args = parser.parse_args()
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    impls = [i for i in args.impls.split(",") if device.type == "cuda" or i != "triton"]
    shapes = [(512, 64, 5003), (256, 128, 7001)] if args.small else SHAPES
    shapes = [shapes[args.shape]] if args.shape >= 0 else shapes
    blocks = os.environ.get("RLX_TRITON_BLOCKS", "default")
    results = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": "bfloat16",
        "blocks": blocks,
        "shapes": {},
    }
    for n, h, v in shapes:
        results["shapes"][f"N={n} H={h} V={v}"] = measure_shape(n, h, v, torch.bfloat16, device, impls)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    print(f"device: {results['device']}  torch {results['torch']}")
    for shape, rows in results["shapes"].items():
        floor_ms = rows["floor (3 matmuls)"]["ms"]
        print(f"\n{shape}   floor {floor_ms:.2f} ms ({rows['floor (3 matmuls)']['tflop_per_s']:.0f} TFLOP/s)")
        print(f"{'impl':>28} {'ms':>8} {'fwd ms':>7} {'x floor':>8} {'extra GiB':>9}  rel. diff vs naive lp/ent/dh/dW")
        for impl, row in rows.items():
            if impl.startswith("floor"):
                continue
            diffs = row.get("rel_norm_diff_vs_naive", {})
            diff_text = " ".join(f"{d:.1e}" for d in diffs.values())
            error = "  " + row["error"] if "error" in row else ""
            print(
                f"{impl:>28} {row['ms']:8.2f} {row['fwd_ms']:7.2f} {row['ms'] / floor_ms:8.2f} "
                f"{row['extra_gib']:9.2f}  {diff_text}{error}"
            )


if __name__ == "__main__":
    main()
