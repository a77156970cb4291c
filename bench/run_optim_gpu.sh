#!/bin/bash
# Issue 51's GPU runs in one device call: the GPU smoke suite, then at once on one GPU (small models leave it mostly
# idle, so the processes share it; under NVIDIA MPS where the machine allows it, so their small kernels run side by
# side instead of in time slices): 1-bit Adam against AdamW at ~92M parameters with dp 4 simulated in one process
# (bench/onebit_convergence.py --simulate-dp 4; 2,000 steps, warm-up 300, SEEDS, one process per run), and Muon
# against AdamW at ~92M on the Python standard library's code (bench/muon_convergence.py; 2,000 steps of 8 x 512
# tokens, MUON_SEEDS; the default corpus is memorised by a 92M model within 1,000 steps: train loss 0.26, seen on
# an H100 2026-12-06). Every run writes its metrics line by line under $RUNS and is killed at DEADLINE seconds from
# the start, so a run cut short keeps what it did; the tables are printed from the files at the end (and again on
# any machine with --summary), and everything but checkpoints and token files is packed into PACK (a device call
# returns 8 files, 2 folders deep).
#
#   RUNS=/tmp/runs PACK=$OUT/runs.tgz DEADLINE=540 bash bench/run_optim_gpu.sh | tee $OUT/optim_gpu.log  # device
#   RUNS=/tmp/r STEPS=4 SEEDS=1 DEVICE=cpu SMOKE=0 bash bench/run_optim_gpu.sh   # the script's own CPU check
#
# Continuing: RESUME=<an earlier runs.tgz> unpacks its runs first (a run whose metrics hold every step is not run
# again); ONEBIT_OPTS="onebit_adam" MUON_SEEDS="" runs the 1-bit side alone (its AdamW peers from RESUME);
# ONEBIT_OPTS="" ZERO_ONE=16 MUON_SEEDS="" runs 1-bit Adam with 0/1 Adam's variance policy alone (the same peers).
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
RUNS=$(realpath -m "${RUNS:-runs/optim_gpu}"); DEADLINE=${DEADLINE:-570}; STEPS=${STEPS:-2000}; SEEDS=${SEEDS:-1 2 3}
DEVICE=${DEVICE:-cuda}; SMOKE=${SMOKE:-1}; MUON_SEEDS=${MUON_SEEDS-1}
mkdir -p "$RUNS"
[ -n "${RESUME:-}" ] && tar xzf "$RESUME" -C "$RUNS" && echo "resumed from $RESUME"
ONEBIT_OPTS=${ONEBIT_OPTS-adamw onebit_adam}; ZERO_ONE=${ZERO_ONE:-}
start=$SECONDS
# SMOKE=bg: the smoke suite beside the runs (its dry runs and gloo world are small; the 1-bit runs need the call's
# whole 10 minutes); its lines are printed at the end
if [ "$SMOKE" = 1 ]; then bash bench/gpu_smoke.sh 2>&1 | tee "$RUNS/smoke.txt"; fi
if [ "$DEVICE" = cuda ] && nvidia-cuda-mps-control -d 2>/dev/null; then  # undone below if a process cannot use it
  if python3 -c "import torch; torch.zeros(1, device='cuda').add_(1); torch.cuda.synchronize()" 2>/dev/null; then
    echo "MPS on"
  else
    echo quit | nvidia-cuda-mps-control; echo "MPS failed its check: off"
  fi
fi
if [ "$SMOKE" = bg ]; then bash bench/gpu_smoke.sh > "$RUNS/smoke.txt" 2>&1 & fi  # (after MPS: its client too)
# the standard library's code outside tests (as the CPU runs of docs/optimizers.md), with the default tokenizer
PYLIB=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
TOK=$(python3 -c "from megaloom.data.corpus import cache_root, prepare_default; print(prepare_default(cache_root(''), 8192)[0])")
[ -n "$MUON_SEEDS" ] && find "$PYLIB" -name '*.py' -not -path '*/test*/*' -not -path '*/idlelib/*' -not -path '*-packages/*' | sort \
  > "$RUNS/stdlib_files.txt"
[ -n "$MUON_SEEDS" ] && python3 -m megaloom preprocess --tokenizer "$TOK" --out "$RUNS/stdlib_tok" --workers 8 $(cat "$RUNS/stdlib_files.txt") \
  2>&1 | tail -2
left=$((DEADLINE - (SECONDS - start) - 25))  # 25 s for the tables
echo "=== $(date -u +%FT%TZ) runs start, $left s left"
ONEBIT=(model.preset=gpt2-124m model.vocab_size=0 train.seq_len=256 train.micro_batch_size=4 train.precision=bf16)
MUON=(model.preset=gpt2-124m model.vocab_size=0 "data.paths=$RUNS/stdlib_tok" "data.tokenizer=$TOK" train.seq_len=512
      train.global_batch_size=8 train.micro_batch_size=8 train.lr=6e-4 train.min_lr=6e-5 train.precision=bf16)
[ "$DEVICE" = cpu ] && ONEBIT=(train.seq_len=64) && MUON=("data.paths=$RUNS/stdlib_tok" "data.tokenizer=$TOK" train.seq_len=64)
for seed in $SEEDS; do
  for opt in $ONEBIT_OPTS; do
    timeout -s KILL "$left" python3 bench/onebit_convergence.py --out "$RUNS/onebit95m_sim" --device "$DEVICE" --simulate-dp 4 \
      --steps "$STEPS" --warmup "${WARMUP:-300}" --seeds "$seed" --only "$opt" --extra "${ONEBIT[@]}" \
      > "$RUNS/onebit-$opt-$seed.log" 2>&1 &
  done
done
for seed in $SEEDS; do  # ZERO_ONE=N: 1-bit Adam with 0/1 Adam's variance policy too (onebit95m_sim01, its peers copied)
  [ -n "$ZERO_ONE" ] && timeout -s KILL "$left" python3 bench/onebit_convergence.py --out "$RUNS/onebit95m_sim01" \
    --device "$DEVICE" --simulate-dp 4 --steps "$STEPS" --warmup "${WARMUP:-300}" --seeds "$seed" --only onebit_adam \
    --extra "${ONEBIT[@]}" "train.onebit_variance_updates=$ZERO_ONE" > "$RUNS/onebit01-$seed.log" 2>&1 &
done
for seed in $MUON_SEEDS; do
  for opt in adamw muon; do
    timeout -s KILL "$left" python3 bench/muon_convergence.py --out "$RUNS/muon95m" --device "$DEVICE" --steps "$STEPS" \
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
[ "$SMOKE" = bg ] && cat "$RUNS/smoke.txt"
tail -n 3 "$RUNS"/*.log
python3 bench/onebit_convergence.py --out "$RUNS/onebit95m_sim" --simulate-dp 4 --steps "$STEPS" --seeds $SEEDS \
  --summary 2>&1 | tail -8
if [ -n "$ZERO_ONE" ]; then
  for d in "$RUNS"/onebit95m_sim/adamw_seed*; do [ -d "$d" ] && cp -r "$d" "$RUNS/onebit95m_sim01/"; done
  echo "0/1 Adam's variance policy (train.onebit_variance_updates=$ZERO_ONE):"
  python3 bench/onebit_convergence.py --out "$RUNS/onebit95m_sim01" --simulate-dp 4 --steps "$STEPS" --seeds $SEEDS \
    --summary 2>&1 | tail -8
fi
[ -n "$MUON_SEEDS" ] && python3 bench/muon_convergence.py --out "$RUNS/muon95m" --steps "$STEPS" --seeds $MUON_SEEDS --summary 2>&1 | tail -6
[ "$DEVICE" = cuda ] && echo quit | nvidia-cuda-mps-control 2>/dev/null
tar czf "${PACK:-$RUNS/runs.tgz}" --exclude=checkpoints --exclude='*.bin' -C "$RUNS" onebit95m_sim $(cd "$RUNS" && ls -d muon95m onebit95m_sim01 2>/dev/null) $(cd "$RUNS" && ls ./*.log) \
  && ls -la "${PACK:-$RUNS/runs.tgz}"
