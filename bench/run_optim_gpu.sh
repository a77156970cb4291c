#!/bin/bash
# Issue 51's GPU runs in one device call: the GPU smoke suite, then at once on one GPU (small models leave it mostly
# idle, so the processes share it): 1-bit Adam against AdamW at ~92M parameters with dp 4 simulated in one process
# (bench/onebit_convergence.py --simulate-dp 4; 2,000 steps, warm-up 300, seeds 1-3, one process per run), and
# Muon against AdamW at ~95M (bench/muon_convergence.py; 2,000 steps, seed 1). Every run writes its metrics line by
# line under $RUNS, so a run cut short by the call's limit (DEADLINE seconds from the start) keeps what it did;
# the tables are printed from the files at the end (and again on any machine with --summary).
#
#   RUNS=$OUT/runs DEADLINE=570 bash bench/run_optim_gpu.sh     # on the device (the `run` tool sets $OUT)
#   RUNS=/tmp/r STEPS=4 SEEDS=1 DEVICE=cpu SMOKE=0 bash bench/run_optim_gpu.sh   # the script's own CPU check
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
RUNS=${RUNS:-runs/optim_gpu}; DEADLINE=${DEADLINE:-570}; STEPS=${STEPS:-2000}; SEEDS=${SEEDS:-1 2 3}
DEVICE=${DEVICE:-cuda}; SMOKE=${SMOKE:-1}; MUON_SEEDS=${MUON_SEEDS:-1}
mkdir -p "$RUNS"
start=$SECONDS
if [ "$SMOKE" = 1 ]; then bash bench/gpu_smoke.sh 2>&1 | tee "$RUNS/smoke.txt"; fi
left=$((DEADLINE - (SECONDS - start) - 25))  # 25 s for the tables
echo "=== $(date -u +%FT%TZ) runs start, $left s left"
ONEBIT=(model.preset=gpt2-124m model.vocab_size=0 train.seq_len=256 train.micro_batch_size=4 train.precision=bf16)
MUON=(model.preset=gpt2-124m data.default_vocab_size=16384 model.vocab_size=0 train.seq_len=512
      train.global_batch_size=32 train.micro_batch_size=16 train.lr=6e-4 train.min_lr=6e-5)
[ "$DEVICE" = cpu ] && ONEBIT=(train.seq_len=64) && MUON=(train.seq_len=64)
for seed in $SEEDS; do
  for opt in adamw onebit_adam; do
    timeout "$left" python3 bench/onebit_convergence.py --out "$RUNS/onebit95m_sim" --device "$DEVICE" --simulate-dp 4 \
      --steps "$STEPS" --warmup 300 --seeds "$seed" --only "$opt" --extra "${ONEBIT[@]}" \
      > "$RUNS/onebit-$opt-$seed.log" 2>&1 &
  done
done
for seed in $MUON_SEEDS; do
  for opt in adamw muon; do
    timeout "$left" python3 bench/muon_convergence.py --out "$RUNS/muon95m" --device "$DEVICE" --steps "$STEPS" \
      --warmup 200 --seeds "$seed" --only "$opt" --extra "${MUON[@]}" > "$RUNS/muon-$opt-$seed.log" 2>&1 &
  done
done
while [ -n "$(jobs -r)" ]; do  # progress every 30 s: the steps each run has logged
  sleep 30
  echo "--- $((SECONDS - start)) s: $(for f in "$RUNS"/*/*/metrics.jsonl; do [ -f "$f" ] && \
    printf '%s=%s ' "${f#"$RUNS"/}" "$(wc -l < "$f")"; done)"
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>/dev/null
done
wait
echo "=== $(date -u +%FT%TZ) runs done ($((SECONDS - start)) s)"
tail -n 3 "$RUNS"/*.log
python3 bench/onebit_convergence.py --out "$RUNS/onebit95m_sim" --simulate-dp 4 --steps "$STEPS" --seeds $SEEDS \
  --summary 2>&1 | tail -8
python3 bench/muon_convergence.py --out "$RUNS/muon95m" --steps "$STEPS" --seeds $MUON_SEEDS --summary 2>&1 | tail -6
