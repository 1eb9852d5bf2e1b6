#!/usr/bin/env bash
# Fine-tuning a downloaded model's shape on the GPUs of one host (BENCHMARKS.md, issue 63): Llama 3
# 8B's config.json with random bf16 weights in safetensors shards (about 16 GB, written here by
# tools/hf_load_memory.py), then --init-from that directory under fsdp2 with --meta-init, compiled,
# random tokens, rows of 2,048:
#   bash tools/hf_finetune_gpu.sh RESULTS_DIR [EXTRA TRAINER FLAGS]
# Reports the load time (the trainer's "initialised the weights from DIR in N s", read with the
# page cache dropped when this user may drop it), each rank's peak host memory (its resident set,
# whole run), rank 0's peak GPU memory and the median tokens/s after 3 steps. One GPU of the host:
# NGPU=1 (with --cpu-offload for a model that does not fit).
set -uo pipefail
R=$1; shift; mkdir -p "$R"; W=/tmp/hfft; M=$W/llama3-8b; mkdir -p $W
NGPU=${NGPU:-$(nvidia-smi -L | grep -c GPU)}
export PYTHONUNBUFFERED=1
python - $M <<'PY'
import sys, time
sys.path.insert(0, "tools")
from hf_load_memory import llama_config, write_model
t0 = time.perf_counter()
write_model(sys.argv[1], llama_config(32, 4096, 14336, 128256, 32, 8, rope_theta=500000.0,
                                      max_position_embeddings=8192, bos_token_id=128000,
                                      eos_token_id=128001))
print(f"wrote {sys.argv[1]} in {time.perf_counter() - t0:.0f} s")
PY
du -sh $M | tee $R/model_size.txt
cat > $W/peak.py <<'PY'
import os, resource, sys
sys.path.insert(0, os.getcwd())
import train_fsdp
def leave(code, exit=train_fsdp.leave):  # the trainer ends with os._exit: report just before it
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    print(f"rank {os.environ.get('RANK')}: peak host memory {peak:.2f} GiB", file=sys.stderr)
    exit(code)
train_fsdp.leave = leave
train_fsdp.run(sys.argv[1:])
PY
sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null && echo "page cache dropped" | tee $R/cache.txt \
  || echo "page cache not dropped (the files were just written)" | tee $R/cache.txt
python -m torch.distributed.run --standalone --nproc_per_node $NGPU $W/peak.py \
  --init-from $M --strategy fsdp2 --meta-init --compile --dataset random --tokenizer-vocab-size 128256 \
  --seq-len 2048 --micro-batch 2 --global-batch $((2 * NGPU)) --max-steps 12 --log-every 1 \
  --eval-every 0 --eval-samples 8 --no-save-final --warmup-steps 2 --lr 1e-5 --overwrite \
  --out-dir $W/run "$@" 2>&1 | tee $R/train.log
python - $W/run/metrics.jsonl $NGPU <<'PY' | tee $R/summary.txt
import json, statistics, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if '"tokens_per_s"' in l]
late = [r for r in recs if r["step"] > 3]
tps = statistics.median(r['tokens_per_s'] for r in late)
print(f"median tokens/s after step 3, all GPUs: {tps:,.0f} ({tps / int(sys.argv[2]):,.0f} a GPU) "
      f"(steps {late[0]['step']}-{late[-1]['step']}), median mfu "
      f"{statistics.median(r.get('mfu', float('nan')) for r in late):.1%}, "
      f"rank 0 peak GPU memory {max(r['mem_peak_gib'] for r in recs):.1f} GiB allocated, "
      f"{max(r['mem_reserved_gib'] for r in recs):.1f} GiB reserved")
PY
grep -h "initialised the weights\|peak host memory\|^error" $R/train.log
