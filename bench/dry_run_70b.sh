#!/bin/bash
# llama3-70b at tp 8 x pp 8 x dp 16 = 1,024 ranks, on one CPU machine (no GPU, no other process): the process
# groups' construction time by world size, then rank 0 and the first rank of the last pipeline stage built and
# stepped for real on the fake process group (`megaloom train --dry-run`), each in a process of its own.
#   bash bench/dry_run_70b.sh            # OUT=/tmp/megaloom-dryrun-70b; MEM_GB=16 (memory budget); STEPS=1
# A 70B shard of 1/64 is ~1.2B parameters: 4.8 GB of fp32 weights, as much of gradients, twice that of AdamW state
# and as much again of foreach-AdamW temporaries: ~24 GB with updates. Under a 16 GB budget the dry run runs the
# steps without the optimizer update (forward, backward, gradient reduction and clipping) and says so.
# parallel.zero=0: ZeRO with pp > 1 is refused today. Sequence 256 with vpp 2 (interleaved, 8 micro-batches:
# the schedule needs a multiple of pp): at 512 the first stages' activations would pass the budget.
set -u
OUT=${OUT:-/tmp/megaloom-dryrun-70b}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
MODEL="model.preset=llama3-70b parallel.tp=8 parallel.pp=8 parallel.vpp=2 parallel.schedule=interleaved"
MODEL="$MODEL parallel.zero=0 train.seq_len=${SEQ:-256} train.micro_batch_size=1 train.global_batch_size=128"
python3 bench/bench_dry_run.py mesh --worlds 64 256 1024 4096 --json "$OUT/mesh.json" model.preset=llama3-70b \
  parallel.tp=8 parallel.pp=8 train.micro_batch_size=1 2>&1 | tee "$OUT/mesh.log"
for RANK in 0 last-stage; do
  # shellcheck disable=SC2086
  python3 -m megaloom train --dry-run --world 1024 --rank "$RANK" --dry-run-steps "${STEPS:-1}" \
    --dry-run-memory-gb "${MEM_GB:-16}" --dry-run-json "$OUT/rank-$RANK.json" $MODEL > "$OUT/rank-$RANK.log" 2>&1
  echo "rank $RANK: exit $?"
  sed -n '/^megaloom dry run/,$p' "$OUT/rank-$RANK.log"
done
