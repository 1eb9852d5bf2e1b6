#!/usr/bin/env bash
# torchtune's LoRA recipe (0.6.1, lora_finetune_single_device) against our --lora-rank, side by side, at the
# Llama-3-8B shape on one GPU: random bf16 weights in the Hugging Face layout (untied, vocab 128256, RoPE
# theta 500000), the same synthetic instruction JSONL and byte-level BPE tokenizer for both, rows of SEQ
# packed (per-document mask), bf16, compiled by block (torchtune compiles each layer; a whole-model compile
# of ours at 8B had not finished its first step in 6 minutes), activation checkpointing, AdamW lr 3e-4 (10 warmup steps,
# cosine), no clipping, prompt tokens out of the loss; LoRA rank 8, alpha 16, dropout 0 on the attention
# projections only (torchtune: q_proj, k_proj, v_proj, output_proj; ours: wq, wk, wv, wo), base frozen.
# The pieces are tools/torchtune_sft_gpu.sh's (its wheels from .whl/, stubs, data, components, summary);
# the recipe's settings are tools/torchtune_lora.yaml. Run from the repository root on the GPU machine:
#   OUT=results bash tools/lora_gpu.sh                    # SIDES="torchtune ours", OURS="lora lora_bf16"
#   SIDES=torchtune OUT=results bash tools/lora_gpu.sh    # one side (all of it: about 3 minutes at 8B on an H200)
#   OURS=lora_bf16 SIDES=ours BATCH=2 OUT=results bash tools/lora_gpu.sh   # ours: OUR_FLAGS's names
#   TINY=1 TT_EXTRA="device=cpu compile=False" OURS_EXTRA=--no-compile OUT=/tmp/r bash tools/lora_gpu.sh  # CPU dry run
# Shared by both sides: MODEL_DIR (weights, config.json, tokenizer.json, tokenizer_config.json), DATA_JSONL
# ({"prompt", "completion"} lines), SEQ, BATCH (rows of SEQ per step), STEPS, WARMUP (steps left out of the
# medians). Writes $OUT/torchtune.log, torchtune_metrics.txt, torchtune_summary.txt, ours_NAME.log,
# ours_summary.txt and summary.txt (one line a side: median tokens/s after WARMUP, counting every position of
# the packed rows, B*S / step time, and peak torch.cuda.max_memory_allocated), data.txt, model.txt, versions.txt.
set -uo pipefail
: "${OUT:?set OUT to the results folder}"
mkdir -p "$OUT"; export OUT
ROOT=$(pwd)
WORK=${WORK:-/tmp/tt_lora}
TINY=${TINY:-0}                 # 1: a 2-layer, width-64 model (vocab 128256) for a dry run
export MODEL_DIR=${MODEL_DIR:-$WORK/model$([ "$TINY" = 1 ] && echo _tiny)}
export DATA_JSONL=${DATA_JSONL:-$WORK/data/sft.jsonl}
export SEQ=${SEQ:-2048} BATCH=${BATCH:-1} STEPS=${STEPS:-30} WARMUP=${WARMUP:-5}
ROWS=${ROWS:-4000}              # about 2.7 rows fill a pack of 2048; 4000 rows make about 1,450 packs
SIDES=${SIDES:-"torchtune ours"}
SIDES=${SIDES//,/ }              # names separated by spaces or commas, here and in OURS
TT_EXTRA=${TT_EXTRA:-}          # more recipe overrides, e.g. "device=cpu compile=False" for a CPU dry run
OURS_EXTRA=${OURS_EXTRA:-}      # more trainer flags, after OUR_FLAGS', e.g. "--no-compile" for a CPU dry run
TT_TIMEOUT=${TT_TIMEOUT:-480} OURS_TIMEOUT=${OURS_TIMEOUT:-480}   # seconds a run; a device call ends at 600 s
TINY_OVERRIDES=
if [ "$TINY" = 1 ]; then
  TINY_OVERRIDES="model._component_=torchtune.models.llama3.lora_llama3 model.vocab_size=128256 model.num_layers=2
    model.num_heads=4 model.num_kv_heads=2 model.embed_dim=64 model.max_seq_len=8192 model.intermediate_dim=256
    model.rope_base=500000"
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
T0=$SECONDS
stamp() { echo "[$((SECONDS - T0)) s] $*"; }
put_summary() {  # "NAME: ..." into $OUT/summary.txt, in place of an earlier NAME line (a side a call)
  local f=$OUT/summary.txt; touch "$f"
  { grep -v "^${1%%:*}: " "$f"; echo "$1"; } > "$f.tmp"; mv "$f.tmp" "$f"; echo "$1"
}

# --- 1. wheels (torchtune, torchao, torchdata, omegaconf, antlr4) -------------------------------------
source tools/torchtune_wheels.sh
stamp "wheels installed"

# --- 2. data and tokenizer (tokenizer files into MODEL_DIR) ----------------------------------------------
if [ ! -f "$DATA_JSONL" ] || [ ! -f "$MODEL_DIR/tokenizer.json" ]; then
  python3 tools/torchtune_sft_data.py "$(dirname "$DATA_JSONL")" --jsonl "$DATA_JSONL" --rows "$ROWS" \
    --tokenizer-dir "$MODEL_DIR" --max-seq-len "$SEQ" 2>&1 | tee "$OUT/data.txt"
fi

# --- 3. the random Llama-3-8B (tools/hf_load_memory.py's write_model: bf16 safetensors shards of about 1 GB,
# made on the GPU; 16 GB at 8B), config.json with the tokenizer's BOS/EOS ids ------------------------------
python3 - "$MODEL_DIR" "$TINY" <<'PY' 2>&1 | tee "$OUT/model.txt"
import json, os, sys, time
sys.path.insert(0, "tools")
from hf_load_memory import llama_config, write_model
from tokenizers import Tokenizer
out, tiny = sys.argv[1], sys.argv[2] == "1"
tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
with open(os.path.join(out, "tokenizer_config.json")) as fh:
    tc = json.load(fh)
layers, width, ffn, vocab, heads, kv = (2, 64, 256, 128256, 4, 2) if tiny else (32, 4096, 14336, 128256, 32, 8)
cfg = llama_config(layers, width, ffn, vocab, heads, kv, rope_theta=500000.0, max_position_embeddings=8192,
                   head_dim=width // heads, torch_dtype="bfloat16",
                   bos_token_id=tok.token_to_id(tc["bos_token"]), eos_token_id=tok.token_to_id(tc["eos_token"]))
cfg_path = os.path.join(out, "config.json")
if os.path.isfile(os.path.join(out, "model.safetensors.index.json")):
    with open(cfg_path) as fh:
        old = json.load(fh)
    if any(old.get(k) != cfg[k] for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size")):
        sys.exit(f"model: {out} holds another shape ({old.get('num_hidden_layers')} x {old.get('hidden_size')}); "
                 "remove it or give another MODEL_DIR")
t0 = time.perf_counter()
write_model(out, cfg)  # returns at once if the directory already has an index
with open(cfg_path, "w") as fh:
    json.dump(cfg, fh, indent=1)
with open(os.path.join(out, "model.safetensors.index.json")) as fh:
    files = sorted(set(json.load(fh)["weight_map"].values()))
size = sum(os.path.getsize(os.path.join(out, f)) for f in files)
print(f"model: {out} {len(files)} files {size / 2 ** 30:.2f} GiB bf16, {layers} x {width}, ffn {ffn}, "
      f"{heads}/{kv} heads, vocab {vocab}, untied ({time.perf_counter() - t0:.0f} s)")
PY
[ "${PIPESTATUS[0]}" = 0 ] || { echo "model not written" | tee -a "$OUT/model.txt"; exit 1; }
stamp "data and model ready"

# --- 4. torchtune ---------------------------------------------------------------------------------------
if [[ " $SIDES " == *" torchtune "* ]]; then
  TT_OUT=$WORK/torchtune_out; rm -rf "$TT_OUT"
  # the recipe file itself (the `tune` entry point imports kagglehub for `tune download`);
  # max_packs: pack only the rows the run consumes (shuffle is off, so these are the first ones)
  PYTHONPATH=$TT_PYTHONPATH timeout -s KILL "$TT_TIMEOUT" python3 /tmp/site/recipes/lora_finetune_single_device.py \
    --config tools/torchtune_lora.yaml \
    model_dir="$MODEL_DIR" data_jsonl="$DATA_JSONL" output_dir="$TT_OUT" seq_len="$SEQ" \
    batch_size="$BATCH" max_steps_per_epoch="$STEPS" dataset.max_packs=$((STEPS * BATCH)) \
    $TINY_OVERRIDES $TT_EXTRA \
    > "$OUT/torchtune.log" 2>&1
  echo "torchtune exit status $?" | tee -a "$OUT/torchtune.log"
  grep -h "trainable\|Memory stats after model init\|GPU peak memory" "$OUT/torchtune.log" | head -5
  cp "$TT_OUT/logs/metrics.txt" "$OUT/torchtune_metrics.txt" 2>/dev/null
  python3 tools/torchtune_sft_summary.py "$OUT/torchtune_metrics.txt" --batch "$BATCH" --seq "$SEQ" \
    --warmup "$WARMUP" --log "$OUT/torchtune.log" --name torchtune_lora > "$OUT/torchtune_summary.txt" 2>&1
  cat "$OUT/torchtune_summary.txt"
  # the common line: positions/s (B*S / median step time, as ours counts tokens_per_s) and peak allocated
  put_summary "$(python3 - "$OUT/torchtune_summary.txt" <<'PY'
import re, sys
s = open(sys.argv[1]).read()
pos, peak = re.search(r"positions_per_s=(\d+)", s), re.search(r"peak_alloc_gib=([0-9.]+)", s)
print(f"torchtune_lora: median tokens_per_s={pos.group(1)} peak_alloc_gib={peak.group(1)}" if pos and peak
      else "torchtune_lora: no metrics")
PY
)"
  stamp "torchtune done"
fi

# --- 5. ours: train_fsdp.py --instruct --document-mask on the same files (BOS + prompt + completion + EOS, the
# prompt out of the loss, packed into rows of SEQ), --init-from the same directory, LoRA on wq, wk, wv, wo.
# The trainer's tokens_per_s is --global-batch * --seq-len / step time (every position, as torchtune's
# positions/s above); mem_peak_gib is torch.cuda.max_memory_allocated since the weights were loaded.
# As torchtune's recipe does after its model init, the peak counter restarts once the weights are in
# (and the optimizer made): the peak is the training's, not the load's.
cat > "$WORK/ours_entry.py" <<'PY'
import sys
import torch
sys.path.insert(0, ".")
import train_fsdp
restore = train_fsdp.restore_state
def restore_then_reset(*args, **kwargs):
    out = restore(*args, **kwargs)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    return out
if __name__ == "__main__":  # the data build's worker processes import this file again
    train_fsdp.restore_state = restore_then_reset
    train_fsdp.run(sys.argv[1:])
PY
ours() {  # name, flags
  local name=$1; shift
  rm -rf "$WORK/ours_$name"
  timeout -s KILL "$OURS_TIMEOUT" python3 "$WORK/ours_entry.py" --init-from "$MODEL_DIR" --strategy none --meta-init \
    --compile --compile-scope blocks --activation-checkpointing --instruct --document-mask --dataset "$DATA_JSONL" \
    --seq-len "$SEQ" --global-batch "$BATCH" --micro-batch "$BATCH" --max-steps "$STEPS" \
    --lora-rank 8 --lora-alpha 16 --lora-dropout 0 --lora-targets wq,wk,wv,wo \
    --lr 3e-4 --warmup-steps 10 --min-lr-ratio 0 --grad-clip 0 --eval-every 0 --eval-samples 64 \
    --no-save-final --log-every 1 --cache-dir "$WORK/cache" --out-dir "$WORK/ours_$name" "$@" $OURS_EXTRA \
    > "$OUT/ours_$name.log" 2>&1
  echo "ours $name exit status $?" | tee -a "$OUT/ours_$name.log"
  local lines
  lines=$(python3 - "$WORK/ours_$name/metrics.jsonl" "$name" <<'PY'
import json, statistics, sys, os
recs = [json.loads(l) for l in open(sys.argv[1])] if os.path.exists(sys.argv[1]) else []
recs = [r for r in recs if "tokens_per_s" in r]
steps = [r for r in recs if r["step"] > int(os.environ["WARMUP"])] or recs
if not steps:
    sys.exit(print(f"ours_{sys.argv[2]}: no metrics\nours_{sys.argv[2]}: no metrics"))
tps = statistics.median(r["tokens_per_s"] for r in steps)
dt = statistics.median(r["step_time_s"] for r in steps) if "step_time_s" in steps[0] else float("nan")
peak = max(r["mem_peak_gib"] for r in recs)
print(f"ours_{sys.argv[2]}: steps={len(recs)} median_over_steps>{os.environ['WARMUP']}: tokens_per_s={tps:.0f} "
      f"step_time_s={dt:.4f} batch={os.environ['BATCH']} seq={os.environ['SEQ']} "
      f"loss step {recs[0]['step']} {recs[0].get('loss', float('nan')):.4f} step {recs[-1]['step']} "
      f"{recs[-1].get('loss', float('nan')):.4f} peak_alloc_gib={peak:.2f} "
      f"peak_reserved_gib={max(r.get('mem_reserved_gib', 0) for r in recs):.2f}")
print(f"ours_{sys.argv[2]}: median tokens_per_s={tps:.0f} peak_alloc_gib={peak:.2f}")
PY
)
  echo "$lines" | head -1 | tee -a "$OUT/ours_summary.txt"
  put_summary "$(echo "$lines" | tail -1)" > /dev/null
}
declare -A OUR_FLAGS=(
  [lora]=""                          # the frozen base in bf16 (--param-dtype), the adapters and AdamW's state fp32
  [lora_bf16]="--weights-dtype bf16" # all in bf16, as torchtune (base, adapters, AdamW's state)
)
OURS=${OURS:-"lora lora_bf16"}
OURS=${OURS//,/ }
if [[ " $SIDES " == *" ours "* ]]; then
  for name in $OURS; do
    ours "$name" ${OUR_FLAGS[$name]}
  done
  stamp "ours done"
fi
echo "--- $OUT/summary.txt (median after step $WARMUP of $STEPS, $BATCH x $SEQ positions a step)"
cat "$OUT/summary.txt"
stamp "all done"
