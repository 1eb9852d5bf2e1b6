#!/usr/bin/env bash
# Gradient accumulation under fsdp2: --grad-accum-mode sync against no_sync on one GPU (BENCHMARKS.md,
# the choice of the default):
#   bash tools/accum_gpu.sh RESULTS_DIR
# The 1b baseline under fsdp2 on one process, 4 micro-batches of MB (4) rows of 2,048 a step:
#   speed    compiled, each mode in turn: step time (tools/startup_bench.py) and peak memory.
#   offload  the same with --cpu-offload, eager: the sharded gradients live on the host, so the
#            GPU memory no_sync adds is the unsharded gradient it accumulates there (every rank's
#            cost at any world size; without offload, one process's sharded gradient is as large).
# Prints a table of step time and peak GPU memory (metrics.jsonl's mem_peak_gib) per run.
set -uo pipefail
R=$1; mkdir -p "$R"; W=/tmp/accum; rm -rf $W; mkdir -p $W
export PYTHONUNBUFFERED=1
MB=${MB:-4}
ONE="python train_fsdp.py --size 1b --arch baseline --meta-init --no-tie-embeddings --dataset random \
 --tokenizer-vocab-size 32000 --seq-len 2048 --micro-batch $MB --global-batch $((4 * MB)) --log-every 1 \
 --eval-every 0 --eval-samples 8 --no-save-final --warmup-steps 2 --lr 3e-4 --overwrite --strategy fsdp2"
cmds=()
for mode in sync no_sync; do
  cmds+=("speed-$mode=$ONE --compile --max-steps 14 --grad-accum-mode $mode --out-dir $W/speed-$mode")
  cmds+=("offload-$mode=$ONE --cpu-offload --max-steps 5 --grad-accum-mode $mode --out-dir $W/offload-$mode")
done
python tools/startup_bench.py --skip 3 $R/accum.json "${cmds[@]}" 2>&1 | tee $R/accum.log
python - $W $R/accum.json <<'PY' | tee -a $R/accum.log
import json, os, sys
runs = json.load(open(sys.argv[2]))
for name, r in runs.items():
    recs = [json.loads(l) for l in open(os.path.join(sys.argv[1], name, "metrics.jsonl")) if '"mem_peak_gib"' in l]
    peak = max(x["mem_peak_gib"] for x in recs) if recs else float("nan")
    print(f"{name:20s} step {r['step_ms'] or float('nan'):8.1f} ms  peak {peak:6.2f} GiB  rc {r['rc']}")
PY
