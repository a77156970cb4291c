#!/bin/bash
# Several GPUs over NCCL (issue 25), from the repository root on the GPU machine; one device call per part:
#   bash bench/run_multi_gpu.sh tests     # every GPU test (pytest -m gpu), NCCL worlds included when >= 2 GPUs
#   bash bench/run_multi_gpu.sh parity    # 50 bf16 steps per layout against one GPU (bench/multi_gpu.py)
#   bash bench/run_multi_gpu.sh scaling   # tokens/s and MFU per GPU at 1..8 GPUs: dp, ZeRO-1, ZeRO-3, tp, pp
#   bash bench/run_multi_gpu.sh cp        # llama3-1b at 32k and 64k over cp=2..G, ring and all-to-all
# GPUS=N uses N of the machine's GPUs (default: all); layouts needing more are skipped, so every part also runs
# its 1-GPU rows on one GPU. Rows (with `gpus` and `layout`) land in $OUT/results.jsonl, logs in $OUT.
set -u
PART=${1:-parity}
export OUT=${OUT:-/tmp/megaloom-multi} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export MEGALOOM_CACHE=${MEGALOOM_CACHE:-/tmp/megaloom-cache}
export MEGALOOM_COMMIT=${MEGALOOM_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch; print('torch', torch.__version__)"; } > "$OUT/env.txt" 2>&1
if [ "$PART" = tests ]; then
  timeout ${TESTS_TIMEOUT:-540} python3 -m pytest -q -p no:cacheprovider -m gpu --durations=15 tests > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests rc=$? $(tail -1 "$OUT/gpu_tests.log")"
else
  python3 bench/multi_gpu.py "$PART" --gpus "${GPUS:-0}" --out "$OUT"
fi
