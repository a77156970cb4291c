#!/bin/bash
# The GPU smoke suite: every device call starts with it (`bash bench/gpu_smoke.sh`, under 2 minutes on an H100).
# Dry runs of a dense, an MoE (ep 8), a context-parallel layout and one fp8 step at world 64 on the GPU, a compiled
# tp=2 x dp=2 gloo world of 4 processes (bench/gpu_smoke.py), then the split-group tests (the NCCL
# split of the production path; the gloo stand-in). One `SMOKE ...` line per case; exit status 1 if any failed.
# The script itself is tested on CPU (tests/bench/test_gpu_smoke.py: `python bench/gpu_smoke.py --device cpu`).
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
timeout "${SMOKE_TIMEOUT:-150}" python3 bench/gpu_smoke.py "$@" > /tmp/gpu_smoke.log 2>&1
rc=$?
grep "^SMOKE" /tmp/gpu_smoke.log
[ $rc = 0 ] || { echo "gpu_smoke.py rc=$rc; its last lines:"; grep -v "^SMOKE" /tmp/gpu_smoke.log | tail -40; }
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/parallel/test_gpu_world.py -k "split or gloo_bound" \
  > /tmp/gpu_smoke_pytest.log 2>&1
rc2=$?
echo "SMOKE split-group tests rc=$rc2: $(tail -1 /tmp/gpu_smoke_pytest.log)"
[ $rc2 = 0 ] || grep -E "^E |Error" /tmp/gpu_smoke_pytest.log | head -20
[ $rc = 0 ] && [ $rc2 = 0 ]
