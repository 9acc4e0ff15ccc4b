#!/usr/bin/env bash
# Exact mode's GPU checks in one device call (bench/RESULTS.md, "Exact"): the CUDA tests, the rollout against the
# trainer at the 0.5B and 7B shapes, and the GRPO step with the mode on and off. OLD_DIR (a tree of an older commit,
# `git archive REV | tar -x -C .scratch/old`, carried): that tree's exact GRPO step too, a before/after in the same
# call. COLD=1: then the matmul and attention benches reading from memory (`--cold`). PAIRS=N: N GRPO pairs, the
# order of the two tools alternating (the default step varies between runs on one machine: the pairs show by how
# much). ENGINE_7B=1: the 7B engine with the mode on and off. From the repository root:
#   PYTHONPATH=/root/keep/http:$PWD bash bench/device/exact_checks.sh [OLD_DIR]
set -uo pipefail
old=${1:-}
json=()
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
RLX_TEST_GPU=1 timeout 240 python3 -m pytest -q -x tests/gpu/test_exact_cuda.py 2>&1 | grep -E "passed|failed|Error" | head -8
timeout 120 python3 bench/exact_check.py --batch-sizes 1,8,64 2>&1 | grep -E "^(True|False)"
timeout 150 python3 bench/exact_check.py --shape 7b --batch-sizes 1,64 2>&1 | grep -E "^(True|False)"
for pair in $(seq 1 "${PAIRS:-1}"); do
  tools=rlx,rlx-exact
  [ $((pair % 2)) = 0 ] && tools=rlx-exact,rlx
  [ -n "${OUT:-}" ] && json=(--json "$OUT/grpo$pair.json")
  timeout 300 python3 bench/grpo_step.py --tools $tools --steps 6 --save-every 100 "${json[@]}" 2>&1 \
    | grep -v WARN | tail -7
done
if [ -n "$old" ]; then  # its rlx first on the path (the bench's `rlx ppo` processes inherit it)
  (cd "$old" && PYTHONPATH="$PWD:${PYTHONPATH:-}" timeout 200 python3 bench/grpo_step.py --tools rlx-exact --steps 6 \
    --save-every 100 2>&1 | grep -v WARN | tail -3)
fi
if [ "${COLD:-0}" = 1 ]; then
  timeout 60 python3 bench/exact_attention.py --cold --shapes 0.5b 2>&1 | grep -E "^0.5b"
  timeout 150 python3 bench/exact_matmul.py --cold --shapes 0.5b --rows 256 2>&1 | grep -v "different bits"
fi
if [ "${ENGINE_7B:-0}" = 1 ]; then
  timeout 300 python3 bench/rollout.py --model qwen2.5-7b --engines native,native-exact --repeat 2 2>&1 | grep -E "tok/s"
fi
