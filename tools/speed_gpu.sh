#!/usr/bin/env bash
# Issue 27 on 2 GPUs: start-up and step time of the 6 x 384 character model (tiny Shakespeare),
# whole-model against per-block compilation, cold and warm compile caches, per-block FSDP units
# against one unit, a minimal reference trainer on the same task (NANOGPT=dir, optional); the 1b
# step at micro-batch 12 under both compile scopes; then 2-GPU ddp / fsdp / fsdp2.
#   bash tools/speed_gpu.sh CORPUS.txt RESULTS_DIR [PART]
# PART 1 (default): the runs above. PART 2: after --auto-wrap auto and --compile-mode: start-up
# and step of none / default fsdp / fsdp2 with CUDA graphs or not against nanoGPT, and on 2 GPUs
# ddp against the default fsdp and fsdp2 (auto) and per-block units (module).
# PART 3 (one GPU): the 1b step's knobs (strategy, micro-batch, a sync every step or not) and a
# profile of it. PART 3s (one GPU): the small model's start-up, cold and warm, whole model
# against blocks, profiled. PART 4 (two GPUs): the rotary tables in and out of the compiled graph
# (BEFORE=a checkout of e5b055e), then the small model under ddp / fsdp / fsdp2 with and without
# CUDA graphs. PART 5 (four GPUs): the small model under ddp / fsdp / fsdp2 (the root its only
# unit, compiled whole; with --compile-scope blocks, each block as before), then each one's host
# time per step by part (tools/host_profile.py). PART 6 (one GPU): the 1b step at micro-batch 12
# and 16 with and without gradient accumulation (fsdp, fsdp2); the small model's start-up, cold and
# warm, with where it goes (tools/host_profile.py from the launch to the second step). Profiles go
# to RESULTS_DIR/traces*.txt (tools/trace_top.py). PART 7 (one GPU): the same start-ups with
# Python's bytecode cached, after a run that fills that cache (the lent machine's image has no
# .pyc files for its packages and sets PYTHONDONTWRITEBYTECODE, so every launch compiles them
# from source; a pip-installed PyTorch has them). PART 8 (one GPU; torchao importable): the 1b
# step in bf16 against float8 linear layers in the blocks (tools/float8_probe.py), fsdp2.
set -uo pipefail
CORPUS=$1; R=$2; PART=${3:-1}; mkdir -p "$R"; W=/tmp/speed; rm -rf $W; mkdir -p $W
SB="python tools/startup_bench.py"
SMALL="--dataset $CORPUS --tokenizer-type char --tokenizer-vocab-size 256 --val-fraction 0.1 --arch baseline \
 --n-layer 6 --d-model 384 --n-head 6 --seq-len 256 --global-batch 64 --dropout 0.2 --lr 1e-3 --beta2 0.99 \
 --warmup-steps 100 --max-steps 300 --eval-every 0 --eval-samples 64 --no-save-final --log-every 10 --compile --overwrite"
ONE="--size 1b --arch baseline --meta-init --no-tie-embeddings --dataset random --tokenizer-vocab-size 32000 \
 --seq-len 2048 --micro-batch 12 --global-batch 12 --max-steps 24 --log-every 1 --eval-every 0 --eval-samples 8 \
 --no-save-final --warmup-steps 2 --lr 3e-4 --compile --overwrite"
UNIT="--auto-wrap size --min-num-params 1000000000"
T="python train_fsdp.py"
NG="python train.py config/train_shakespeare_char.py --max_iters=300 --eval_iters=1 --log_interval=10"
RO="--compile-mode reduce-overhead"
TR="python -m torch.distributed.run --standalone --nproc_per_node 2 train_fsdp.py"
PROF="python tools/trace_top.py"
B="--compile-scope blocks"
# The small model's start-up under none and default fsdp, each cold (fresh compile caches) then
# warm (the same caches again): the four NAME=COMMAND entries of startup_bench.py, in COLD_WARM.
# $1: fsdp's data cache (dc1: the one none's runs fill; another: fsdp prepares the data again).
cold_warm() {
  local n="TORCHINDUCTOR_CACHE_DIR=$W/ind-n $T $SMALL --strategy none --cache-dir $W/dc1 --out-dir $W/p1"
  local f="TORCHINDUCTOR_CACHE_DIR=$W/ind-f $T $SMALL --cache-dir $W/$1 --out-dir $W/p2"
  COLD_WARM=("none cold=$n" "none warm=$n" "fsdp cold=$f" "fsdp warm=$f")
}
if [ "$PART" = 3 ]; then
  $SB --skip 8 $R/part3_1b.json \
    "1b fsdp mb12=$T $ONE $B --out-dir $W/a" \
    "1b fsdp mb12 log-every 8=$T $ONE $B --max-steps 40 --log-every 8 --out-dir $W/a" \
    "1b none mb12=$T $ONE $B --strategy none --out-dir $W/a" \
    "1b fsdp2 mb12=$T $ONE --strategy fsdp2 --out-dir $W/a" \
    "1b fsdp mb16=$T $ONE $B --micro-batch 16 --global-batch 16 --out-dir $W/a" \
    "1b fsdp mb12 profiled=$T $ONE $B --max-steps 6 --profile --out-dir $W/prof-1b" > $R/part3_1b.log 2>&1
  $PROF $W/prof-1b 20 > $R/traces.txt 2>&1
  python -c "import bench; print(f'GEMM {bench.gemm_tflops():.0f} TFLOP/s')" >> $R/part3_1b.log
  cat $R/part3_1b.log
  exit 0
fi
if [ "$PART" = 3s ]; then
  cold_warm dc3
  $SB $R/part3_small.json \
    "nanoGPT compile=cd ${NANOGPT:-.} && TORCHINDUCTOR_CACHE_DIR=$W/ind-ng $NG --out_dir=$W/ng" \
    "${COLD_WARM[@]}" \
    "fsdp blocks cold=TORCHINDUCTOR_CACHE_DIR=$W/ind-fb $T $SMALL $B --cache-dir $W/dc4 --out-dir $W/p2" \
    "fsdp blocks warm=TORCHINDUCTOR_CACHE_DIR=$W/ind-fb $T $SMALL $B --cache-dir $W/dc4 --out-dir $W/p2" \
    "none profiled=$T $SMALL --strategy none --max-steps 6 --profile --cache-dir $W/dc1 --out-dir $W/prof-n" \
    "fsdp profiled=$T $SMALL --max-steps 6 --profile --cache-dir $W/dc1 --out-dir $W/prof-f" > $R/part3_small.log 2>&1
  for d in prof-n prof-f; do $PROF $W/$d 20 >> $R/traces_small.txt 2>&1; done
  cat $R/part3_small.log
  exit 0
fi
if [ "$PART" = 4 ]; then
  # One GPU each, side by side: the rotary tables inside the compiled graph (BEFORE=a checkout
  # of e5b055e) and outside it; the default fsdp path against nanoGPT.
  (cd ${BEFORE:-.} && CUDA_VISIBLE_DEVICES=0 python $OLDPWD/tools/startup_bench.py $R/part4_rope.json \
    "none rope in graph=$T $SMALL --strategy none --cache-dir $W/dc0 --out-dir $W/r0" \
    "fsdp rope in graph=$T $SMALL --cache-dir $W/dc0 --out-dir $W/r0" > $R/part4_rope.log 2>&1) &
  CUDA_VISIBLE_DEVICES=1 $SB $R/part4_one.json \
    "nanoGPT compile=cd ${NANOGPT:-.} && $NG --out_dir=$W/ng" \
    "none=$T $SMALL --strategy none --cache-dir $W/dc1 --out-dir $W/r1" \
    "fsdp=$T $SMALL --cache-dir $W/dc1 --out-dir $W/r1" > $R/part4_one.log 2>&1
  wait
  cat $R/part4_rope.log $R/part4_one.log
  $SB $R/part4.json \
    "2gpu ddp=$TR $SMALL --strategy ddp --cache-dir $W/dc1 --out-dir $W/t" \
    "2gpu fsdp=$TR $SMALL --cache-dir $W/dc1 --out-dir $W/t" \
    "2gpu fsdp graphs=$TR $SMALL $RO --cache-dir $W/dc1 --out-dir $W/t" \
    "2gpu fsdp2=$TR $SMALL --strategy fsdp2 --cache-dir $W/dc1 --out-dir $W/t" \
    "2gpu fsdp2 graphs=$TR $SMALL --strategy fsdp2 $RO --cache-dir $W/dc1 --out-dir $W/t" > $R/part4.log 2>&1
  cat $R/part4.log
  exit 0
fi
if [ "$PART" = 5 ]; then
  T4="python -m torch.distributed.run --standalone --nproc_per_node 4"
  $SB $R/part5.json \
    "4gpu ddp=$T4 train_fsdp.py $SMALL --strategy ddp --cache-dir $W/dc1 --out-dir $W/t" \
    "4gpu fsdp=$T4 train_fsdp.py $SMALL --cache-dir $W/dc1 --out-dir $W/t" \
    "4gpu fsdp2=$T4 train_fsdp.py $SMALL --strategy fsdp2 --cache-dir $W/dc1 --out-dir $W/t" \
    "4gpu fsdp2 blocks=$T4 train_fsdp.py $SMALL --strategy fsdp2 $B --cache-dir $W/dc1 --out-dir $W/t" > $R/part5.log 2>&1
  cat $R/part5.log
  for s in ddp fsdp fsdp2; do
    $T4 tools/host_profile.py --steps 100:250 -- train_fsdp.py $SMALL --strategy $s --cache-dir $W/dc1 \
      --out-dir $W/h 2>&1 | sed -n '/^host_profile/,$p' >> $R/host_profile.txt
  done
  cat $R/host_profile.txt
  exit 0
fi
if [ "$PART" = 6 ]; then
  A4="--max-steps 14 --global-batch 48"
  $SB --skip 4 $R/part6_1b.json \
    "1b fsdp mb12=$T $ONE $B --max-steps 20 --out-dir $W/a" \
    "1b fsdp mb12 accum 4=$T $ONE $B $A4 --out-dir $W/a" \
    "1b fsdp2 mb12 accum 4=$T $ONE --strategy fsdp2 $A4 --out-dir $W/a" \
    "1b fsdp mb16 accum 3=$T $ONE $B $A4 --micro-batch 16 --out-dir $W/a" \
    "1b fsdp2 mb16 accum 3=$T $ONE --strategy fsdp2 $A4 --micro-batch 16 --out-dir $W/a" > $R/part6_1b.log 2>&1
  python -c "import bench; print(f'GEMM {bench.gemm_tflops():.0f} TFLOP/s')" >> $R/part6_1b.log
  cat $R/part6_1b.log
  ( time python -c "import torch; torch.zeros(1, device='cuda')" ) > $R/part6_startup.log 2>&1
  cold_warm dc3
  $SB $R/part6_small.json \
    "${COLD_WARM[@]}" >> $R/part6_startup.log 2>&1
  for s in none:n fsdp:f; do  # warm: the caches of the runs above
    TORCHINDUCTOR_CACHE_DIR=$W/ind-${s#*:} python tools/host_profile.py --steps 0:2 --top 60 -- train_fsdp.py \
      $SMALL --strategy ${s%:*} --cache-dir $W/dc1 --out-dir $W/h 2>&1 | sed -n '/^host_profile/,$p' >> $R/startup_profile.txt
  done
  cat $R/part6_startup.log
  exit 0
fi
if [ "$PART" = 7 ]; then
  python -c 'import sys, os, torch; d = os.path.dirname(torch.__file__); print(sys.version.split()[0], "dont_write_bytecode",
    sys.flags.dont_write_bytecode, "torch dir writable", os.access(d, os.W_OK), "__pycache__", os.path.isdir(d + "/__pycache__"))'
  for i in 1 2; do /usr/bin/time -f "%e s: import train_fsdp" python -c "import train_fsdp"; done
  unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=$W/pyc
  for i in 1 2; do /usr/bin/time -f "%e s: import train_fsdp, bytecode cached" python -c "import train_fsdp"; done
  TORCHINDUCTOR_CACHE_DIR=$W/ind-0 $T $SMALL --strategy none --max-steps 12 --cache-dir $W/dc1 --out-dir $W/p0 > /dev/null 2>&1
  cold_warm dc1
  $SB $R/part7_small.json \
    "${COLD_WARM[@]}" > $R/part7.log 2>&1
  cat $R/part7.log
  exit 0
fi
if [ "$PART" = 8 ]; then
  F8="$ONE --strategy fsdp2 --max-steps 16"
  $SB --skip 4 $R/part8.json "1b fsdp2 bf16=$T $F8 --out-dir $W/bf16" \
    "1b fsdp2 float8=python tools/float8_probe.py train_fsdp.py $F8 --out-dir $W/f8" > $R/part8.log 2>&1
  for d in bf16 f8; do tail -n 2 $W/$d/metrics.jsonl >> $R/part8.log; done
  cat $R/part8.log
  exit 0
fi
if [ "$PART" = 2 ]; then
  (export CUDA_VISIBLE_DEVICES=1; $SB $R/part2_gpu1.json \
    "fsdp module=$T $SMALL --auto-wrap module --cache-dir $W/dc3 --out-dir $W/p3" \
    "fsdp2 auto=$T $SMALL --strategy fsdp2 --cache-dir $W/dc3 --out-dir $W/p3" \
    "fsdp2 auto reduce-overhead=$T $SMALL --strategy fsdp2 $RO --cache-dir $W/dc3 --out-dir $W/p3" \
    > $R/part2_gpu1.log 2>&1) &
  CUDA_VISIBLE_DEVICES=0 $SB $R/part2_gpu0.json \
    "nanoGPT compile=cd ${NANOGPT:-.} && TORCHINDUCTOR_CACHE_DIR=$W/ind-ng $NG --out_dir=$W/ng" \
    "none cold=TORCHINDUCTOR_CACHE_DIR=$W/ind-n $T $SMALL --strategy none --cache-dir $W/dc1 --out-dir $W/p1" \
    "none warm=TORCHINDUCTOR_CACHE_DIR=$W/ind-n $T $SMALL --strategy none --cache-dir $W/dc1 --out-dir $W/p1" \
    "none reduce-overhead=TORCHINDUCTOR_CACHE_DIR=$W/ind-r $T $SMALL --strategy none $RO --cache-dir $W/dc1 --out-dir $W/p1" \
    "fsdp auto=$T $SMALL --cache-dir $W/dc1 --out-dir $W/p2" \
    "fsdp auto reduce-overhead=$T $SMALL $RO --cache-dir $W/dc1 --out-dir $W/p2" > $R/part2_gpu0.log 2>&1
  wait
  $SB $R/part2_2gpu.json \
    "2gpu ddp=$TR $SMALL --strategy ddp --cache-dir $W/dc1 --out-dir $W/t" \
    "2gpu ddp reduce-overhead=$TR $SMALL --strategy ddp $RO --cache-dir $W/dc1 --out-dir $W/t" \
    "2gpu fsdp auto=$TR $SMALL --cache-dir $W/dc1 --out-dir $W/t" \
    "2gpu fsdp2 auto=$TR $SMALL --strategy fsdp2 --cache-dir $W/dc1 --out-dir $W/t" \
    "2gpu fsdp module=$TR $SMALL --auto-wrap module --cache-dir $W/dc1 --out-dir $W/t" > $R/part2_2gpu.log 2>&1
  cat $R/part2_*.log
  exit 0
fi
# GPU 1: the 1b step under both scopes (fsdp, one GPU), in the background.
(export CUDA_VISIBLE_DEVICES=1; $SB --skip 8 $R/onegpu_1b.json \
   "1b fsdp compile model=$T $ONE --out-dir $W/1b-m" "1b fsdp compile blocks=$T $ONE --compile-scope blocks --out-dir $W/1b-b" \
   "1b fsdp2 compile=$T $ONE --strategy fsdp2 --out-dir $W/1b-f2" > $R/onegpu_1b.log 2>&1) &
# GPU 0: the small model. cold = fresh inductor and data caches; warm = the same ones again.
export CUDA_VISIBLE_DEVICES=0
ref=()
if [ -n "${NANOGPT:-}" ]; then
  ref=("nanoGPT compile=cd ${NANOGPT:-.} && TORCHINDUCTOR_CACHE_DIR=$W/ind-ng $NG --out_dir=$W/ng")
fi
$SB $R/onegpu_small.json "${ref[@]}" \
  "none model cold=TORCHINDUCTOR_CACHE_DIR=$W/ind-m $T $SMALL --strategy none --cache-dir $W/dc1 --out-dir $W/s1" \
  "none model warm=TORCHINDUCTOR_CACHE_DIR=$W/ind-m $T $SMALL --strategy none --cache-dir $W/dc1 --out-dir $W/s1" \
  "none blocks cold=TORCHINDUCTOR_CACHE_DIR=$W/ind-b $T $SMALL --strategy none --compile-scope blocks --cache-dir $W/dc2 --out-dir $W/s2" \
  "none blocks warm=TORCHINDUCTOR_CACHE_DIR=$W/ind-b $T $SMALL --strategy none --compile-scope blocks --cache-dir $W/dc2 --out-dir $W/s2" \
  "fsdp units model=$T $SMALL --cache-dir $W/dc1 --out-dir $W/s3" \
  "fsdp units blocks=$T $SMALL --compile-scope blocks --cache-dir $W/dc1 --out-dir $W/s3" \
  "fsdp one-unit model=$T $SMALL $UNIT --cache-dir $W/dc1 --out-dir $W/s3" \
  "fsdp one-unit blocks=$T $SMALL $UNIT --compile-scope blocks --cache-dir $W/dc1 --out-dir $W/s3" \
  "fsdp2 units=$T $SMALL --strategy fsdp2 --cache-dir $W/dc1 --out-dir $W/s3" \
  "fsdp2 one-unit=$T $SMALL --strategy fsdp2 $UNIT --cache-dir $W/dc1 --out-dir $W/s3" > $R/onegpu_small.log 2>&1
wait
# Both GPUs: the small model over 2 processes.
unset CUDA_VISIBLE_DEVICES
$SB $R/twogpu_small.json \
  "2gpu ddp model=$TR $SMALL --strategy ddp --cache-dir $W/dc1 --out-dir $W/t" \
  "2gpu fsdp units model=$TR $SMALL --cache-dir $W/dc1 --out-dir $W/t" \
  "2gpu fsdp units blocks=$TR $SMALL --compile-scope blocks --cache-dir $W/dc1 --out-dir $W/t" \
  "2gpu fsdp one-unit blocks=$TR $SMALL $UNIT --compile-scope blocks --cache-dir $W/dc1 --out-dir $W/t" \
  "2gpu fsdp2 units=$TR $SMALL --strategy fsdp2 --cache-dir $W/dc1 --out-dir $W/t" \
  "2gpu fsdp2 one-unit=$TR $SMALL --strategy fsdp2 $UNIT --cache-dir $W/dc1 --out-dir $W/t" > $R/twogpu_small.log 2>&1
cat $R/onegpu_small.log $R/onegpu_1b.log $R/twogpu_small.log
