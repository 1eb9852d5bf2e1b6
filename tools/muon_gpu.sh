#!/usr/bin/env bash
# --optimizer muon against AdamW on GPUs (BENCHMARKS.md), one benchmark per name:
#   bash tools/muon_gpu.sh CORPUS.txt RESULTS_DIR NAME [NAME ...]
#   quality  nanoGPT's Shakespeare recipe (tools/speed_gpu.sh first-result's, `none`, compiled): Muon's rate
#            tuned on --seed 3 (2,000 steps of the 5,000-step schedule, --muon-lr 5e-4, 1e-3, 2e-3; the lowest
#            best validation wins; MUON_LR=RATE skips the tuning), then AdamW and Muon at that rate, seeds 1 and 2, 5,000 steps
#            (tools/first_result.py: seconds and steps to validation <= 1.50 and 1.47, best validation).
#   quality1b  --size 1b on CORPUS, Muon at --lr and twice it, seeds 7 and 11, one run a GPU (300 steps).
#   latent   the Free Transformer 6 x 384 on the synthetic task (H = 8 and 16), 4,000 steps, AdamW and Muon
#            side by side on one GPU, then sample.py --demo (tools/latent_confirm.sh).
#   cost     (CORPUS unused: /dev/null) the 1b model's step under fsdp2 (tools/speed_gpu.sh's 1b flags, 12 x 4 rows a step;
#            ROWS=N rows, in micro-batches of 12), AdamW against Muon, on one GPU and then on every GPU (tools/startup_bench.py).
set -uo pipefail
CORPUS=$1; R=$2; shift 2; mkdir -p "$R"; W=/tmp/muon; rm -rf $W; mkdir -p $W
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=$W/pyc PYTHONUNBUFFERED=1
T="python train_fsdp.py"
SMALL="--dataset $CORPUS --tokenizer-type char --tokenizer-vocab-size 256 --val-fraction 0.1 --arch baseline \
 --n-layer 6 --d-model 384 --n-head 6 --seq-len 256 --global-batch 64 --dropout 0.2 --lr 1e-3 --beta2 0.99 \
 --warmup-steps 100 --lr-decay-steps 5000 --eval-every 250 --eval-samples 512 --log-every 50 --no-save-final \
 --compile --overwrite --strategy none --cache-dir $W/data --out-dir $W/runs/r"
ONE="--size 1b --arch baseline --meta-init --no-tie-embeddings --dataset random --tokenizer-vocab-size 32000 \
 --seq-len 2048 --micro-batch 12 --global-batch ${ROWS:-48} --max-steps 10 --log-every 1 --eval-every 0 --eval-samples 8 \
 --no-save-final --warmup-steps 2 --lr 3e-4 --compile --overwrite --strategy fsdp2 --out-dir $W/a"
NGPU=$(nvidia-smi -L | grep -c GPU)

for name in "$@"; do
  case $name in
  quality)
    if [ -z "${MUON_LR:-}" ]; then
      python tools/first_result.py $R/tune.json "muon 5e-4=$T $SMALL --max-steps 2000 --seed 3 --optimizer muon \
        --muon-lr 5e-4" "muon 1e-3=$T $SMALL --max-steps 2000 --seed 3 --optimizer muon --muon-lr 1e-3" \
        "muon 2e-3=$T $SMALL --max-steps 2000 --seed 3 --optimizer muon --muon-lr 2e-3"
    fi
    lr=${MUON_LR:-$(python -c "import json; r = json.load(open('$R/tune.json')); \
      print(min(r, key=lambda k: r[k]['best_val']).split()[1])")}
    echo "Muon's rate: $lr"
    python tools/first_result.py $R/$name.json "adamw seed 1=$T $SMALL --max-steps 5000 --seed 1" \
      "adamw seed 2=$T $SMALL --max-steps 5000 --seed 2" \
      "muon seed 1=$T $SMALL --max-steps 5000 --seed 1 --optimizer muon --muon-lr $lr" \
      "muon seed 2=$T $SMALL --max-steps 5000 --seed 2 --optimizer muon --muon-lr $lr" ;;
  quality1b)
    # --size 1b on CORPUS (bytes as tokens), one run a GPU, the GPUs side by side: Muon at --lr and at
    # twice it, seeds 7 and 11 (neither tuned on), a 300-step cosine; the cache built once first.
    B="--dataset $CORPUS --tokenizer-type char --tokenizer-vocab-size 256 --val-fraction 0.02 --seq-len 1024 \
 --cache-dir $W/data"
    python data.py $B
    RUN="$T $B --size 1b --arch baseline --global-batch 16 --micro-batch 16 --lr 3e-4 --warmup-steps 30 --max-steps 300 --eval-every 50 \
 --eval-samples 256 --log-every 25 --no-save-final --compile --overwrite --strategy none --optimizer muon"
    gpu=0
    for s in 7 11; do
      CUDA_VISIBLE_DEVICES=$((gpu % NGPU)) python tools/first_result.py $R/quality1b-seed$s.json \
        "muon-lr 3e-4 seed $s=$RUN --seed $s --muon-lr 3e-4 --out-dir $W/runs/a$s" \
        "muon-lr 6e-4 seed $s=$RUN --seed $s --muon-lr 6e-4 --out-dir $W/runs/b$s" > $R/quality1b-seed$s.log 2>&1 &
      gpu=$((gpu + 1))
    done
    wait; cat $R/quality1b-seed*.log ;;
  latent)
    M="--arch free --n-layer 6 --d-model 384 --n-head 6 --max-steps 4000"
    printf '%s\n' "adamw-h8 $M" "muon-h8 $M --optimizer muon" "adamw-h16 $M --latent-bits 16" \
      "muon-h16 $M --latent-bits 16 --optimizer muon" | RUNS=$W/latent bash tools/latent_confirm.sh - $R/latent ;;
  cost)
    python tools/startup_bench.py --skip 4 $R/cost-1gpu.json "adamw 1 GPU=$T $ONE" "muon 1 GPU=$T $ONE --optimizer muon"
    if [ "$NGPU" -gt 1 ]; then
      TR="python -m torch.distributed.run --standalone --nproc_per_node $NGPU train_fsdp.py"
      python tools/startup_bench.py --skip 4 $R/cost-gpus.json "adamw $NGPU GPUs=$TR $ONE" \
        "muon $NGPU GPUs=$TR $ONE --optimizer muon"
    fi ;;
  *) echo "unknown benchmark: $name (quality, quality1b, latent, cost)"; exit 2 ;;
  esac 2>&1 | tee $R/$name.log
done
