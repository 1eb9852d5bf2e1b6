#!/usr/bin/env bash
# LoRA against a full fine-tune at equal steps, on the CPU (docs/fine-tuning.md): a baseline --size tiny
# pretrained here to copy words ("copy abc:" -> " abc", 600 steps), its consolidated model.pt the base;
# then each seed fine-tunes it to reverse them ("reverse abc:" -> " cba"), 20,000 training and 500
# validation examples, packed rows of 256 tokens, 16 a step, STEPS steps: a full fine-tune at each rate
# of FULL_LR and LoRA rank 8 on every projection at each of LORA_LR. The validation loss is over the 500
# reversed answers.
# Usage: OMP_NUM_THREADS=2 bash tools/lora_cpu.sh OUT   (SEEDS="1 2 3" STEPS=300 FULL_LR=1e-3 LORA_LR=1e-2;
# the runs of all seeds and rates at once, OMP_NUM_THREADS each; BASE_THREADS for the pretraining)
set -euo pipefail
OUT=${1:?usage: bash tools/lora_cpu.sh OUT}
SEEDS=${SEEDS:-"1 2 3"} STEPS=${STEPS:-300} FULL_LR=${FULL_LR:-1e-3} LORA_LR=${LORA_LR:-1e-2}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT" && cd "$OUT"
python3 - <<'PY'
import json, random
rng = random.Random(0)
def word(): return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 12)))
def rows(task, n):
    return [{"prompt": f"{task} {w}:", "completion": " " + (w if task == "copy" else w[::-1])}
            for w in (word() for _ in range(n))]
for task in ("copy", "reverse"):
    for name, n in (("train", 20000), ("val", 500)):
        with open(f"{task}-{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows(task, n))
with open("letters.txt", "w") as f:  # the character tokenizer's corpus
    f.writelines(r["prompt"] + r["completion"] + "\n" for t in ("copy", "reverse") for r in rows(t, 1000))
PY
python3 "$ROOT/data.py" --dataset letters.txt --tokenizer-type char --tokenizer-vocab-size 64 \
  --seq-len 32 --cache-dir cache > /dev/null
TOK=$(ls cache/letters-*/tokenizer.model)
train() {  # run name, task, flags
  local name=$1 task=$2; shift 2
  python3 "$ROOT/train_fsdp.py" --strategy none --arch baseline --size tiny --dataset "$task-train.jsonl" \
    --val-path "$task-val.jsonl" --instruct --document-mask --tokenizer "$TOK" --seq-len 256 \
    --global-batch 16 --warmup-steps 30 --eval-every 100 --eval-samples 512 --param-dtype fp32 \
    --cache-dir cache --out-dir "runs/$name" --overwrite --log-every 100 "$@" > "log-$name.txt" 2>&1
  echo "$name: $(grep -h '| validation' "log-$name.txt" | sed 's/ | [0-9.]* s$//' | tr '\n' ' ')"
}
OMP_NUM_THREADS=${BASE_THREADS:-${OMP_NUM_THREADS:-2}} train base copy --max-steps 600 --lr 3e-3 --seed 0
train base-on-reverse reverse --init-from runs/base --max-steps 1 --lr 1e-30 --warmup-steps 0  # before
for seed in $SEEDS; do  # all at once: give each OMP_NUM_THREADS of the cores
  for lr in $FULL_LR; do
    train "full-$lr-$seed" reverse --init-from runs/base --max-steps "$STEPS" --lr "$lr" --seed "$seed" &
  done
  for lr in $LORA_LR; do
    train "lora-$lr-$seed" reverse --init-from runs/base --max-steps "$STEPS" --lr "$lr" --seed "$seed" \
      --lora-rank 8 --lora-targets wq,wk,wv,wo,w1,w2,w3 &
  done
done
wait
