#!/usr/bin/env bash
# --float8 against bf16 on one GPU (BENCHMARKS.md, issue 54). torchao must be importable (carried
# as a wheel where pip cannot reach the registry). Each NAME below is one benchmark:
#   bash tools/float8_gpu.sh RESULTS_DIR NAME [NAME ...]
#   speed    --size 1b under fsdp2, compiled, 12 x 4 rows of 2,048 a step (tools/speed_gpu.sh's 1b
#            flags): each of RUNS (default "bf16 tensorwise rowwise") in turn, measured by
#            tools/startup_bench.py (median after 4 steps).
#   quality  --size SIZE (1b; LAYERS=N keeps N blocks) on Python's own library as bytes, STEPS (300)
#            steps of GB (16) rows of 1,024, MB (8) a micro-batch, side by side on the GPU: each of
#            RUNS at each of SEEDS (default "7"), the validation losses (tools/first_result.py).
set -uo pipefail
R=$1; shift; mkdir -p "$R"; W=/tmp/float8; rm -rf $W; mkdir -p $W
export PYTHONUNBUFFERED=1
T="python train_fsdp.py"
ONE="--size 1b --arch baseline --meta-init --no-tie-embeddings --dataset random --tokenizer-vocab-size 32000 \
 --seq-len 2048 --micro-batch 12 --global-batch 48 --max-steps 14 --log-every 1 --eval-every 0 --eval-samples 8 \
 --no-save-final --warmup-steps 2 --lr 3e-4 --compile --overwrite --strategy fsdp2 --out-dir $W/a"
for name in "$@"; do
  case $name in
  speed)
    cmds=()
    for p in ${RUNS:-bf16 tensorwise rowwise}; do
      cmds+=("$p=$T $ONE $([ $p = bf16 ] || echo --float8 $p)")
    done
    python tools/startup_bench.py --skip 4 $R/speed.json "${cmds[@]}" ;;
  quality)
    find "$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')" -name '*.py' | sort \
      | xargs cat > $W/corpus.txt
    B="--dataset $W/corpus.txt --tokenizer-type char --tokenizer-vocab-size 256 --val-fraction 0.02 \
 --seq-len 1024 --cache-dir $W/data"
    python data.py $B
    RUN="$T $B --size ${SIZE:-1b} ${LAYERS:+--n-layer $LAYERS} --arch baseline --global-batch ${GB:-16} \
 --micro-batch ${MB:-8} --lr 3e-4 --warmup-steps 30 \
 --max-steps ${STEPS:-300} --eval-every 50 --eval-samples 256 --log-every 25 --no-save-final --compile --overwrite \
 --strategy none"
    for s in ${SEEDS:-7}; do
      for p in ${RUNS:-bf16 tensorwise rowwise}; do
        flag=$([ $p = bf16 ] || echo --float8 $p)
        python tools/first_result.py $R/quality-$p-seed$s.json \
          "$p seed $s=$RUN --seed $s $flag --out-dir $W/runs/$p$s" > $R/quality-$p-seed$s.log 2>&1 &
      done
    done
    wait; tail -n 8 $R/quality-*.log ;;
  *) echo "unknown benchmark: $name (speed, quality)"; exit 2 ;;
  esac 2>&1 | tee $R/$name.log
done
