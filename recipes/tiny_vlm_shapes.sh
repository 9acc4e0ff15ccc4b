#!/usr/bin/env bash
# The tiny vision-language recipe (recipes/tiny_vlm_shapes.toml) as a shell pipeline of the separate commands.
# For the same seed it writes the same rollouts, scores and weights as `rlx ppo recipes/tiny_vlm_shapes.toml`.
# The [vision] table becomes --freeze-vision-tower on train-step, its default (image sizes: the processor's defaults).
#
#   bash recipes/tiny_vlm_shapes.sh [RUN_DIR]          (env: SEED=0 STEPS=150)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
RUN="${1:-runs/tiny-vlm-sh}"
SEED="${SEED:-0}"
STEPS="${STEPS:-150}"
PROMPTS="$HERE/data/shapes_quickstart.jsonl"
PROMPTS_PER_STEP=16                     # [data] prompts_per_step

ckpt() { printf '%s/checkpoints/step_%06d' "$RUN" "$1"; }

if [ -e "$RUN" ]; then echo "tiny_vlm_shapes.sh: $RUN exists; remove it or pass another folder" >&2; exit 1; fi
mkdir -p "$RUN"

# step 0: the tiny Qwen2-VL initialised from config.json with the run seed; the processor files travel with it
rlx shard --model "$HERE/tiny-vlm" --init random --seed "$SEED" --out "$(ckpt 0)"

for ((step = 1; step <= STEPS; step++)); do
  dir="$(printf '%s/step_%06d' "$RUN" "$step")"
  prev="$(ckpt $((step - 1)))"
  # [rollout]: step k samples with seed + k from prompts at position (k-1) * prompts_per_step
  rlx rollout --model "$prev" --prompts "$PROMPTS" --out "$dir/rollouts.jsonl" \
    --num-prompts "$PROMPTS_PER_STEP" --data-position $(((step - 1) * PROMPTS_PER_STEP)) \
    --n 8 --max-new-tokens 1 --temperature 1.0 --batch-size 128 --seed $((SEED + step)) \
    --metrics "$RUN/metrics.jsonl"
  # [score]: the step-0 weights are the reference model
  rlx score --rollouts "$dir/rollouts.jsonl" --actor "$prev" --ref "$(ckpt 0)" --reward shapes \
    --micro-batch-size 128 --out "$dir" --metrics "$RUN/metrics.jsonl"
  # [train] and [vision]
  rlx train-step --checkpoint "$prev" --batch "$dir/batch.safetensors" --out "$(ckpt "$step")" \
    --lr 1e-3 --mini-batch-size 64 --micro-batch-size 128 --weight-decay 0 --seed "$SEED" \
    --freeze-vision-tower --metrics "$RUN/metrics.jsonl"
done
echo "tiny_vlm_shapes.sh: done; final checkpoint $(ckpt "$STEPS")" >&2
