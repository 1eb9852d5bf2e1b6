#!/usr/bin/env bash
# Training time lost to a --save-every checkpoint, synchronous vs --async-save, on every GPU of
# the node (BENCHMARKS.md): the same run with no save, with blocking saves and with background saves
# at steps 4 and 8 of 11. Prints the seconds each save blocked training (the "saved"/"staged"
# log lines), the median step time, the slowest step after a save and the whole run's wall time.
# Usage: OUT=dir bash tools/gpu_save_times.sh [size]   (size: 1b or 8b; 8b wants 4 GPUs)
# MODES="sync async" skips the run without saves; LIMIT_S caps each run (default 300 s).
# At 8b a checkpoint is ~87 GB (fp32 weights and AdamW state), so only the newest is kept.
set -uo pipefail
OUT=${OUT:-gpu_logs}; mkdir -p "$OUT"
SIZE=${1:-1b}
MODES=${MODES:-none sync async}
LIMIT_S=${LIMIT_S:-300}
KEEP=$([ "$SIZE" = 8b ] && echo 1 || echo 3)
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
NGPU=$(nvidia-smi -L | grep -c GPU)
TR="python3 -m torch.distributed.run --standalone --nproc_per_node=$NGPU"
ARGS="--size $SIZE --arch baseline --meta-init --dataset random --tokenizer-vocab-size 32000 --seq-len 2048
      --micro-batch 2 --global-batch $((2 * NGPU)) --log-every 1 --eval-every 0 --eval-samples 8 --max-steps 11
      --no-save-final --overwrite --activation-checkpointing --keep-checkpoints $KEEP"
for mode in $MODES; do
    run=/tmp/save-$SIZE-$mode
    case $mode in none) extra="--save-every 0";; sync) extra="--save-every 4";; async) extra="--save-every 4 --async-save";; esac
    t0=$SECONDS
    # timeout's SIGTERM makes the trainer start its stop-save; -k 20 kills it if that outlasts 20 s
    timeout -k 20 "$LIMIT_S" $TR train_fsdp.py $ARGS $extra --out-dir $run > "$OUT/save_${SIZE}_$mode.log" 2>&1
    rc=$?
    if [[ $rc -ne 0 ]]; then
        what=$([[ $rc -eq 124 || $rc -eq 137 ]] && echo "TIMED OUT after $LIMIT_S s" || echo "FAILED (exit $rc)")
        echo "$SIZE $mode ($NGPU GPUs): $what; see $OUT/save_${SIZE}_$mode.log"
        rm -rf "$run"
        continue
    fi
    python3 - "$run" "$mode" "$SIZE" "$NGPU" "$((SECONDS - t0))" <<'PY'
import json, re, statistics, sys
run, mode, size, ngpu, wall = sys.argv[1:]
recs = [r for r in map(json.loads, open(f"{run}/metrics.jsonl")) if "loss" in r]
steps = {r["step"]: r["step_time_s"] for r in recs}
log = open(f"{run}/training_log.txt").read()
blocked = [float(x) for x in re.findall(r"(?:saved|staged) \S+ in ([0-9.]+) s", log)]
# An async save first waits for the previous background write (or, at the end, for the last).
waited = [float(x) for x in re.findall(r"waited ([0-9.]+) s for its end", log)]
after = [steps[s] for s in (5, 6, 9, 10) if s in steps]
print(f"{size} {mode} ({ngpu} GPUs): blocked {blocked} s; waited for a background write {waited} s; "
      f"median step {statistics.median(steps.values()):.3f} s; "
      f"slowest step after a save {max(after) if after else 0:.3f} s; run wall {wall} s")
PY
    rm -rf "$run"  # two checkpoints of a 1b run are 26 GB: three runs' would fill a 64 GB disk
done
