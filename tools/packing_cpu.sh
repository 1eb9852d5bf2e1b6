#!/usr/bin/env bash
# Packed (--document-mask) against padded instruction rows, at equal steps, on the CPU: a baseline
# --size tiny trained from scratch to reverse words ("reverse abc:" -> " cba"), 20,000 training and
# 500 validation examples, rows of 256 tokens, 16 a step, 300 steps, seeds 1 and 2. The validation
# loss is over the same 500 answers either way. Usage: bash tools/packing_cpu.sh OUT
set -euo pipefail
OUT=${1:?usage: bash tools/packing_cpu.sh OUT}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT" && cd "$OUT"
python3 - <<'PY'
import json, random
rng = random.Random(0)
def word(): return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 12)))
def rows(n): return [{"prompt": f"reverse {w}:", "completion": " " + w[::-1]} for w in (word() for _ in range(n))]
for name, n in (("train", 20000), ("val", 500)):
    with open(f"{name}.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows(n))
with open("letters.txt", "w") as f:  # the character tokenizer's corpus
    f.writelines(r["prompt"] + r["completion"] + "\n" for r in rows(2000))
PY
python3 "$ROOT/data.py" --dataset letters.txt --tokenizer-type char --tokenizer-vocab-size 64 \
  --seq-len 32 --cache-dir cache
TOK=$(ls cache/letters-*/tokenizer.model)
for seed in 1 2; do
  for layout in packed padded; do
    extra=""; [ "$layout" = packed ] && extra="--document-mask"
    python3 "$ROOT/train_fsdp.py" --strategy none --arch baseline --size tiny --dataset train.jsonl \
      --val-path val.jsonl --instruct --tokenizer "$TOK" --seq-len 256 --global-batch 16 \
      --max-steps 300 --lr 3e-3 --warmup-steps 30 --eval-every 100 --eval-samples 512 \
      --param-dtype fp32 --seed "$seed" --cache-dir cache --out-dir "runs/$layout-$seed" \
      --overwrite --log-every 100 $extra > "log-$layout-$seed.txt" 2>&1
    echo "$layout, seed $seed: $(grep -h '| validation' "log-$layout-$seed.txt" | sed 's/ | [0-9.]* s$//' | tr '\n' ' ')"
  done
done
