#!/usr/bin/env bash
# The 8b shape at a realistic batch on every GPU of one host (BENCHMARKS.md, issue 54): 65,536 tokens
# a GPU a step (32 rows of 2,048 a GPU, by accumulation), compiled, meta-init, random tokens. Each
# NAME below is one run, measured by tools/startup_bench.py (median step and MFU after 2 steps):
#   bash tools/eight_b_gpu.sh RESULTS_DIR NAME [NAME ...]
#   fsdp2-m2 fsdp2-m4 fsdp-m4 fsdp2-m4-fwd fsdp2-m4-zero2 fsdp2-m8-ac2   the baseline (free-fsdp2-m4,
#   free-fsdp-m4: the Free Transformer) at micro-batch 2, 4 or 8; -fwd adds --forward-prefetch,
#   -zero2 SHARD_GRAD_OP (also fsdp-m4-zero2, free-fsdp2-m4-zero2, free-fsdp-m4-zero2), -ac2
#   checkpointing every 2nd block.
set -uo pipefail
R=$1; shift; mkdir -p "$R"; W=/tmp/eightb; rm -rf $W; mkdir -p $W
NGPU=$(nvidia-smi -L | grep -c GPU)
TR="python -m torch.distributed.run --standalone --nproc_per_node $NGPU train_fsdp.py"
B="--size 8b --meta-init --compile --dataset random --tokenizer-vocab-size 32000 --seq-len 2048 \
 --global-batch $((32 * NGPU)) --max-steps 5 --log-every 1 --eval-every 0 --eval-samples 8 --no-save-final \
 --warmup-steps 2 --lr 3e-4 --overwrite --out-dir $W/r"
for name in "$@"; do
  case $name in
  fsdp2-m2) flags="--arch baseline --strategy fsdp2 --micro-batch 2" ;;
  fsdp2-m4) flags="--arch baseline --strategy fsdp2 --micro-batch 4" ;;
  fsdp-m4) flags="--arch baseline --strategy fsdp --micro-batch 4" ;;
  fsdp2-m4-fwd) flags="--arch baseline --strategy fsdp2 --micro-batch 4 --forward-prefetch" ;;
  free-fsdp2-m4) flags="--arch free --strategy fsdp2 --micro-batch 4" ;;
  free-fsdp-m4) flags="--arch free --strategy fsdp --micro-batch 4" ;;
  fsdp2-m4-zero2) flags="--arch baseline --strategy fsdp2 --micro-batch 4 --sharding-strategy SHARD_GRAD_OP" ;;
  fsdp-m4-zero2) flags="--arch baseline --strategy fsdp --micro-batch 4 --sharding-strategy SHARD_GRAD_OP" ;;
  free-fsdp2-m4-zero2) flags="--arch free --strategy fsdp2 --micro-batch 4 --sharding-strategy SHARD_GRAD_OP" ;;
  free-fsdp-m4-zero2) flags="--arch free --strategy fsdp --micro-batch 4 --sharding-strategy SHARD_GRAD_OP" ;;
  fsdp2-m8-ac2) flags="--arch baseline --strategy fsdp2 --micro-batch 8 --activation-checkpointing --ac-every 2" ;;
  *) echo "unknown run: $name"; exit 2 ;;
  esac
  python tools/startup_bench.py --skip 2 "$R/$name.json" "$name=$TR $B $flags" 2>&1 | tee "$R/$name.log"
  grep -h "peak\|error" $W/r/training_log.txt 2>/dev/null | tail -2
done
