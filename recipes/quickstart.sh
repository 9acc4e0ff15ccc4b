#!/usr/bin/env bash
# The quickstart recipe (recipes/quickstart.toml) as a shell pipeline of the separate commands.
# For the same seed it produces the same weights and metrics as `rlx ppo recipes/quickstart.toml`;
# it is slower only because every command starts a fresh Python process.
#
#   bash recipes/quickstart.sh [RUN_DIR]          (env: SEED=0 STEPS=150)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
RUN="${1:-runs/quickstart-sh}"
SEED="${SEED:-0}"
STEPS="${STEPS:-150}"
PROMPTS="$HERE/data/arith_quickstart.jsonl"
PROMPTS_PER_STEP=32                     # [data] prompts_per_step

ckpt() { printf '%s/checkpoints/step_%06d' "$RUN" "$1"; }

if [ -e "$RUN" ]; then echo "quickstart.sh: $RUN exists; remove it or pass another folder" >&2; exit 1; fi
mkdir -p "$RUN"

# step 0: a tiny Llama initialised from config.json with the run seed ([model] init = "random")
rlx shard --model "$HERE/tiny-arith" --init random --seed "$SEED" --out "$(ckpt 0)"

for ((step = 1; step <= STEPS; step++)); do
  dir="$(printf '%s/step_%06d' "$RUN" "$step")"
  prev="$(ckpt $((step - 1)))"
  # [rollout]: step k samples with seed + k from prompts at position (k-1) * prompts_per_step
  rlx rollout --model "$prev" --prompts "$PROMPTS" --out "$dir/rollouts.jsonl" \
    --num-prompts "$PROMPTS_PER_STEP" --data-position $(((step - 1) * PROMPTS_PER_STEP)) \
    --n 8 --max-new-tokens 3 --temperature 1.0 --batch-size 256 --seed $((SEED + step)) \
    --metrics "$RUN/metrics.jsonl"
  # [score]: the step-0 weights are the reference model
  rlx score --rollouts "$dir/rollouts.jsonl" --actor "$prev" --ref "$(ckpt 0)" --reward arith \
    --micro-batch-size 256 --out "$dir" --metrics "$RUN/metrics.jsonl"
  # [train]
  rlx train-step --checkpoint "$prev" --batch "$dir/batch.safetensors" --out "$(ckpt "$step")" \
    --lr 1e-3 --mini-batch-size 128 --micro-batch-size 256 --weight-decay 0 --seed "$SEED" \
    --metrics "$RUN/metrics.jsonl"
done
echo "quickstart.sh: done; final checkpoint $(ckpt "$STEPS")" >&2
