#!/usr/bin/env bash
# Where a multi-GPU 0.5B step's host time goes (issue 34, weak scaling): the weak command at N GPUs as is, with
# torchrun's --numa-binding exclusive (each rank its own physical cores), with a 0.5 ms GIL switch interval (a
# sitecustomize, no rlx change), and without the step's files; logs under $OUT/w*. From the repository root:
#   bash bench/device/host_checks.sh [N]
set -uo pipefail
n=${1:-2}
out=${OUT:-/tmp/host-out}
mkdir -p "$out"
source bench/device/http_env.sh
lscpu | grep -E "^(Model name|Thread|Core|Socket|CPU\(s\)|NUMA)" 
weak() { python3 bench/scale.py --shapes 0.5b --weak --steps 6 --deadline-s 200 "$@" 2>&1 | grep -v WARN | tail -7; }
echo "== as is"; weak --gpus "$n,1" --work "$out/w_asis" --json "$out/asis.json"
echo "== numa-binding exclusive"; weak --gpus "$n" --launcher-args "--numa-binding exclusive" --work "$out/w_numa"
mkdir -p /tmp/gil && echo 'import sys; sys.setswitchinterval(0.0005)' >/tmp/gil/sitecustomize.py
echo "== switch interval 0.5 ms"; PYTHONPATH=/tmp/gil:$PYTHONPATH weak --gpus "$n" --work "$out/w_gil"
echo "== keep_artifacts=false"; weak --gpus "$n" --set keep_artifacts=false --work "$out/w_noart"
for d in "$out"/w_*; do find "$d" -name "*.log" -exec sh -c 'tail -c 1500 "$1" | grep -iE "error|Traceback|raise" -A3 | head -30' _ {} \; ; done
find "$out" -type f ! -name "*.log" ! -name "metrics.jsonl" ! -name "*.json" ! -name "*.txt" -delete; true
