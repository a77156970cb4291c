#!/bin/bash
# Wave-2 checks on one H200 (offline), from the repository root; each part fits one device call:
#   bash bench/run_checks.sh tests     # every GPU test (pytest -m gpu): NCCL-side fault machinery, flex masks, ...
#   bash bench/run_checks.sh bf16ab    # 300 bf16 steps of a ~95M Llama on the embedded corpus, this tree against
#                                      # bench/.old (a `git archive` of an earlier commit): final losses within bf16
#                                      # noise, tokens/s side by side (the bf16 residual stream / activation changes)
#   bash bench/run_checks.sh docmask   # `megaloom train` with data.document_mask + reset_positions, compiled, 30 steps
# Logs and metrics land in $OUT (default /tmp/megaloom-checks): few files (the device tool brings back eight).
set -u
export OUT=${OUT:-/tmp/megaloom-checks} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export MEGALOOM_CACHE=${MEGALOOM_CACHE:-/tmp/megaloom-cache}
PARTS=${*:-tests bf16ab docmask}
mkdir -p "$OUT"
LOG="$OUT/checks.log"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch; print('torch', torch.__version__)"; } >> "$LOG" 2>&1
has() { [[ " $PARTS " == *" $1 "* ]]; }
M="model.arch=llama model.d_model=768 model.n_layers=14 model.n_heads=12 model.n_kv_heads=4 model.ffn_dim=2048
   model.max_seq_len=1024 train.seq_len=1024 train.global_batch_size=32 train.micro_batch_size=32 train.steps=300
   train.lr=1e-3 train.min_lr=1e-4 train.warmup_steps=30 train.eval_every=0 train.log_every=10 checkpoint.every=0
   checkpoint.final=false run.tensorboard=false train.precision=bf16"
if has tests; then
  # -k: a test that trains catches SIGTERM (save and stop) and pytest would go on to the next test; -v: each
  # test's name and result as it ends, so a log cut short by the call's limit still says which ran and how
  timeout -k 10 ${TESTS_TIMEOUT:-450} python3 -m pytest -v -rfE -p no:cacheprovider -m gpu --durations=15 tests > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests rc=$? $(tail -1 "$OUT/gpu_tests.log")"
fi
train() {  # train NAME TREE OVERRIDES...: 300 steps of the model above, metrics to $OUT/metrics_NAME.jsonl
  # Run from inside TREE: `python -m` puts the working directory first on sys.path, so PYTHONPATH alone would
  # import this tree's megaloom for the old one too.
  local name=$1 tree=$2; shift 2
  # shellcheck disable=SC2086
  (cd "$tree" && timeout 170 python3 -m megaloom train $M "$@" run.dir=/tmp/megaloom-run-$name) > "/tmp/train_$name.log" 2>&1
  echo "train $name rc=$? ($(cd "$tree" && python3 -c 'import megaloom, os; print(os.path.dirname(megaloom.__file__))'))"
  { echo "=== train $name (tree $tree): $*"; tail -8 "/tmp/train_$name.log"; } >> "$LOG"
  cp /tmp/megaloom-run-$name/metrics.jsonl "$OUT/metrics_$name.jsonl" 2>/dev/null
}
if has bf16ab; then
  train old bench/.old; train new . ; train new_bf16res . train.bf16_residual=true
  python3 - "$OUT" "$(cat bench/.old/COMMIT 2>/dev/null)" <<'PY' | tee -a "$LOG"
import json, sys
def tail(name):
    rows = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics_{name}.jsonl")]
    last = rows[-5:]  # steps 260..300
    return sum(r["loss"] for r in last) / len(last), sorted(r["tokens_per_s"] for r in rows[3:])[len(rows[3:]) // 2]
a, ta = tail("old")
for name in ("new", "new_bf16res"):
    try:
        b, tb = tail(name)
    except OSError:
        print(f"{name}: no metrics"); continue
    print(f"bf16 300 steps: old ({sys.argv[2]}) loss {a:.4f} at {ta:,.0f} tok/s | {name} loss {b:.4f} at {tb:,.0f} "
          f"tok/s | loss gap {100 * (b - a) / a:+.2f}% | speed {tb / ta:.3f}x")
PY
fi
if has docmask; then
  train docmask . train.steps=30 train.compile=true data.document_mask=true data.reset_positions=true
  train nomask . train.steps=30 train.compile=true
  grep -h "step     30" /tmp/train_docmask.log /tmp/train_nomask.log | tee -a "$LOG"
fi
