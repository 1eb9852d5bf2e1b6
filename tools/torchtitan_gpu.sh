#!/usr/bin/env bash
# torchtitan's Llama-3 trainer against ours (train_fsdp.py) on ONE GPU, one after the other, at
# one of our shapes: SIZE=1b (default: 16 layers, d 2048, 32 heads, 8 KV heads, SwiGLU 8192) or
# SIZE=8b (32 layers, d 4096, 32 heads, 8 KV heads, SwiGLU 14336, RoPE 500000), LAYERS=N to keep
# only N of its blocks (8b's 32 do not fit one GPU's memory with AdamW); vocab 32000 untied,
# RMSNorm 1e-5, no bias (the same parameter count in both); seq 2048, MB rows a micro-batch (12),
# ACC micro-batches a step (4), uniform random tokens, torch.compile (each block and the loss),
# bf16, no activation checkpointing, AdamW lr 3e-4, 20 steps, no checkpoint or evaluation.
# RUNS (default "titan ours") names the runs, in order: titan, titan-float8, ours, ours-float8
# (float8 tensorwise, the head left in bf16 in both). torchtitan 0.2.2: its newest release that
# imports under torch 2.11 (0.3.0 needs torch.distributed.fsdp.DataParallelMeshDims, from torch
# 2.14). Launched by torchrun as its run_train.sh does, without that script's PYTORCH_ALLOC_CONF:
# both use the default allocator. On one GPU torchtitan applies no FSDP (dp_shard 1) and runs bf16
# by autocast over fp32 weights; ours under fsdp2 runs SHARD_GRAD_OP with bf16 parameters. The
# flavor and the random-token loader are registered from outside torchtitan: OUT_DIR/titan_ours.py,
# by --experimental.custom_import.
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site; SIZE=8b LAYERS=8 MB=4 ACC=12 bash tools/torchtitan_gpu.sh OUT_DIR
# Logs: OUT_DIR/RUN.log. Prints the median tokens/s of steps 6-20 and the peak memory of each
# (torchtitan logs peak reserved memory; ours peak allocated, and the reserved in its
# metrics.jsonl). MFU is each trainer's own count (both take 989 TFLOP/s).
set -uo pipefail
O=${1:?usage: bash tools/torchtitan_gpu.sh OUT_DIR}; mkdir -p "$O"; O=$(cd "$O" && pwd)
export PYTHONUNBUFFERED=1
cat > "$O/titan_ours.py" <<'EOF'
import dataclasses
import os

import torch
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.models.llama3 import TransformerModelArgs
from torchtitan.models.llama3.model.args import RoPEScalingArgs
from torchtitan.protocols.train_spec import get_train_spec, register_train_spec

# FFN: int(2 * 4 * dim / 3) * multiplier, rounded up to a multiple of 1024: 1b 5461 * 1.5 -> 8192,
# 8b 10922 * 1.3 -> 14336. RoPE scaling factor 1: Llama 3.1's frequency scaling is the identity.
SHAPES = {"1b": dict(dim=2048, n_layers=16, ffn_dim_multiplier=1.5, rope_theta=10000),
          "8b": dict(dim=4096, n_layers=32, ffn_dim_multiplier=1.3, rope_theta=500000)}
shape = SHAPES[os.environ.get("SIZE", "1b")]
shape["n_layers"] = int(os.environ.get("LAYERS") or shape["n_layers"])
ARGS = TransformerModelArgs(n_heads=32, n_kv_heads=8, vocab_size=32000, multiple_of=1024,
                            norm_eps=1e-5, rope_scaling_args=RoPEScalingArgs(scaling_factor=1.0),
                            **shape)


class RandomTokens(IterableDataset):
    def __init__(self, vocab, seq_len, seed):
        self.vocab, self.seq_len, self.seed = vocab, seq_len, seed

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed)
        while True:
            x = torch.randint(0, self.vocab, (self.seq_len + 1,), generator=g)
            yield {"input": x[:-1]}, x[1:]


def random_loader(dp_world_size, dp_rank, tokenizer, job_config, **kwargs):
    t = job_config.training
    return ParallelAwareDataloader(RandomTokens(ARGS.vocab_size, t.seq_len, 1234 + dp_rank),
                                   dp_rank=dp_rank, dp_world_size=dp_world_size,
                                   batch_size=t.local_batch_size)


register_train_spec("llama3_ours", dataclasses.replace(
    get_train_spec("llama3"), model_args={"ours": ARGS}, build_tokenizer_fn=None,
    build_dataloader_fn=random_loader, build_validator_fn=None, state_dict_adapter=None))
EOF

SIZE=${SIZE:-1b}; MB=${MB:-12}; ACC=${ACC:-4}; export SIZE LAYERS
GB=$((MB * ACC)); LAYER_FLAG=${LAYERS:+--n-layer $LAYERS}
TITAN_FLOAT8="--model.converters quantize.linear.float8 --quantize.linear.float8.recipe_name tensorwise
 --quantize.linear.float8.filter_fqns output"
for run in ${RUNS:-titan ours}; do
  echo "== $run"
  case $run in
  titan|titan-float8)
    PYTHONPATH="$O:${PYTHONPATH:-}" timeout 300 \
      python3 -m torch.distributed.run --standalone --nproc_per_node 1 -m torchtitan.train \
      --experimental.custom_import titan_ours --model.name llama3_ours --model.flavor ours \
      --model.hf_assets_path "$O" --job.dump_folder "$O/$run" --metrics.log_freq 1 \
      --metrics.disable_color_printing --training.local_batch_size $MB --training.global_batch_size $GB \
      --training.seq_len 2048 --training.steps 20 --parallelism.data_parallel_shard_degree 1 \
      --compile.enable --activation_checkpoint.mode none --optimizer.lr 3e-4 \
      --lr_scheduler.warmup_steps 2 $([ $run = titan ] || echo $TITAN_FLOAT8) 2>&1 | tee "$O/$run.log" ;;
  ours|ours-float8)
    rm -rf "$O/$run"
    timeout 300 python3 train_fsdp.py --size $SIZE $LAYER_FLAG --arch baseline --meta-init \
      --no-tie-embeddings --dataset random --tokenizer-vocab-size 32000 --seq-len 2048 \
      --micro-batch $MB --global-batch $GB --max-steps 20 --log-every 1 --eval-every 0 \
      --eval-samples 8 --no-save-final --warmup-steps 2 --lr 3e-4 --compile --overwrite \
      --strategy fsdp2 --out-dir "$O/$run" $([ $run = ours ] || echo --float8 tensorwise) 2>&1 \
      | tee "$O/$run.log" ;;
  *) echo "unknown run: $run (titan, titan-float8, ours, ours-float8)"; exit 2 ;;
  esac
  echo "$run exit ${PIPESTATUS[0]}"
done

python3 - "$O" <<'EOF'
import json, os, re, statistics, sys
o, skip, rows = sys.argv[1], 5, []
read = lambda f: open(f).read() if os.path.exists(f) else ""
line = r"step:\s*(\d+)\s.*?memory:\s*(-?[\d.]+)GiB.*?tps: ([\d,]+).*?mfu: ([\d.]+)%"
for run in os.environ.get("RUNS", "titan ours").split():
    if run.startswith("titan"):
        t = [(int(s), float(g), float(p.replace(",", "")), float(m))
             for s, g, p, m in re.findall(line, read(f"{o}/{run}.log"))]
        late = [r for r in t if r[0] > skip]
        if late:
            rows.append((run, len(late), statistics.median(r[2] for r in late),
                         statistics.median(r[3] for r in late),
                         "%.2f reserved" % max(r[1] for r in t)))
        continue
    recs = [json.loads(r) for r in read(f"{o}/{run}/metrics.jsonl").splitlines()
            if '"tokens_per_s"' in r and r.endswith("}")]  # a line torn by a kill is left out
    late = [r for r in recs if r["step"] > skip]
    if late:
        rows.append((run, len(late), statistics.median(r["tokens_per_s"] for r in late),
                     100 * statistics.median(r.get("mfu", 0) for r in late),
                     "%.2f alloc, %.2f reserved" % (max(r["mem_peak_gib"] for r in recs),
                                                    max(r["mem_reserved_gib"] for r in recs))))
print(f"\nSIZE={os.environ['SIZE']} LAYERS={os.environ.get('LAYERS', '')}")
print(f"{'run':22} {'steps':>5} {'tokens/s/GPU':>13} {'MFU %':>6}  peak memory GiB")
for name, n, tps, mfu, mem in rows:
    print(f"{name:22} {n:5d} {tps:13,.0f} {mfu:6.1f}  {mem}")
if len(rows) < len(os.environ.get("RUNS", "titan ours").split()):
    print(f"a run logged no steps after step {skip}: see the logs in {o}")
EOF
