#!/usr/bin/env bash
# GPU checks that CPU CI cannot run: make train-free-fsdp on every GPU, the GPU-only FSDP knobs
# (cpu_offload under FSDP1 and FSDP2, sync_module_states, fp16 with its grad scaler, compile) and
# a few steps of the 1b model of both architectures. Each run's exit code and last lines.
#   OUT=dir bash tools/gpu_smoke.sh       (logs go to $OUT, default ./gpu_logs)
set -uo pipefail
OUT=${OUT:-gpu_logs}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
NGPU=$(nvidia-smi -L | grep -c GPU)
TR="python3 -m torch.distributed.run --standalone --nproc_per_node=$NGPU"
nvidia-smi -L | tee "$OUT/gpus.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/gpus.txt"
summary() { tr '\r' '\n' < "$1" | grep -E "^(world|strategy|parameters|batch|step .*(tok/s|validation)|final|error)" | tail -${2:-6}; }
run() {  # name, args...
    local name=$1; shift
    echo "=== $name: $*"
    timeout 600 "$@" > "$OUT/$name.log" 2>&1; echo "exit $?" >> "$OUT/$name.log"
    summary "$OUT/$name.log"; tail -1 "$OUT/$name.log"
}
TINY="--size tiny --latent-bits 8 --max-steps 30 --log-every 10 --eval-every 0 --eval-samples 64"
run make_free make train-free-fsdp RUN=runs/make-free
run offload   $TR train_fsdp.py $TINY --cpu-offload --out-dir runs/offload
run offload2  $TR train_fsdp.py $TINY --strategy fsdp2 --cpu-offload --out-dir runs/offload2
run fp16_2    $TR train_fsdp.py $TINY --strategy fsdp2 --param-dtype fp16 --reduce-dtype fp16 --out-dir runs/fp16_2
run syncstate $TR train_fsdp.py $TINY --sync-module-states --out-dir runs/syncstate
run fp16      $TR train_fsdp.py $TINY --param-dtype fp16 --reduce-dtype fp16 --out-dir runs/fp16
run compile   $TR train_fsdp.py $TINY --compile --out-dir runs/compile
ONEB="--size 1b --arch baseline --dataset synthetic --max-steps 12 --log-every 4 --eval-every 0 --eval-samples 64 --global-batch 32 --micro-batch 8"
run b1_full   $TR train_fsdp.py $ONEB --out-dir runs/b1 --save-every 0
run f1_full   $TR train_fsdp.py $ONEB --arch free --out-dir runs/f1
