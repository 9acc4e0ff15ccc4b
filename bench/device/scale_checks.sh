#!/usr/bin/env bash
# Issue 34's 0.5B scaling runs in one device call (bench/RESULTS.md, "Scale"), on a machine of 4 (or 2) GPUs: weak
# scaling against one GPU, one profiled step of each (torch.profiler, rank summaries in $OUT/prof_N.txt, Chrome
# traces of rank 0 and the last rank gzipped beside them), then the fixed work on N, 2 and 1 GPUs. From the
# repository root, N the GPU count (default 4):
#   bash bench/device/scale_checks.sh [N]
# First the link between the GPUs (`nvidia-smi topo -m`, bench/device/nccl_probe.py). STRONG=0 skips the fixed
# work (STRONG_GPUS: its GPU counts, default N,2,1); PROFILE=0 the profiled steps (PROFILE_GPUS: on which counts,
# default "N 1"). `rlx ppo` imports the HTTP server's packages: carry .carry/http
# (uvicorn, starlette and their needs as wheels; the GPU image lacks them) and it is installed first.
set -uo pipefail
n=${1:-4}
out=${OUT:-/tmp/scale-out}
mkdir -p "$out"
source bench/device/http_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
nvidia-smi topo -m 2>&1 | head -8  # how the GPUs are linked
NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT timeout 90 python3 -m torch.distributed.run --standalone --nproc_per_node "$n" \
  bench/device/nccl_probe.py 2>&1 | grep -E "probe|via (P2P|SHM|NET)" | sort -u | head -16
python3 bench/scale.py --shapes 0.5b --weak --gpus "$n,1" --steps 6 --json "$out/weak.json" 2>&1 | grep -v WARN | tail -24
if [ "${PROFILE:-1}" = 1 ]; then
  for g in ${PROFILE_GPUS:-$n 1}; do
    dir=/tmp/prof_$g
    RLX_PROFILE_STEP=4 RLX_PROFILE_DIR=$dir RLX_PROFILE_TRACE=1 timeout 240 python3 bench/scale.py --shapes 0.5b --weak \
      --gpus "$g" --steps 4 2>&1 | grep -v WARN | tail -4
    cat "$dir"/rank*.txt >"$out/prof_$g.txt" 2>/dev/null
    for r in 0 $((g - 1)); do [ -f "$dir/rank$r.json" ] && gzip -c "$dir/rank$r.json" >"$out/trace_${g}_$r.json.gz"; done
  done
fi
if [ "${STRONG:-1}" = 1 ]; then
  python3 bench/scale.py --shapes 0.5b --gpus "${STRONG_GPUS:-$n,2,1}" --steps 6 --json "$out/strong.json" 2>&1 | grep -v WARN | tail -24
fi
