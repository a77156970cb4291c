#!/bin/bash
# The speed issue's measurements on one H200 (offline), from the repository root. Two parts, each one device
# call of under 10 minutes:
#   bash bench/run_speed.sh ladder   # megaloom llama3-1b-untied, seq 4096: one lever at a time, then a profile
#   bash bench/run_speed.sh race     # TorchTitan bf16 + float8 (needs bench/.peer) and megaloom's best, back to back
#                                    # (FP8_MORE=1: fp8 at mb 8; FP8_PROFILE=1: an fp8 step profile; PEER_MB8=1: TorchTitan mb 8)
#   bash bench/run_speed.sh parity   # `megaloom train` 200 steps on the embedded corpus: plain path vs optimised path
#                                    # (PARITY_FAST_EXTRA: more keys for the optimised side, e.g. train.bf16_residual=true)
#   bash bench/run_speed.sh moe-parity  # the same for qwen3-moe-2.6b (the compiled MoE block against eager)
#   bash bench/run_speed.sh 8b       # llama3-8b at sequence 8192: EIGHTB_VARIANTS "MB:RECOMPUTE[:N] ..." tried in order
#                                    # (default: mb 1 keeping every activation, then 4 or 10 blocks recomputed, then mb 3 full)
#   bash bench/run_speed.sh peer-mb8  # TorchTitan bf16 + float8 at micro-batch 8 alone (needs bench/.peer)
#   bash bench/run_speed.sh profile-fp8  # a profile of megaloom's fp8 step
#   bash bench/run_speed.sh 8b-peer  # TorchTitan's 8B flavor, seq 8192, its AC modes none/selective/full tried in order
#                                    # until one fits (TITAN_8B_AC; needs bench/.peer)
#   bash bench/run_speed.sh long     # llama3-1b-untied at LONG_SEQS (default 32k and 64k; LONG_DOC=1: + document masks),
#                                    # TorchTitan beside at each, then bench_optimizer.py (AdamW against HBM bandwidth)
#   bash bench/run_speed.sh defaults # `megaloom train` with only model + batch (levers at auto) vs bench_train's best,
#                                    # same micro-batch (DEFAULTS_MODEL / _SEQ / _MB / _STEPS / _EXTRA / _BENCH_ARGS, and
#                                    # RUN_TIMEOUT, for llama3-8b)
#   bash bench/run_speed.sh moe      # qwen3-moe-2.6b compiled (profiled, MoE kinds; MOE_EAGER=1: eager too) vs
#                                    # TorchTitan's qwen3 moe-2.6B (bench/titan_moe.py; needs bench/.peer)
#   bash bench/run_speed.sh overlap  # train.overlap_optimizer against the plain step (mb 4 twice, alternated; 16k)
#   bash bench/run_speed.sh bf16res  # train.bf16_residual against the fp32 residual stream (mb 4 alternated; 16k profiled)
#   bash bench/run_speed.sh fa4      # FlashAttention-4 behind SDPA (train.attention=fa4) vs cuDNN: bench/fa4_probe.py's
#                                    # kernels, then steps at 4k mb 4 and FA4_SEQS (default 16k, 32k) mb 1
#   bash bench/run_speed.sh ab       # this tree against an older megaloom in bench/.old (a `git archive` of the commit,
#                                    # carried to the machine): best bf16 mb 4, alternated new/old/new/old
#                                    # (a refactor's speed check: the same step, two commits, one call)
#   bash bench/run_speed.sh dryrun   # one rank of a large job per layout (`megaloom train --dry-run` through
#                                    # bench_dry_run.py run): step, kernel time by kind, GPU busy, floor, MFU, memory vs
#                                    # plan, as bench=dry_run rows. DRY_RUNS "LAYOUT:RANK ..." (layouts in dry_layout
#                                    # below; default: every layout at rank 0 and its last stage); DRY_OLD=LAYOUT:RANK
#                                    # also runs that one with the megaloom of bench/.old (its step times in the log);
#                                    # DRY_TOP=LAYOUT:RANK keeps that run's trace ($OUT) and lists its largest kernels
# Rows land in $OUT/results.jsonl (append them to bench/results.jsonl), all logs in $OUT/$PART.log, the profile
# in $OUT/profile/ (trace.json.gz, breakdown.json): few files, as the device tool brings back at most eight.
set -u
PART=${1:-ladder}
export OUT=${OUT:-/tmp/megaloom-speed} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
RUN_ID=$(date -u +%Y%m%dT%H%M%S)
export MEGALOOM_COMMIT=${MEGALOOM_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
LOG="$OUT/$PART.log"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch; print('torch', torch.__version__)"; } > "$LOG" 2>&1
B="python3 bench/bench_train.py --preset llama3-1b-untied --seq-len 4096 --steps 16 --warmup 6 --compile --results $OUT/results.jsonl --run-id $RUN_ID"
run() {
  local name=$1; shift
  echo "=== $name: $*" >> "$LOG"
  timeout "${RUN_TIMEOUT:-150}" $B "$@" > /tmp/run_$name.log 2>&1; local rc=$?
  tail -25 /tmp/run_$name.log >> "$LOG"
  echo "$name rc=$rc $(grep -o '"tokens_per_s": [0-9]*' /tmp/run_$name.log)"
}
BEST="--micro-batch 4 --fused-loss --attention cudnn"
titan() {  # titan LOG TIMEOUT ARGS...: TorchTitan's own trainer from bench/.peer, one process, compiled, offline
  local log=$1 limit=$2; shift 2
  [ -d /tmp/peer-site/torchtitan ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/peer-site bench/.peer/.whl/*.whl
  (cd bench/.peer/torchtitan && mkdir -p data/synth && { [ -s data/synth/data.json ] ||
     python3 make_data.py data/synth/data.json > /dev/null; } &&
   RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29513 PYTHONPATH=/tmp/peer-site \
   HF_HUB_OFFLINE=1 timeout "$limit" python3 "${TITAN_SCRIPT:-run_titan.py}" --model.name "${TITAN_MODEL:-llama3}" \
     --model.hf_assets_path assets/tokenizer \
     --training.dataset c4_test --training.dataset_path data/synth --metrics.log_freq 1 \
     --metrics.disable_color_printing --lr_scheduler.warmup_steps 2 --compile.enable "$@") > "$log" 2>&1
}
titan_mb8() {  # TorchTitan at micro-batch 8, bf16 and float8 (its largest micro-batch: its best setting, as the race asks)
  local mb8="--model.flavor 1B --training.seq_len 4096 --training.steps 20 --training.local_batch_size 8
             --activation_checkpoint.mode none --job.dump_folder /tmp/titan_dump"
  mkdir -p /tmp/peer
  # shellcheck disable=SC2086
  titan /tmp/peer/titan_compile_bs8.log 150 $mb8
  # shellcheck disable=SC2086
  titan /tmp/peer/titan_compile_fp8_nooutput_bs8.log 150 $mb8 --model.converters quantize.linear.float8 \
    --quantize.linear.float8.recipe_name tensorwise --quantize.linear.float8.filter_fqns output
  python3 bench/.peer/summarize.py /tmp/peer >> /tmp/peer.log 2>&1
}
profile_fp8() {  # profile_fp8 DIR: one fp8 step profiled into DIR, its table of kernel time by kind to stdout
  run profile_fp8 $BEST --precision fp8 --profile "$1"
  grep -A12 "^kind" /tmp/run_profile_fp8.log
}
peer_collect() {  # peer_collect TITLE: TorchTitan's log into $LOG, its summary lines (once each) into $OUT
  { echo "=== $1"; cat /tmp/peer.log; } >> "$LOG"
  grep "^{" /tmp/peer.log | awk '!seen[$0]++' > "$OUT/peer_summary.jsonl"; cat "$OUT/peer_summary.jsonl"
}
dry_layout() {  # the issue-34 layouts: world, then the config overrides
  local L70="model.preset=llama3-70b train.micro_batch_size=1 parallel.zero=1 parallel.sp=true"
  case $1 in
    70b-4k) echo "--world 1024 $L70 parallel.tp=8 parallel.pp=8 parallel.vpp=2 parallel.schedule=interleaved \
      train.seq_len=4096 train.global_batch_size=256";;
    70b-4k-nofuse) echo "$(dry_layout 70b-4k) train.grad_accum_fusion=false";;  # the fusion lever's A/B
    70b-4k-embfuse) echo "$(dry_layout 70b-4k) train.embedding_grad_fusion=true";;  # the embedding's rows fused
    70b-4k-bf16p) echo "$(dry_layout 70b-4k) train.bf16_params=true";;  # bf16 weights, fp32 master shards
    70b-4k-novpp) echo "--world 1024 $L70 parallel.tp=8 parallel.pp=8 train.seq_len=4096 train.global_batch_size=256";;
    70b-8k) echo "--world 1024 $L70 parallel.tp=8 parallel.pp=8 parallel.vpp=2 parallel.schedule=interleaved \
      train.seq_len=8192 model.max_seq_len=8192 train.global_batch_size=256";;
    70b-cp) echo "--world 1024 $L70 parallel.tp=4 parallel.pp=4 parallel.vpp=5 parallel.schedule=interleaved \
      parallel.cp=2 train.seq_len=8192 model.max_seq_len=8192 train.global_batch_size=256";;
    8b) echo "--world 1024 model.preset=llama3-8b train.micro_batch_size=1 parallel.zero=1 parallel.sp=true \
      parallel.tp=4 parallel.pp=2 train.seq_len=8192 model.max_seq_len=8192 train.global_batch_size=1024";;
    405b) echo "--world 8192 model.preset=llama3-70b model.n_layers=126 model.d_model=16384 model.n_heads=128 \
      model.n_kv_heads=8 model.ffn_dim=53248 train.micro_batch_size=1 parallel.zero=1 parallel.sp=true \
      parallel.tp=8 parallel.pp=16 parallel.pp_first_stage_layers=7 parallel.pp_last_stage_layers=7 \
      train.seq_len=8192 model.max_seq_len=8192 train.global_batch_size=1024";;
    405b-rcfull) echo "$(dry_layout 405b) train.recompute=full";;  # fits an 80 GB H100 (planned 25.8 GB against 120.5)
    405b-vpp2) echo "$(dry_layout 405b) parallel.vpp=2 parallel.schedule=interleaved";;  # Llama 3's uneven interleaving
    mixtral) echo "--world 256 model.preset=mixtral-8x7b train.micro_batch_size=1 parallel.zero=1 parallel.ep=8 \
      parallel.pp=4 train.seq_len=4096 train.global_batch_size=512";;
    deepseek) echo "--world 2048 model.preset=deepseek-v3 train.micro_batch_size=1 parallel.zero=1 parallel.ep=64 \
      parallel.pp=16 parallel.pp_first_stage_layers=1 parallel.pp_last_stage_layers=4 train.seq_len=4096 \
      train.global_batch_size=2048";;  # DeepSeek-V3's published shape (671B) on 2,048 ranks: pp16 x ep64, no tp
    *) echo "unknown layout $1" >&2; return 1;;
  esac
}
if [ "$PART" = dryrun ]; then
  D="python3 bench/bench_dry_run.py run --steps ${DRY_STEPS:-4} --results $OUT/results.jsonl --run-id $RUN_ID"
  if [ -n "${DRY_OLD:-}" ]; then  # the same layout with an older megaloom (bench/.old): its own report
    name=${DRY_OLD%%:*}; rank=${DRY_OLD#*:}
    echo "=== OLD $(cat bench/.old/COMMIT 2>/dev/null) $name rank $rank" >> "$LOG"
    # shellcheck disable=SC2046
    # from inside bench/.old: `python -m` puts the working directory first on sys.path
    (cd bench/.old && timeout "${DRY_TIMEOUT:-300}" python3 -m megaloom train --dry-run --rank "$rank" \
      --dry-run-steps "${DRY_STEPS:-4}" $(dry_layout "$name")) > /tmp/dry_old.log 2>&1
    echo "old $name $rank rc=$? $(grep -o 'steps: .*s (' /tmp/dry_old.log)"
    sed -n '/^megaloom dry run/,$p' /tmp/dry_old.log >> "$LOG"
  fi
  for spec in ${DRY_RUNS:-70b-4k:0 70b-4k:last-stage 70b-8k:0 70b-8k:last-stage 70b-cp:0 70b-cp:last-stage 8b:0 \
                8b:last-stage 405b:0 405b:last-stage mixtral:0 mixtral:last-stage}; do
    name=${spec%%:*}; rank=${spec#*:}
    echo "=== $name rank $rank" >> "$LOG"
    # shellcheck disable=SC2046
    keep=""; [ "$spec" = "${DRY_TOP:-}" ] && keep="--keep-dir /tmp/dry_keep"  # DRY_TOP=LAYOUT:RANK: largest kernels
    # shellcheck disable=SC2046,SC2086
    timeout "${DRY_TIMEOUT:-300}" $D --rank "$rank" $keep $(dry_layout "$name") > "/tmp/dry_$name.log" 2>&1
    rc=$?
    sed -n '/^megaloom dry run/,$p' "/tmp/dry_$name.log" >> "$LOG"
    if [ -n "$keep" ] && [ -f /tmp/dry_keep/profile/trace.json.gz ]; then
      python3 bench/profile_breakdown.py /tmp/dry_keep/profile/trace.json.gz --top 14 >> "$LOG" 2>&1
      cp /tmp/dry_keep/profile/trace.json.gz "$OUT/trace_$name.json.gz"
    fi
    [ $rc = 0 ] || tail -60 "/tmp/dry_$name.log" >> "$LOG"  # (errors come as "[rank0]:" lines)
    echo "$name $rank rc=$rc $(grep -o 'GPU busy.*' "/tmp/dry_$name.log" | cut -c1-120)"
  done
elif [ "$PART" = peer-mb8 ]; then  # TorchTitan's micro-batch 8 runs alone (when a race call had no time for them)
  if [ -d bench/.peer/.whl ]; then
    rm -rf /tmp/peer /tmp/peer.log  # only this call's logs (see the race part)
    titan_mb8
    peer_collect "TorchTitan mb 8"
  fi
elif [ "$PART" = long ]; then  # long sequences on one GPU (cp=1): llama3-1b-untied, TorchTitan beside
  # LONG_SEQS (default "32768 65536"): each length run by megaloom then TorchTitan in the same call; recompute none
  # up to 32k (both frameworks fit), selective beyond (TorchTitan: its op-level selective AC). LONG_DOC=1 adds the
  # document-mask rows.
  L="python3 bench/bench_train.py --preset llama3-1b-untied --micro-batch 1 --steps 7 --warmup 3 --compile
     --fused-loss --attention cudnn --results $OUT/results.jsonl --run-id $RUN_ID"
  long() {  # long NAME ARGS...: as `run`, with the long-sequence command
    local name=$1; shift
    echo "=== $name: $*" >> "$LOG"
    # shellcheck disable=SC2086
    timeout 170 $L "$@" > /tmp/run_$name.log 2>&1; local rc=$?
    tail -25 /tmp/run_$name.log >> "$LOG"
    echo "$name rc=$rc $(grep -o '"tokens_per_s": [0-9]*' /tmp/run_$name.log)"
  }
  rm -rf /tmp/peer /tmp/peer.log && mkdir -p /tmp/peer
  for seq in ${LONG_SEQS:-32768 65536}; do
    k=$((seq / 1024))k
    if [ "$seq" -le 32768 ]; then rc_ours="none"; rc_titan="--activation_checkpoint.mode none"
    else rc_ours="selective"; rc_titan="--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op"
    fi
    # --profile: one more step after the timed ones, its kernel time by kind (the attention's share) in the row
    if [ -z "${LONG_PEER_ONLY:-}" ]; then  # LONG_PEER_ONLY=1: TorchTitan's rows alone (megaloom's in another part)
      long "s$k" --seq-len "$seq" --recompute "$rc_ours" --profile "/tmp/prof_s$k"
      grep -A12 "^kind" "/tmp/run_s$k.log"
    fi
    [ -n "${LONG_DOC:-}" ] && long "s${k}_doc4k" --seq-len "$seq" --recompute "$rc_ours" --document-mask 4096
    if [ -d bench/.peer/.whl ]; then
      # shellcheck disable=SC2086
      titan "/tmp/titan$k.log" 170 --model.flavor 1B --training.seq_len "$seq" --training.local_batch_size 1 \
        --training.steps 10 --job.dump_folder "/tmp/titan_dump$k" $rc_titan
      echo "titan $k rc=$?"; { echo "=== TorchTitan 1B $k"; tail -14 "/tmp/titan$k.log"; } >> "$LOG"
      cp "/tmp/titan$k.log" "/tmp/peer/titan_compile_s$k.log"
    fi
  done
  if [ -d bench/.peer/.whl ]; then
    python3 bench/.peer/summarize.py /tmp/peer > /tmp/peer.log 2>&1; peer_collect "TorchTitan long sequences"
  fi
  # the optimizer against HBM bandwidth (the floor's third term), a few seconds
  [ -z "${LONG_PEER_ONLY:-}" ] && python3 bench/bench_optimizer.py --preset llama3-1b-untied --results "$OUT/results.jsonl" --run-id "$RUN_ID" \
    2>&1 | tail -3
elif [ "$PART" = defaults ]; then  # `megaloom train` as a user types it (levers at auto) vs bench_train's best path
  export MEGALOOM_CACHE=/tmp/megaloom-cache
  MODEL=${DEFAULTS_MODEL:-llama3-1b-untied} SEQ=${DEFAULTS_SEQ:-4096} MB=${DEFAULTS_MB:-8}
  EXTRA=${DEFAULTS_EXTRA:-}  # e.g. "train.recompute=full" for llama3-8b (bench_train gets --recompute full)
  BARGS=${DEFAULTS_BENCH_ARGS:-}
  # shellcheck disable=SC2086
  B="${B/--preset llama3-1b-untied --seq-len 4096/--preset $MODEL --seq-len $SEQ}" run best --micro-batch "$MB" \
    --fused-loss --attention cudnn $BARGS
  # shellcheck disable=SC2086
  timeout 300 python3 -m megaloom train model.preset="$MODEL" train.seq_len="$SEQ" train.global_batch_size="$MB" \
    train.steps="${DEFAULTS_STEPS:-20}" train.log_every=1 checkpoint.final=false run.dir=/tmp/defaults-run $EXTRA \
    > /tmp/defaults.log 2>&1
  echo "megaloom train rc=$?"; { echo "=== megaloom train (defaults)"; grep -v "^step\|^  " /tmp/defaults.log; } >> "$LOG"
  grep "auto:" /tmp/defaults.log
  python3 - "$MODEL" "$SEQ" "$MB" "$RUN_ID" "$OUT/results.jsonl" "$MEGALOOM_COMMIT" "$(grep -o 'auto: .*' /tmp/defaults.log | head -1)" <<'PY'
import datetime, json, statistics, sys
import torch
model, seq, mb, run_id, results, commit, auto = sys.argv[1:]
rows = [json.loads(line) for line in open("/tmp/defaults-run/metrics.jsonl")]
steady = [r["tokens_per_s"] for r in rows if r["step"] >= 8]
row = {"bench": "megaloom_train_defaults", "run_id": run_id, "date": datetime.date.today().isoformat(),
       "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit, "auto": auto,
       "typed": f"megaloom train model.preset={model} train.seq_len={seq} train.global_batch_size={mb}",
       "preset": model, "seq_len": int(seq),
       "micro_batch": int(mb), "tokens_per_s": round(statistics.median(steady)), "steps_timed": len(steady),
       "mfu": statistics.median(r["mfu"] for r in rows if r["step"] >= 8 and r["mfu"]) if steady else None,
       "peak_memory_gb": max(r.get("mem_gb", 0) or 0 for r in rows)}
print(json.dumps(row))
open(results, "a").write(json.dumps(row) + "\n")
PY
elif [ "$PART" = moe ]; then  # MoE race: qwen3-moe-2.6b (every block MoE, 32 experts top-4) vs TorchTitan's qwen3
  M="python3 bench/bench_train.py --preset qwen3-moe-2.6b --seq-len 4096 --steps 12 --warmup 4 --fused-loss
     --attention cudnn --micro-batch ${MOE_MB:-4} --results $OUT/results.jsonl --run-id $RUN_ID"
  moe_run() {  # moe_run NAME ARGS...
    local name=$1; shift
    echo "=== $name: $*" >> "$LOG"
    # shellcheck disable=SC2086
    timeout 200 $M "$@" > /tmp/run_$name.log 2>&1; local rc=$?
    tail -20 /tmp/run_$name.log >> "$LOG"
    echo "$name rc=$rc $(grep -o '"tokens_per_s": [0-9]*\|"peak_mem_gb": [0-9.]*' /tmp/run_$name.log | tr '\n' ' ')"
  }
  if [ -n "${MOE_EAGER:-}" ]; then
    moe_run moe_eager --profile /tmp/prof_moe_eager
    grep -A12 "^kind" /tmp/run_moe_eager.log
  fi
  # the compiled step's profile with the MoE kinds (grouped GEMM, routing, dispatch/combine); trace kept in $OUT
  moe_run moe_compiled --compile --profile "$OUT/profile_moe"
  grep -A14 "^kind" /tmp/run_moe_compiled.log
  if [ -d bench/.peer/.whl ]; then
    rm -rf /tmp/peer /tmp/peer.log && mkdir -p /tmp/peer && cp bench/titan_moe.py bench/.peer/torchtitan/
    # compiled (titan() always enables compile: TorchTitan's best path)
    TITAN_SCRIPT=titan_moe.py TITAN_MODEL=qwen3 titan /tmp/peer/titan_moe_compile.log 200 --model.flavor moe-2.6B \
      --training.seq_len 4096 --training.local_batch_size "${MOE_MB:-4}" --training.steps 15 \
      --job.dump_folder /tmp/titan_dump_moe --activation_checkpoint.mode none
    echo "titan moe rc=$?"; { echo "=== TorchTitan moe-2.6B compiled"; tail -12 /tmp/peer/titan_moe_compile.log; } >> "$LOG"
    python3 bench/.peer/summarize.py /tmp/peer > /tmp/peer.log 2>&1; peer_collect "TorchTitan qwen3 moe-2.6B"
  fi
elif [ "$PART" = overlap ]; then  # train.overlap_optimizer A/B: steps timed back to back (--window), alternated
  for round in 1 2; do
    run "plain$round" $BEST --window
    run "overlap$round" $BEST --window --overlap-optimizer
  done
  L16="--micro-batch 1 --seq-len 16384 --fused-loss --attention cudnn --window"
  # shellcheck disable=SC2086
  B="${B/--seq-len 4096/}" run plain16k $L16
  # shellcheck disable=SC2086
  B="${B/--seq-len 4096/}" run overlap16k $L16 --overlap-optimizer
elif [ "$PART" = bf16res ]; then  # train.bf16_residual A/B: mb 4 alternated (back to back), then 16k profiled
  for round in 1 2; do
    run "fp32res$round" $BEST --window train.bf16_residual=false
    run "bf16res$round" $BEST --window train.bf16_residual=true
  done
  L16="--micro-batch 1 --seq-len 16384 --fused-loss --attention cudnn"
  # shellcheck disable=SC2086
  B="${B/--seq-len 4096/}" run fp32res16k $L16 --profile "$OUT/p16" train.bf16_residual=false
  # shellcheck disable=SC2086
  B="${B/--seq-len 4096/}" run bf16res16k $L16 --profile "$OUT/p16b" train.bf16_residual=true
elif [ "$PART" = fa4 ]; then  # FlashAttention-4 behind SDPA (train.attention=fa4) against cuDNN: kernels, then steps
  # (needs flash-attn-4 and its CuTe DSL wheels importable, e.g. installed with --target on PYTHONPATH)
  timeout 200 python3 bench/fa4_probe.py >> "$LOG" 2>&1; echo "probe rc=$?"; grep '^b[0-9]\|Error' "$LOG" | head -8
  export RUN_TIMEOUT=${RUN_TIMEOUT:-200}  # the first FA4 run of a shape compiles its kernels
  run cudnn4k $BEST --window
  run fa4_4k --micro-batch 4 --fused-loss --attention fa4 --window
  for seq in ${FA4_SEQS:-16384 32768}; do
    # shellcheck disable=SC2086
    B="${B/--seq-len 4096/--seq-len $seq}" run "cudnn$seq" --micro-batch 1 --fused-loss --attention cudnn
    # shellcheck disable=SC2086
    B="${B/--seq-len 4096/--seq-len $seq}" run "fa4_$seq" --micro-batch 1 --fused-loss --attention fa4
  done
elif [ "$PART" = ab ]; then
  OLD_COMMIT=$(cat bench/.old/COMMIT 2>/dev/null || echo old)
  for round in 1 2; do
    run "new$round" $BEST
    PYTHONPATH=bench/.old MEGALOOM_COMMIT=$OLD_COMMIT B="${B/bench\/bench_train.py/bench/.old/bench/bench_train.py}" \
      run "old$round" $BEST
  done
elif [ "$PART" = profile-fp8 ]; then  # where an fp8 step's time goes
  profile_fp8 "$OUT/profile_fp8"
elif [ "$PART" = ladder ]; then
  run base --micro-batch 4
  run fused --micro-batch 4 --fused-loss
  run fused_cudnn $BEST
  run fused_cudnn_mb6 --micro-batch 6 --fused-loss --attention cudnn
  run fused_cudnn_fp8 $BEST --precision fp8
  run offload $BEST --offload  # activation offload to pinned host memory (train.offload_activations)
  run profile $BEST --profile "$OUT/profile"
  grep -A12 "^kind" /tmp/run_profile.log
elif [ "$PART" = 8b ]; then
  # EIGHTB_VARIANTS: "MB:RECOMPUTE[:N]" tried in order until one runs (N: recompute only the first N blocks);
  # EIGHTB_EXTRA: more bench_train.py flags for every variant (e.g. --recompute-casts).
  # mb1 with one micro-batch per step keeps every activation: the gradients grow in backward as the activations
  # free, so the peak is weights + AdamW state + activations (no gradient set held through a forward).
  B8="python3 bench/bench_train.py --preset llama3-8b --seq-len 8192 --steps 8 --warmup 3 --compile --fused-loss
      --attention cudnn --results $OUT/results.jsonl --run-id $RUN_ID"
  for v in ${EIGHTB_VARIANTS:-mb1:none mb1:full:4 mb1:full:10 mb3:full}; do
    IFS=: read -r mb rc nl <<< "$v"; mb=${mb#mb}
    echo "=== llama3-8b $v" >> "$LOG"
    # shellcheck disable=SC2086
    timeout 220 $B8 --micro-batch "$mb" --recompute "$rc" --recompute-layers "${nl:-0}" ${EIGHTB_EXTRA:-} \
      > "/tmp/run_8b_$mb.log" 2>&1
    rc=$?; echo "8b $v rc=$rc $(grep -o '"tokens_per_s": [0-9]*\|"peak_mem_gb": [0-9.]*' /tmp/run_8b_$mb.log | tr '\n' ' ')"
    tail -12 "/tmp/run_8b_$mb.log" >> "$LOG"
    [ $rc = 0 ] && break
  done
elif [ "$PART" = 8b-peer ]; then
  # TITAN_8B_AC: TorchTitan's activation checkpointing modes tried in order until one runs (its best that fits)
  if [ -d bench/.peer/.whl ]; then
    rm -rf /tmp/peer /tmp/peer.log && mkdir -p /tmp/peer
    for ac in ${TITAN_8B_AC:-none selective full}; do
      extra="--activation_checkpoint.mode $ac"
      [ "$ac" = selective ] && extra="$extra --activation_checkpoint.selective_ac_option op"
      # shellcheck disable=SC2086
      titan "/tmp/titan8b_$ac.log" 240 --model.flavor 8B --training.seq_len 8192 --training.local_batch_size 1 \
        --training.steps 10 --job.dump_folder /tmp/titan_dump8b $extra
      rc=$?; echo "titan 8B AC $ac rc=$rc"; { echo "=== TorchTitan 8B, AC $ac"; tail -25 "/tmp/titan8b_$ac.log"; } >> "$LOG"
      if [ $rc = 0 ]; then cp "/tmp/titan8b_$ac.log" "/tmp/peer/titan_compile_8b_s8k_ac_$ac.log"; break; fi
    done
    python3 bench/.peer/summarize.py /tmp/peer > /tmp/peer.log 2>&1; peer_collect "TorchTitan 8B"
  fi
elif [ "$PART" = parity ] || [ "$PART" = moe-parity ]; then
  # The optimised path must train like the plain one (bf16 noise: final losses within 1%). Plain = every lever off
  # (eager, the plain loss on fp32 logits, PyTorch's own SDPA order); optimised = the defaults (levers at auto).
  # moe-parity: the same for qwen3-moe-2.6b, whose optimised path is the compiled MoE block.
  PMODEL=llama3-1b-untied; [ "$PART" = moe-parity ] && PMODEL=qwen3-moe-2.6b
  T="python3 -m megaloom train model.preset=$PMODEL train.seq_len=4096 train.micro_batch_size=4
     train.global_batch_size=4 train.steps=${PARITY_STEPS:-200} train.lr=3e-4 train.min_lr=3e-5 train.warmup_steps=20
     train.log_every=10 train.eval_every=0 checkpoint.every=0 checkpoint.final=false run.tensorboard=false
     train.precision=bf16"
  export MEGALOOM_CACHE=/tmp/megaloom-cache
  # PARITY_SEEDS (default: the config's seed): a pair of runs per seed; with several, the seed-to-seed spread of
  # one path says how far apart two runs land by chance (bf16, nondeterministic kernels, MoE routing flips)
  for seed in ${PARITY_SEEDS:-default}; do
    S=""; [ "$seed" = default ] || S="train.seed=$seed"
    # shellcheck disable=SC2086
    timeout 220 $T run.dir=/tmp/parity-plain-$seed train.compile=false train.fused_loss=false train.attention=torch \
      train.bf16_residual=false $S \
      >> "$LOG" 2>&1; echo "plain seed $seed rc=$?"
    # shellcheck disable=SC2086
    timeout 220 $T run.dir=/tmp/parity-fast-$seed $S ${PARITY_FAST_EXTRA:-} >> "$LOG" 2>&1; echo "optimised seed $seed rc=$?"
    cp "/tmp/parity-plain-$seed/metrics.jsonl" "$OUT/${PART}_plain_$seed.jsonl"
    cp "/tmp/parity-fast-$seed/metrics.jsonl" "$OUT/${PART}_fast_$seed.jsonl"
  done
  grep "auto:" "$LOG" | tail -1
  python3 - "$OUT" "$PART" ${PARITY_SEEDS:-default} <<'PY'
import json, statistics, sys
out, part, *seeds = sys.argv[1:]
def tail(path):  # mean loss of the last 3 logged steps, and the last tokens/s
    rows = [json.loads(l) for l in open(path)]
    return sum(r["loss"] for r in rows[-3:]) / 3, rows[-1]["tokens_per_s"]
gaps, plains, fasts = [], [], []
for seed in seeds:
    (a, ta), (b, tb) = tail(f"{out}/{part}_plain_{seed}.jsonl"), tail(f"{out}/{part}_fast_{seed}.jsonl")
    gaps.append(100 * (b - a) / a); plains.append(a); fasts.append(b)
    print(f"seed {seed}: final loss plain {a:.4f} ({ta:,.0f} tok/s)  optimised {b:.4f} ({tb:,.0f} tok/s)  "
          f"gap {gaps[-1]:+.2f}%")
if len(seeds) > 1:
    pm, fm = statistics.mean(plains), statistics.mean(fasts)
    print(f"mean over seeds: plain {pm:.4f}  optimised {fm:.4f}  gap {100 * (fm - pm) / pm:+.2f}%; seed spread "
          f"plain {100 * (max(plains) - min(plains)) / pm:.2f}%, optimised {100 * (max(fasts) - min(fasts)) / fm:.2f}%")
PY
  if [ "$PART" = moe-parity ]; then :; else
  # the same step measured by bench_train.py in this call: what the training loop costs beyond TrainStep
  run loop_ref $BEST
  fi
else
  run best_bf16 $BEST --profile "$OUT/profile"
  grep -A12 "^kind" /tmp/run_best_bf16.log
  run best_fp8 $BEST --precision fp8
  run best_bf16_mb8 --micro-batch 8 --fused-loss --attention cudnn
  if [ -n "${FP8_MORE:-}" ]; then  # fp8 at micro-batch 8
    run best_fp8_mb8 --micro-batch 8 --fused-loss --attention cudnn --precision fp8
  fi
  if [ -n "${FP8_PROFILE:-}" ]; then profile_fp8 /tmp/profile_fp8; fi  # where an fp8 step's time goes (table in the log)
  if [ -d bench/.peer/.whl ]; then
    # a fresh folder: on a machine kept warm from an earlier call, summarize.py would also read that call's logs
    rm -rf /tmp/peer /tmp/peer.log
    OUT=/tmp/peer bash bench/.peer/run_peers.sh > /tmp/peer.log 2>&1
    if [ -n "${PEER_MB8:-}" ]; then titan_mb8; fi
    peer_collect "TorchTitan (bench/.peer/run_peers.sh)"
  fi
fi
