#!/usr/bin/env bash
# torchtune's full fine-tune recipe (0.6.1, full_finetune_single_device) against ours, side by side, at the
# Llama-3.2-1B shape on one GPU: random bf16 weights in the Hugging Face layout (tied embeddings, vocab
# 128256), the same synthetic instruction JSONL and byte-level BPE tokenizer for both, rows of SEQ packed,
# bf16, compiled, activation checkpointing, fused AdamW lr 2e-5, prompt tokens out of the loss.
# Run from the repository root on the GPU machine, with OUT set. Offline, the wheels come in .whl/, fetched
# beforehand with: pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
# manylinux_2_28_x86_64 -d .whl torchtune==0.6.1 torchao==0.15.0 torchdata==0.11.0 omegaconf==2.3.0
# (and antlr4-python3-runtime==4.9.3, which PyPI has only as source: `pip wheel --no-deps -w .whl` it).
#   OUT=results bash tools/torchtune_sft_gpu.sh            # SIDES="torchtune ours attention" by default
#   OURS=none_packed_bf16,none_padded OUT=results bash tools/torchtune_sft_gpu.sh   # ours: OUR_FLAGS's names
#   BATCH=16 STEPS=30 SIDES=torchtune bash tools/torchtune_sft_gpu.sh
# Shared by both sides: MODEL_DIR (weights, config.json, tokenizer.json, tokenizer_config.json),
# DATA_JSONL ({"prompt", "completion"} lines), SEQ, BATCH (rows of SEQ per step), STEPS, WARMUP (steps left
# out of the medians). Writes $OUT/torchtune.log, $OUT/torchtune_metrics.txt, $OUT/torchtune_summary.txt
# (one line: median tokens/s after WARMUP, peak memory), $OUT/data.txt, $OUT/model.txt and the versions.
set -uo pipefail
: "${OUT:?set OUT to the results folder}"
mkdir -p "$OUT"
ROOT=$(pwd)
WORK=${WORK:-/tmp/tt_sft}
export MODEL_DIR=${MODEL_DIR:-$WORK/model}
export DATA_JSONL=${DATA_JSONL:-$WORK/data/sft.jsonl}
export SEQ=${SEQ:-2048} BATCH=${BATCH:-8} STEPS=${STEPS:-40} WARMUP=${WARMUP:-5}
ROWS=${ROWS:-4000}              # about 2.7 rows fill a pack of 2048; 4000 rows make about 1,450 packs
SIDES=${SIDES:-"torchtune ours attention"}
SIDES=${SIDES//,/ }              # names separated by spaces or commas, here and in OURS
TINY=${TINY:-0}                 # 1: a 2-layer, width-64 model (vocab 128256) for a dry run
TT_EXTRA=${TT_EXTRA:-}          # more recipe overrides, e.g. "device=cpu compile=False" for a CPU dry run
TINY_FLAG=; TINY_OVERRIDES=
if [ "$TINY" = 1 ]; then
  TINY_FLAG=--tiny
  TINY_OVERRIDES="model._component_=torchtune.models.llama3_2.llama3_2 model.vocab_size=128256 model.num_layers=2
    model.num_heads=4 model.num_kv_heads=2 model.embed_dim=64 model.max_seq_len=131072 model.intermediate_dim=256
    model.rope_base=500000 model.scale_factor=32"
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
T0=$SECONDS
stamp() { echo "[$((SECONDS - T0)) s] $*"; }

# --- 1. wheels (torchtune, torchao, torchdata, omegaconf, antlr4) -------------------------------------
source tools/torchtune_wheels.sh
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
stamp "wheels installed"

# --- 2. data and tokenizer (tokenizer files into MODEL_DIR), 3. the random Llama-3.2-1B -----------------
if [ ! -f "$DATA_JSONL" ] || [ ! -f "$MODEL_DIR/tokenizer.json" ]; then
  python3 tools/torchtune_sft_data.py "$(dirname "$DATA_JSONL")" --jsonl "$DATA_JSONL" --rows "$ROWS" \
    --tokenizer-dir "$MODEL_DIR" --max-seq-len "$SEQ" 2>&1 | tee "$OUT/data.txt"
fi
python3 tools/torchtune_sft_model.py "$MODEL_DIR" --tokenizer-dir "$MODEL_DIR" $TINY_FLAG 2>&1 | tee "$OUT/model.txt"
stamp "data and model ready"

# --- 4. torchtune --------------------------------------------------------------------------------------
if [[ " $SIDES " == *" torchtune "* ]]; then
  TT_OUT=$WORK/torchtune_out; rm -rf "$TT_OUT"
  # the recipe file itself (the `tune` entry point imports kagglehub for `tune download`);
  # max_packs: pack only the rows the run consumes (shuffle is off, so these are the first ones)
  PYTHONPATH=$TT_PYTHONPATH timeout 540 python3 /tmp/site/recipes/full_finetune_single_device.py \
    --config tools/torchtune_sft_full.yaml \
    model_dir="$MODEL_DIR" data_jsonl="$DATA_JSONL" output_dir="$TT_OUT" seq_len="$SEQ" \
    batch_size="$BATCH" max_steps_per_epoch="$STEPS" dataset.max_packs=$((STEPS * BATCH)) \
    $TINY_OVERRIDES $TT_EXTRA \
    > "$OUT/torchtune.log" 2>&1
  echo "torchtune exit status $?" | tee -a "$OUT/torchtune.log"
  cp "$TT_OUT/logs/metrics.txt" "$OUT/torchtune_metrics.txt" 2>/dev/null
  python3 tools/torchtune_sft_summary.py "$OUT/torchtune_metrics.txt" --batch "$BATCH" --seq "$SEQ" \
    --warmup "$WARMUP" --log "$OUT/torchtune.log" > "$OUT/torchtune_summary.txt" 2>&1
  cat "$OUT/torchtune_summary.txt"
  stamp "torchtune done"
fi

# --- 5. ours: train_fsdp.py --instruct on the same files: BOS + prompt + completion + EOS, the prompt
# out of the loss (tools/torchtune_sft_data.py's tokenize_row), packed into rows of SEQ with
# --document-mask (torchtune: flex attention's per-document mask), or one example a row, padded.
# Constant lr 2e-5, no clipping, no save; median step time over the steps after WARMUP.
ours() {  # name, flags
  local name=$1; shift
  rm -rf "$WORK/ours_$name"
  timeout 400 python3 train_fsdp.py --init-from "$MODEL_DIR" --dataset "$DATA_JSONL" --instruct \
    --seq-len "$SEQ" --global-batch "$BATCH" --micro-batch "$BATCH" --max-steps "$STEPS" --lr 2e-5 \
    --warmup-steps 0 --min-lr-ratio 1 --grad-clip 0 --compile --activation-checkpointing \
    --log-every 1 --eval-every 0 --eval-samples 64 --no-save-final --cache-dir "$WORK/cache" \
    --out-dir "$WORK/ours_$name" "$@" > "$OUT/ours_$name.log" 2>&1
  echo "ours $name exit status $?" | tee -a "$OUT/ours_$name.log"
  python3 - "$WORK/ours_$name/metrics.jsonl" "$name" <<'PY' | tee -a "$OUT/ours_summary.txt"
import json, statistics, sys, os
recs = [json.loads(l) for l in open(sys.argv[1])] if os.path.exists(sys.argv[1]) else []
steps = [r for r in recs if "step_time_s" in r and r["step"] > int(os.environ["WARMUP"])]
if not steps:
    sys.exit(print(f"ours {sys.argv[2]}: no metrics"))
dt = statistics.median(r["step_time_s"] for r in steps)
pos = int(os.environ["BATCH"]) * int(os.environ["SEQ"]) / dt
val = next((r["val_loss"] for r in reversed(recs) if "val_loss" in r), float("nan"))
print(f"ours {sys.argv[2]}: steps={len(steps)} median step_time_s={dt:.4f} positions_per_s={pos:.0f} "
      f"loss step 1 {recs[0]['loss']:.4f} step {steps[-1]['step']} {steps[-1]['loss']:.4f} val {val:.4f} "
      f"peak_alloc_gib={max(r['mem_peak_gib'] for r in steps):.2f} "
      f"peak_reserved_gib={max(r['mem_reserved_gib'] for r in steps):.2f}")
PY
}
declare -A OUR_FLAGS=(
  [fsdp2_packed]="--strategy fsdp2 --document-mask"
  [none_packed]="--strategy none --document-mask"
  [none_padded]="--strategy none"
  [none_packed_bf16]="--strategy none --document-mask --weights-dtype bf16"  # all in bf16, as torchtune
  [fsdp2_packed_bf16]="--strategy fsdp2 --document-mask --weights-dtype bf16"
)
OURS=${OURS:-"none_packed_bf16 none_packed fsdp2_packed_bf16 none_padded"}
OURS=${OURS//,/ }
if [[ " $SIDES " == *" ours "* ]]; then
  for name in $OURS; do
    ours "$name" ${OUR_FLAGS[$name]}
  done
  stamp "ours done"
fi
if [[ " $SIDES " == *" attention "* ]]; then
  python3 tools/attention_mask_bench.py --batch "$BATCH" --seq "$SEQ" 2>&1 | tee "$OUT/attention.txt"
  stamp "attention kernels done"
fi
stamp "all done"
