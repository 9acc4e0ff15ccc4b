#!/usr/bin/env bash
# The multi-turn calculator recipe (recipes/calculator.toml) as a shell pipeline of the separate commands.
# For the same seed it produces the same weights and metrics as `rlx ppo recipes/calculator.toml`.
#
#   bash recipes/calculator.sh [RUN_DIR]    (env: SEED=1 STEPS=40 PROMPTS_PER_STEP=8 N=8 SFT_MAX_STEPS=1000)
# (PROMPTS_PER_STEP, N and SFT_MAX_STEPS stand for [data] prompts_per_step, [rollout] n and [sft] max_steps:
# `rlx ppo --set` them alike.)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
RUN="${1:-runs/calculator-sh}"
SEED="${SEED:-1}"
STEPS="${STEPS:-40}"
PROMPTS="$HERE/data/calculator.jsonl"
PROMPTS_PER_STEP="${PROMPTS_PER_STEP:-8}"   # [data] prompts_per_step
N="${N:-8}"                                  # [rollout] n
SFT_MAX_STEPS="${SFT_MAX_STEPS:-1000}"       # [sft] max_steps (0 = the epochs decide)

ckpt() { printf '%s/checkpoints/step_%06d' "$RUN" "$1"; }

if [ -e "$RUN" ]; then echo "calculator.sh: $RUN exists; remove it or pass another folder" >&2; exit 1; fi
mkdir -p "$RUN"

# a tiny chat Llama initialised from config.json with the run seed ([model] init = "random") ...
rlx shard --model "$HERE/tiny-chat" --init random --seed "$SEED" --out "$RUN/init"
# ... fine-tuned on solved episodes ([sft]): the step-0 checkpoint, and the reference model of every step
rlx sft --model "$RUN/init" --data "$HERE/data/calculator_demos.jsonl" --out "$(ckpt 0)" \
  --epochs 32 --lr 3e-3 --warmup-steps 10 --lr-schedule cosine --lr-decay-steps 1000 --weight-decay 0 \
  --batch-size 32 --micro-batch-size 32 --seed "$SEED" --max-steps "$SFT_MAX_STEPS" --metrics "$RUN/sft_metrics.jsonl"

for ((step = 1; step <= STEPS; step++)); do
  dir="$(printf '%s/step_%06d' "$RUN" "$step")"
  prev="$(ckpt $((step - 1)))"
  # [rollout]: episodes of the two-tool environment (`multiply` replies "59*63=3717", `add` "59+63=122"), limits
  rlx rollout --model "$prev" --prompts "$PROMPTS" --out "$dir/rollouts.jsonl" \
    --num-prompts "$PROMPTS_PER_STEP" --data-position $(((step - 1) * PROMPTS_PER_STEP)) \
    --env rlx.tasks.calculator:ToolChoiceCalculatorEnv --max-turns 3 --max-total-tokens 320 \
    --n "$N" --max-new-tokens 96 --temperature 0.7 --batch-size 128 --seed $((SEED + step)) \
    --metrics "$RUN/metrics.jsonl"
  # [score]: the environment's reward; the step-0 weights are the reference model
  rlx score --rollouts "$dir/rollouts.jsonl" --actor "$prev" --ref "$(ckpt 0)" --reward env \
    --micro-batch-size 128 --out "$dir" --metrics "$RUN/metrics.jsonl"
  # [train]
  rlx train-step --checkpoint "$prev" --batch "$dir/batch.safetensors" --out "$(ckpt "$step")" \
    --lr 1e-4 --mini-batch-size 128 --micro-batch-size 128 --weight-decay 0 --seed "$SEED" \
    --metrics "$RUN/metrics.jsonl"
done
echo "calculator.sh: done; final checkpoint $(ckpt "$STEPS")" >&2
