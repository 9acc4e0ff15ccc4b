#!/usr/bin/env bash
# Run GPU tests one pytest process per test, each with a time limit of its own, writing each test's whole report to
# $OUT/gpu-tests/NAME.txt as it ends: a call's time limit then cuts one test, not every report (pytest prints the
# failures only when its session ends). On the GPU machine, after bench/device/install_vllm.sh:
#   PYTHONPATH=/root/keep/site:$PWD bash bench/device/gpu_tests.sh [SECONDS_PER_TEST] FILE_OR_NODE...
set -uo pipefail
limit=${1:-150}
shift || true
[ $# -gt 0 ] || set -- tests/gpu
out=${OUT:-/tmp}/gpu-tests
mkdir -p "$out"
per_test=()  # pytest-timeout (on the GPU image) fails a hung test with its stack; else only `timeout` below stops it
python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout "$limit")
mapfile -t nodes < <(RLX_TEST_GPU=1 python3 -m pytest --collect-only -q -m gpu -p no:cacheprovider "$@" 2>/dev/null \
  | grep '::')
for node in "${nodes[@]}"; do
  name=$(echo "$node" | sed 's|.*/||; s|[^A-Za-z0-9_.-]|_|g')
  start=$(date +%s)
  RLX_TEST_GPU=1 timeout $((limit + 30)) python3 -m pytest -q -p no:cacheprovider "${per_test[@]}" -rA "$node" \
    > "$out/$name.txt" 2>&1
  rc=$?
  echo "rc=$rc $(( $(date +%s) - start ))s $node"
done
