#!/bin/bash
# Precision proofs on one H200 (offline), from the repository root:
#   bash bench/run_precision.sh [tests] [train] [rowwise] [seed] [seed_fp8] [seed3] [precise] [precise_seeds] [mlp_only] [memory]     (default: tests train memory)
#   bash bench/run_precision.sh block_tests     # blockwise fp8 / fp8 experts: GPU and CPU tests (at most 7 min)
#   bash bench/run_precision.sh block moe_fp8   # blockwise vs bf16, 2,000 steps x 3 seeds (at most 5 min), then
#                                               # qwen3-moe fp8 experts' speed (at most 2 x 125 s): under 10 min
# 1. the tests of precision, memory plan and models, whose GPU cases run there (fp8 GEMMs, grouped GEMM, fused loss);
# 2. `megaloom train` of a ~95M-parameter Llama-style model on the embedded corpus for 300 steps, in bf16 and
#    in fp8 (same seed, same data): the final losses must agree within 1%;
# 3. the memory report's predicted peak against the measured one (bench/bench_memory.py).
# block: bf16 against train.fp8_recipe=blockwise, 2,000 steps at seeds 1-3 of a 25M model whose GEMM dimensions are
#   multiples of 512, the six runs side by side on the GPU (launch-bound: they share it; their tokens/s are no speeds),
#   then bench/compare_precision.py (its docstring has the details). moe_fp8: bench_train.py on qwen3-moe-2.6b,
#   compiled, fp8 tensorwise linears without and with train.fp8_experts (MOE_RUNS="bf16 fp8 fp8_experts" adds bf16).
#   block_tests: tests/precision/test_fp8_block_gpu.py (the kernels against the emulation, compiled, tiny models).
# Logs, metrics and JSON rows land in $OUT (default /tmp/megaloom-precision).
set -u
export OUT=${OUT:-/tmp/megaloom-precision} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export MEGALOOM_CACHE=${MEGALOOM_CACHE:-/tmp/megaloom-cache}
PARTS=${*:-tests train memory}
# GBS: sequences of 1024 tokens per step. The embedded corpus is ~1.3M tokens, so the default 32 makes 300 steps
# ~7.5 epochs (the late loss is memorisation); GBS=4 keeps the 300 steps within about one epoch.
GBS=${GBS:-32}
M="model.arch=llama model.d_model=768 model.n_layers=14 model.n_heads=12 model.n_kv_heads=4 model.ffn_dim=2048
   model.max_seq_len=1024 train.seq_len=1024 train.global_batch_size=$GBS train.micro_batch_size=$GBS train.steps=300
   train.lr=1e-3 train.min_lr=1e-4 train.warmup_steps=30 train.eval_every=0 train.log_every=10 checkpoint.every=0
   run.tensorboard=false"
mkdir -p "$OUT"
LOG="$OUT/precision.log"  # one log (the device tool brings back at most eight files)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch; print('torch', torch.__version__)"; } >> "$LOG" 2>&1
has() { [[ " $PARTS " == *" $1 "* ]]; }
if has block_tests; then
  timeout -k 10 420 python3 -m pytest -q -rfE -p no:cacheprovider tests/precision/test_fp8_block_gpu.py tests/precision/test_fp8_block.py > "$OUT/block_tests.log" 2>&1
  echo "block tests rc=$?"; tail -15 "$OUT/block_tests.log"
fi
if has tests; then
  timeout -k 10 300 python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/precision tests/planning tests/models tests/test_step.py > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests rc=$?"
fi
train() {  # train NAME OVERRIDES...: 300 steps of the model above, metrics to $OUT/metrics_NAME.jsonl
  local name=$1; shift
  # shellcheck disable=SC2086
  timeout 170 python3 -m megaloom train $M "$@" run.dir=/tmp/megaloom-run-$name > "/tmp/train_$name.log" 2>&1
  echo "train $name rc=$?"
  { echo "=== train $name: $*"; head -40 "/tmp/train_$name.log"; echo ...; tail -15 "/tmp/train_$name.log"; } >> "$LOG"
  cp /tmp/megaloom-run-$name/metrics.jsonl "$OUT/metrics_$name.jsonl" 2>/dev/null
}
if has train; then
  train bf16 train.precision=bf16
  train fp8 train.precision=fp8
fi
# the same with rowwise fp8 scaling; bf16 with another seed (init and data order: the run-to-run noise floor)
if has rowwise; then train fp8_rowwise train.precision=fp8 train.fp8_recipe=rowwise; fi
if has seed; then train bf16_seed2 train.precision=bf16 train.seed=2; fi
if has seed_fp8; then train fp8_seed2 train.precision=fp8 train.seed=2; fi  # the fp8 partner of bf16_seed2
if has seed3; then train bf16_seed3 train.precision=bf16 train.seed=3; train fp8_seed3 train.precision=fp8 train.seed=3; fi
if has precise; then train fp8_precise train.precision=fp8 train.fp8_fast_accum=false; fi
if has precise_seeds; then  # fp32-accumulated fp8 against bf16 at seeds 2 and 3, bf16 partners rerun in the same call
  for seed in 2 3; do
    train bf16_seed$seed train.precision=bf16 train.seed=$seed
    train fp8_precise_seed$seed train.precision=fp8 train.fp8_fast_accum=false train.seed=$seed
  done
fi
if has mlp_only; then train fp8_mlp_only train.precision=fp8 train.fp8_keep_attention=true; fi
if has block; then
  BM="model.arch=llama model.d_model=512 model.n_layers=6 model.n_heads=8 model.n_kv_heads=8 model.ffn_dim=1536
      model.max_seq_len=512 train.seq_len=512 train.global_batch_size=4 train.micro_batch_size=4 train.steps=2000
      train.lr=1e-3 train.min_lr=1e-4 train.warmup_steps=100 train.eval_every=500 train.eval_batches=8
      train.log_every=10 train.compile=false train.fused_loss=false checkpoint.every=0 checkpoint.final=false
      run.tensorboard=false"
  # the corpus cache once, before six processes want it
  python3 -c "from megaloom.data.corpus import cache_root, prepare_default; prepare_default(cache_root(''), 8192)"
  for seed in 1 2 3; do
    for kind in bf16 fp8_blockwise; do
      extra="train.precision=bf16"; [ $kind = fp8_blockwise ] && extra="train.precision=fp8 train.fp8_recipe=blockwise"
      # shellcheck disable=SC2086
      timeout "${BLOCK_TIMEOUT:-300}" python3 -m megaloom train $BM $extra train.seed=$seed \
        run.dir=/tmp/megaloom-block-${kind}_seed$seed > "/tmp/train_${kind}_seed$seed.log" 2>&1 &
    done
  done
  wait
  for seed in 1 2 3; do
    for kind in bf16 fp8_blockwise; do
      name=${kind}_seed$seed
      cp /tmp/megaloom-block-$name/metrics.jsonl "$OUT/metrics_$name.jsonl" 2>/dev/null
      { echo "=== train $name"; grep -m3 "megaloom: fp8\|blockwise GEMMs\|params on" "/tmp/train_$name.log";
        tail -6 "/tmp/train_$name.log"; } >> "$LOG"
      echo "block $name: $(grep -c '"loss"' "$OUT/metrics_$name.jsonl" 2>/dev/null) logged steps"
    done
  done
fi
if has moe_fp8; then
  MOE="python3 bench/bench_train.py --preset qwen3-moe-2.6b --seq-len 4096 --micro-batch ${MOE_MB:-4} --steps 12
       --warmup 4 --compile --fused-loss --attention cudnn --results $OUT/results.jsonl --run-id moe_fp8_$(date +%s)"
  for run in ${MOE_RUNS:-fp8 fp8_experts}; do
    case $run in
      bf16) a="--precision bf16" ;;
      fp8) a="--precision fp8" ;;
      fp8_experts) a="--precision fp8 --fp8-experts" ;;
      blockwise_experts) a="--precision fp8 --fp8-recipe blockwise --fp8-experts" ;;
      *) echo "unknown MOE_RUNS entry $run"; continue ;;
    esac
    # shellcheck disable=SC2086
    timeout "${MOE_TIMEOUT:-125}" $MOE $a > "/tmp/moe_$run.log" 2>&1
    echo "moe $run rc=$? $(grep -o '"tokens_per_s": [0-9]*\|"peak_mem_gb": [0-9.]*\|"step_ms_median": [0-9.]*' "/tmp/moe_$run.log" | tr '\n' ' ')"
    { echo "=== moe $run: $a"; grep -v "^step " "/tmp/moe_$run.log" | tail -20; grep "^step " "/tmp/moe_$run.log" | tail -4; } >> "$LOG"
  done
fi
ls "$OUT"/metrics_*.jsonl > /dev/null 2>&1 && python3 bench/compare_precision.py "$OUT" | tee -a "$LOG"
if has memory; then
  timeout 200 python3 bench/bench_memory.py --results "$OUT/memory.jsonl" > "$OUT/memory.log" 2>&1
  echo "memory rc=$?"
  grep -h -E "predicted|RESULT|error" "$OUT/memory.log" | tail -12
fi
