#!/bin/bash
# megaloom and its peer (TorchTitan) back to back on one H200, offline. From the repository root:
#   bash bench/run_h200.sh            (needs bench/.peer prepared as bench/README.md says)
# Writes logs and results.jsonl rows into $OUT (default /tmp/megaloom-bench).
set -u
export OUT=${OUT:-/tmp/megaloom-bench} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
RUN_ID=$(date -u +%Y%m%dT%H%M%S)
export MEGALOOM_COMMIT=${MEGALOOM_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/env.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/env.txt"
B="python3 bench/bench_train.py --seq-len 4096 --steps 20 --warmup 6 --results $OUT/results.jsonl --run-id $RUN_ID"
timeout 240 $B --preset llama3-1b-untied --micro-batch 4 > "$OUT/ml_untied_eager_bs4.log" 2>&1; echo "eager rc=$?"
timeout 300 $B --preset llama3-1b-untied --micro-batch 4 --compile > "$OUT/ml_untied_compile_bs4.log" 2>&1; echo "compile rc=$?"
timeout 300 $B --preset llama3-1b --micro-batch 4 --compile > "$OUT/ml_tied_compile_bs4.log" 2>&1; echo "tied rc=$?"
grep -h RESULT "$OUT"/ml_*.log
if [ -d bench/.peer/.whl ] && [ "${SKIP_PEER:-0}" != 1 ]; then
  OUT="$OUT/peer" bash bench/.peer/run_peers.sh | tee "$OUT/peer.log"
  grep "^{" "$OUT/peer.log" > "$OUT/peer_summary.jsonl"
fi
