#!/usr/bin/env bash
# The Free Transformer against the baseline on text, on 2 GPUs at once (BENCHMARKS.md):
#   GPU 0: 6 x 384 Free Transformer on characters + the 1b Free Transformer on packed BPE text
#   GPU 1: the same two baselines
# then tools/ft_text_probe.py (what Z carries) on the character runs.
#   bash tools/ft_text_gpu.sh CORPUS.txt RUNS_DIR [CHAR_STEPS] [BIG_STEPS] [LIMIT_S]
# Logs, metrics and the probe's output end in RUNS_DIR/ft_text.tgz (the checkpoints stay out).
set -uo pipefail
CORPUS=$1; OUT=$2; CHAR_STEPS=${3:-5000}; BIG_STEPS=${4:-150}; LIMIT=${5:-3600}
mkdir -p "$OUT"
python -c "import bench; bench.build_corpus()"
CHAR=(--dataset "$CORPUS" --tokenizer-type char --tokenizer-vocab-size 256 --val-fraction 0.1 --cache-dir "$OUT/cache"
      --n-layer 6 --d-model 384 --n-head 6 --latent-bits 16 --seq-len 256 --global-batch 64 --dropout 0.2
      --lr 1e-3 --min-lr-ratio 0.1 --warmup-steps 100 --beta2 0.99 --strategy none --max-steps "$CHAR_STEPS"
      --eval-every 500 --eval-samples 100000 --log-every 100 --compile --overwrite)
BIG=(--dataset bench_data/corpus.txt --tokenizer-vocab-size 32000 --val-fraction 0.02 --cache-dir bench_data/cache
     --size 1b --meta-init --no-tie-embeddings --seq-len 2048 --micro-batch 8 --global-batch 16 --lr 3e-4
     --warmup-steps 30 --strategy fsdp --max-steps "$BIG_STEPS" --eval-every 50 --eval-samples 64 --log-every 10
     --compile --overwrite)
# Tokenise the BPE corpus once (both 1b runs then read the same cache).
python train_fsdp.py "${BIG[@]}" --size tiny --max-steps 1 --no-compile --no-meta-init --out-dir "$OUT/prep" >"$OUT/prep.log" 2>&1
for arch in free baseline; do
  gpu=$([ $arch = free ] && echo 0 || echo 1)
  CUDA_VISIBLE_DEVICES=$gpu timeout "$LIMIT" python train_fsdp.py "${CHAR[@]}" --arch $arch --out-dir "$OUT/char-$arch" \
      >"$OUT/char-$arch.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=$gpu timeout "$LIMIT" python train_fsdp.py "${BIG[@]}" --arch $arch --out-dir "$OUT/big-$arch" \
      >"$OUT/big-$arch.log" 2>&1 &
done
wait
python tools/ft_text_probe.py "$OUT/char-free" "$OUT/char-baseline" >"$OUT/probe.log" 2>&1
for r in char-free char-baseline big-free big-baseline; do
  echo "== $r"; grep -E "validation|error|Error" "$OUT/$r.log" | tail -4
done
cat "$OUT/probe.log"
(cd "$OUT" && tar czf ft_text.tgz ./*.log ./*/metrics.jsonl ./*/training_log.txt ./char-*/ft_text_* 2>/dev/null)
