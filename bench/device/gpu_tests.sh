#!/usr/bin/env bash
# Run GPU tests one pytest process per test, each with a time limit of its own, writing each test's whole report to
# $OUT/gpu-tests/NAME.txt as it ends: a call's time limit then cuts one test, not every report (pytest prints the
# failures only when its session ends). On the GPU machine, after bench/device/install_vllm.sh:
#   PYTHONPATH=/root/keep/site:$PWD bash bench/device/gpu_tests.sh [SECONDS_PER_TEST] FILE_OR_NODE...
# LANES=N (a machine of N GPUs): N tests at a time, lane i on GPU i alone; a test a lane skipped for want of
# devices ("needs 2 CUDA devices") runs again afterwards on all of them.
# $OUT/00-gpu-tests-summary.txt gathers each test's status line and the last 60 lines of every failure's report: the
# device tool brings back only the first few files of $OUT (by name), and it sorts first.
set -uo pipefail
limit=${1:-150}
shift || true
[ $# -gt 0 ] || set -- tests/gpu
lanes=${LANES:-1}
out=${OUT:-/tmp}/gpu-tests
mkdir -p "$out"
per_test=()  # pytest-timeout (on the GPU image) fails a hung test with its stack; else only `timeout` below stops it
python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout "$limit")
mapfile -t nodes < <(RLX_TEST_GPU=1 python3 -m pytest --collect-only -q -m gpu -p no:cacheprovider "$@" 2>/dev/null \
  | grep '::')

report() { echo "$out/$(echo "$1" | sed 's|.*/||; s|[^A-Za-z0-9_.-]|_|g').txt"; }

run_node() {  # NODE: one pytest process, its report kept, a line with its exit status and seconds
  local start rc
  start=$(date +%s)
  RLX_TEST_GPU=1 timeout $((limit + 30)) python3 -m pytest -q -p no:cacheprovider "${per_test[@]}" -rA "$1" \
    > "$(report "$1")" 2>&1
  rc=$?
  echo "rc=$rc $(( $(date +%s) - start ))s${CUDA_VISIBLE_DEVICES:+ gpu $CUDA_VISIBLE_DEVICES} $1"
}

summarize() {  # every test's last line; a failure's report tail
  local summary=${OUT:-/tmp}/00-gpu-tests-summary.txt file
  : > "$summary"
  for node in "${nodes[@]}"; do
    file=$(report "$node")
    echo "$node: $(tail -1 "$file")" >> "$summary"
    if grep -qE "(failed|error)" <(tail -1 "$file"); then
      { echo "----- $node"; tail -60 "$file"; } >> "$summary"
    fi
  done
}

if [ "$lanes" -le 1 ]; then
  for node in "${nodes[@]}"; do run_node "$node"; done
  summarize
  exit 0
fi
for ((lane = 0; lane < lanes; lane++)); do
  (
    export CUDA_VISIBLE_DEVICES=$lane
    for ((i = lane; i < ${#nodes[@]}; i += lanes)); do run_node "${nodes[$i]}"; done
  ) &
done
wait
for node in "${nodes[@]}"; do  # what a lane of one GPU could not run
  if grep -q "SKIPPED.*needs [0-9]* CUDA devices" "$(report "$node")"; then run_node "$node"; fi
done
summarize
