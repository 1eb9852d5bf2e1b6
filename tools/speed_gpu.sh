#!/usr/bin/env bash
# Step time and start-up of the trainer on GPUs (BENCHMARKS.md, docs/performance.md), one
# benchmark per name:
#   bash tools/speed_gpu.sh CORPUS.txt RESULTS_DIR NAME [NAME ...]
#   small-1gpu    the 6 x 384 character model (tiny Shakespeare) on one GPU, 300 steps: `none` and
#                 the default `fsdp`, each with fresh compile caches (cold) then the same again
#                 (warm), against a minimal reference trainer on the same task when NANOGPT names a
#                 nanoGPT checkout whose data/shakespeare_char holds its prepared CORPUS.
#   small-gpus    the same model on every GPU: ddp, fsdp, fsdp2 (compiled whole) and fsdp2 with
#                 --compile-scope blocks; then each one's host time per step (tools/host_profile.py).
#   1b            the 1b baseline on one GPU, compiled: micro-batch 12 and 16, then a global
#                 batch of 48 rows by gradient accumulation (12 x 4, 16 x 3) under fsdp and fsdp2;
#                 ends with the card's measured bf16 GEMM rate.
#   1b-scopes     start-up and step of the 1b model at micro-batch 12, the whole model compiled
#                 against --compile-scope blocks (each block compiled once, reused by every layer).
#   1b-profile    one profiled 1b step at micro-batch 12, read by tools/trace_top.py.
#   first-result  launch to validation <= 1.50 / 1.47 on nanoGPT's Shakespeare recipe (5,000 steps,
#                 evaluated every 250 on 512 rows; tools/first_result.py): `none` and `fsdp` with
#                 fresh compile caches (cold), then a second launch into a new run directory beside
#                 the first (warm, 1,000 steps of the same schedule); nanoGPT cold and warm (1,500 iters
#                 of its schedule) when NANOGPT names its checkout; then `none` with --compile-scope
#                 blocks and without --compile, cold.
#   first-result-more  the same, 1,000 steps, cold: `none` and `fsdp` with --seed 2, `none` with
#                 --compile-mode default, `fsdp` with --compile-scope blocks.
#   1b-restart    the 1b model's launch to its first step, fresh (cold compile cache) against a resume
#                 of it under another TMPDIR, as a requeue to another node (the start-up line's phases).
# Step: the median of the logged per-step times after the first steps; start-up: launch to the
# end of the first step (tools/startup_bench.py). Python's bytecode is cached first (a lent image
# without .pyc files that sets PYTHONDONTWRITEBYTECODE compiles PyTorch's sources every launch).
# Each benchmark prints its table and writes RESULTS_DIR/NAME.log and NAME.json.
set -uo pipefail
CORPUS=$1; R=$2; shift 2; mkdir -p "$R"; W=/tmp/speed; rm -rf $W; mkdir -p $W
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=$W/pyc PYTHONUNBUFFERED=1
SB="python tools/startup_bench.py"
T="python train_fsdp.py"
TR="python -m torch.distributed.run --standalone --nproc_per_node $(nvidia-smi -L | grep -c GPU)"
SMALL="--dataset $CORPUS --tokenizer-type char --tokenizer-vocab-size 256 --val-fraction 0.1 --arch baseline \
 --n-layer 6 --d-model 384 --n-head 6 --seq-len 256 --global-batch 64 --dropout 0.2 --lr 1e-3 --beta2 0.99 \
 --warmup-steps 100 --max-steps 300 --eval-every 0 --eval-samples 64 --no-save-final --log-every 10 --compile --overwrite"
ONE="--size 1b --arch baseline --meta-init --no-tie-embeddings --dataset random --tokenizer-vocab-size 32000 \
 --seq-len 2048 --micro-batch 12 --global-batch 12 --max-steps 20 --log-every 1 --eval-every 0 --eval-samples 8 \
 --no-save-final --warmup-steps 2 --lr 3e-4 --compile --overwrite"
B="--compile-scope blocks"
NG="python train.py config/train_shakespeare_char.py --max_iters=300 --eval_iters=1 --log_interval=10"
NGF="python train.py config/train_shakespeare_char.py --compile=True --max_iters=1500"
gemm() { python -c "import bench; print(f'GEMM {bench.gemm_tflops():.0f} TFLOP/s')"; }
# Fill the bytecode cache and the data cache once, so that "cold" means fresh compile caches only.
$T $SMALL --strategy none --max-steps 12 --cache-dir $W/data --out-dir $W/prime > $W/prime.log 2>&1

for name in "$@"; do
  case $name in
  small-1gpu)
    ref=()
    [ -n "${NANOGPT:-}" ] && ref=("nanoGPT=cd $NANOGPT && TORCHINDUCTOR_CACHE_DIR=$W/ind-ng $NG --out_dir=$W/ng")
    n="$T $SMALL --strategy none --cache-dir $W/data --out-dir $W/n"
    f="$T $SMALL --cache-dir $W/data --out-dir $W/f"
    $SB $R/$name.json "${ref[@]}" \
      "none cold=TORCHINDUCTOR_CACHE_DIR=$W/ind-n $n" "none warm=TORCHINDUCTOR_CACHE_DIR=$W/ind-n $n" \
      "fsdp cold=TORCHINDUCTOR_CACHE_DIR=$W/ind-f $f" "fsdp warm=TORCHINDUCTOR_CACHE_DIR=$W/ind-f $f" ;;
  small-gpus)
    $SB $R/$name.json \
      "ddp=$TR train_fsdp.py $SMALL --strategy ddp --cache-dir $W/data --out-dir $W/t" \
      "fsdp=$TR train_fsdp.py $SMALL --cache-dir $W/data --out-dir $W/t" \
      "fsdp2=$TR train_fsdp.py $SMALL --strategy fsdp2 --cache-dir $W/data --out-dir $W/t" \
      "fsdp2 blocks=$TR train_fsdp.py $SMALL --strategy fsdp2 $B --cache-dir $W/data --out-dir $W/t"
    for s in ddp fsdp fsdp2; do
      $TR tools/host_profile.py --steps 100:250 -- train_fsdp.py $SMALL --strategy $s --cache-dir $W/data \
        --out-dir $W/h 2>&1 | sed -n '/^host_profile/,$p'
    done ;;
  1b)
    A="--max-steps 14 --global-batch 48"
    $SB --skip 4 $R/$name.json \
      "fsdp mb12=$T $ONE $B --out-dir $W/a" \
      "fsdp mb16=$T $ONE $B --micro-batch 16 --global-batch 16 --out-dir $W/a" \
      "fsdp mb12 x 4=$T $ONE $B $A --out-dir $W/a" \
      "fsdp mb16 x 3=$T $ONE $B $A --micro-batch 16 --out-dir $W/a" \
      "fsdp2 mb12 x 4=$T $ONE --strategy fsdp2 $A --out-dir $W/a" \
      "fsdp2 mb16 x 3=$T $ONE --strategy fsdp2 $A --micro-batch 16 --out-dir $W/a"
    gemm ;;
  1b-scopes)
    $SB --skip 8 $R/$name.json "whole model=$T $ONE --max-steps 24 --out-dir $W/a" \
      "blocks=$T $ONE $B --max-steps 24 --out-dir $W/a" ;;
  first-result)
    FR="$SMALL --max-steps 5000 --eval-every 250 --eval-samples 512 --log-every 50 --cache-dir $W/data"
    K="--max-steps 1000 --lr-decay-steps 5000"
    ng=()
    [ -n "${NANOGPT:-}" ] && ng=("nanoGPT cold=cd $NANOGPT && TORCHINDUCTOR_CACHE_DIR=$W/ng-ind $NGF --out_dir=$W/ng")
    python tools/first_result.py $R/$name.json "${ng[@]}" \
      "none cold=$T $FR --strategy none --out-dir $W/n/a" "none warm=$T $FR $K --strategy none --out-dir $W/n/b" \
      "fsdp cold=$T $FR --out-dir $W/f/a" "fsdp warm=$T $FR $K --out-dir $W/f/b" \
      ${ng:+"nanoGPT warm=cd $NANOGPT && TORCHINDUCTOR_CACHE_DIR=$W/ng-ind $NGF --out_dir=$W/ng"} \
      "none blocks cold=$T $FR $K --strategy none $B --out-dir $W/nb/a" \
      "none eager=$T ${FR/--compile/} $K --strategy none --out-dir $W/ne/a" ;;
  first-result-more)
    FR="$SMALL --max-steps 1000 --lr-decay-steps 5000 --eval-every 250 --eval-samples 512 --log-every 50 \
      --cache-dir $W/data"
    python tools/first_result.py $R/$name.json "none cold seed 2=$T $FR --seed 2 --strategy none --out-dir $W/a/r" \
      "fsdp cold seed 2=$T $FR --seed 2 --out-dir $W/b/r" \
      "none cold mode default=$T $FR --strategy none --compile-mode default --out-dir $W/c/r" \
      "fsdp blocks cold=$T $FR $B --out-dir $W/d/r" ;;
  1b-restart)
    $T $ONE $B --max-steps 2 --save-final --out-dir $W/r/a > $W/r1.log 2>&1; grep -a "start-up\|error" $W/r1.log
    mkdir -p $W/tmp2; TMPDIR=$W/tmp2 $T $ONE $B --max-steps 4 --save-final --out-dir $W/r/a > $W/r2.log 2>&1
    grep -a "start-up\|error\|resum" $W/r2.log ;;
  1b-profile)
    $T $ONE $B --max-steps 6 --profile --out-dir $W/prof > $W/prof.log 2>&1 || tail -n 5 $W/prof.log
    python tools/trace_top.py $W/prof 20 ;;
  *) echo "unknown benchmark: $name (small-1gpu, small-gpus, 1b, 1b-scopes, 1b-profile, first-result, first-result-more,"
     echo "  1b-restart)"
     exit 2 ;;
  esac 2>&1 | tee $R/$name.log
done
