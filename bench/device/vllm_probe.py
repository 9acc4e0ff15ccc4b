"""Find where vLLM with tensor parallelism breaks under torchrun, one change at a time (a GPU diagnosis, not a bench).

    torchrun --nproc_per_node 2 bench/device/vllm_probe.py --variant bare      # vLLM's own torchrun example, tp 2
    torchrun --nproc_per_node 2 bench/device/vllm_probe.py --variant preinit   # + the process group rlx makes first
    torchrun --nproc_per_node 2 bench/device/vllm_probe.py --variant sleep     # + enable_sleep_mode (rlx's default)
    torchrun --nproc_per_node 2 bench/device/vllm_probe.py --variant rlxgroup  # + rlx's tp subgroup made before vLLM

Each variant starts `vllm.LLM(distributed_executor_backend="external_launcher", tensor_parallel_size=2)` on a small
Qwen2 shape (dummy weights), generates 8 prompts x 16 tokens, and prints `probe <variant> rank R: PASS` or the error.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHAPE = dict(
    architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=512, intermediate_size=1536,
    num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048,
    rope_theta=1000000.0, tie_word_embeddings=True, torch_dtype="bfloat16", rms_norm_eps=1e-6, hidden_act="silu",
)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", choices=("bare", "preinit", "sleep", "rlxgroup"), required=True)
    parser.add_argument("--eager", action="store_true", help="enforce_eager (no compile, no CUDA graphs)")
    parser.add_argument("--fusion", action="store_true", help="vLLM's default FlashInfer all-reduce + RMSNorm fusion "
                        "(trtllm workspace only: never NVLink multicast); without it, off as in rlx")  # fmt: skip
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ["VLLM_FLASHINFER_ALLREDUCE_BACKEND"] = "trtllm"  # the GPU hosts must not create multicast objects
    import torch
    import torch.distributed as dist

    rank, local_rank, world = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    tag = f"probe {args.variant}{' eager' if args.eager else ''}{' fusion' if args.fusion else ''} rank {rank}"
    if args.variant != "bare":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("cuda:nccl,cpu:gloo", timeout=datetime.timedelta(seconds=300), device_id=device)
        if args.variant == "rlxgroup":
            dist.new_group(list(range(world)))
    folder = Path(tempfile.mkdtemp(prefix=f"probe{rank}-"))
    (folder / "config.json").write_text(json.dumps(SHAPE))
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    try:
        llm = LLM(
            model=str(folder), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0,
            tensor_parallel_size=world, distributed_executor_backend="external_launcher", max_model_len=1024,
            gpu_memory_utilization=0.3, enable_sleep_mode=args.variant in ("sleep", "rlxgroup"),
            enforce_eager=args.eager,
            **({} if args.fusion else {"compilation_config": {"pass_config": {"fuse_allreduce_rms": False}}}),
        )  # fmt: skip
        print(f"{tag}: started in {time.perf_counter() - start:.1f} s", flush=True)
        prompts = [{"prompt_token_ids": [1 + i, 2, 3, 4]} for i in range(8)]
        out = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.0), use_tqdm=False)
        tokens = sum(len(o.outputs[0].token_ids) for o in out)
        if args.variant in ("sleep", "rlxgroup"):
            llm.sleep(level=1)
            llm.wake_up()
            out = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
        print(f"{tag}: PASS ({tokens} tokens)", flush=True)
    except Exception as e:  # the first line of the error is what the diagnosis needs; the traceback follows
        print(f"{tag}: FAIL {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
        raise


if __name__ == "__main__":
    main()
