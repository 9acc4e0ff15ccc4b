#!/usr/bin/env bash
# The diagnosis calls of VLLM_STEPS.md ("The two failures of 2026-11-26"), after vLLM is installed on the machine.
#   bash bench/device/diagnose_vllm.sh tp-probe     # vLLM alone at tp 2, then rlx's differences one at a time
#   bash bench/device/diagnose_vllm.sh tp-rlx       # rlx at tp 2 with synchronous launches (the faulting kernel)
#   bash bench/device/diagnose_vllm.sh async        # [async] with vLLM: both ranks' stacks when it runs past 420 s
set -uo pipefail
export PYTHONPATH=/root/keep/site:$PWD PYTHONUNBUFFERED=1
export VLLM_FLASHINFER_ALLREDUCE_BACKEND=trtllm  # never FlashInfer's NVLink multicast workspace on these hosts
spy=.carry/spy/py-spy
probe() { bash bench/device/hang_probe.sh "$@"; }
case "${1:-}" in
  tp-probe)
    for variant in "bare" "bare --fusion" "sleep" "rlxgroup"; do
      probe 150 "$spy" torchrun --nproc_per_node 2 bench/device/vllm_probe.py --variant $variant 2>&1 |
        grep -E "probe|Error|error|Thread|\(" | head -40
    done ;;
  tp-rlx)
    CUDA_LAUNCH_BLOCKING=1 probe 300 "$spy" python3 bench/grpo_step.py --small --tools rlx-vllm --nproc 2 --steps 2 \
      --set rollout.tp_degree=2 --work /tmp/tp2 2>&1 | tail -60
    find /tmp/tp2 -name "*.log" -exec tail -40 {} \; ;;
  async)
    NCCL_DEBUG=WARN probe 420 "$spy" python3 bench/async_step.py --small --steps 3 --modes async1 \
      --set rollout.engine=vllm --set rollout.gpu_memory_utilization=0.3 --work /tmp/as 2>&1 | tail -150
    find /tmp/as -name "*.log" -exec tail -40 {} \; ;;
  *) echo "usage: diagnose_vllm.sh tp-probe|tp-rlx|async" >&2; exit 2 ;;
esac
