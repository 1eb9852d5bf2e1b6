#!/usr/bin/env bash
# Save and load times of a ~1B model on every GPU of the node, sharded vs full checkpoints
# (lines "saved ... in X s" and "resumed from ... in Y s" of the training log), and their size.
#   OUT=dir bash tools/gpu_checkpoint_times.sh      (logs go to $OUT, default ./gpu_logs)
set -uo pipefail
OUT=${OUT:-gpu_logs}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
NGPU=$(nvidia-smi -L | grep -c GPU)
TR="python3 -m torch.distributed.run --standalone --nproc_per_node=$NGPU"
ARGS="--size 1b --arch baseline --meta-init --dataset random --tokenizer-vocab-size 32000 --seq-len 2048
      --micro-batch 4 --global-batch $((4 * NGPU)) --log-every 1 --eval-every 0 --eval-samples 8 --save-every 2"
for type in sharded full; do
    run=/tmp/ckpt-$type
    rm -rf $run
    # Step 2 is saved and is not the last step: the last one's save would also write the
    # consolidated model.pt and time both. The second launch resumes from step 2.
    $TR train_fsdp.py $ARGS --checkpoint-type $type --max-steps 3 --no-save-final --out-dir $run > "$OUT/ckpt_$type.log" 2>&1
    $TR train_fsdp.py $ARGS --checkpoint-type $type --max-steps 3 --no-save-final --out-dir $run >> "$OUT/ckpt_$type.log" 2>&1
    echo "$type ($NGPU GPUs): $(grep -hoE '(saved|resumed from) [^ ]+ in [0-9.]+ s' $run/training_log.txt | tr '\n' ';')"
    du -sh $run/checkpoints/step_0000002
done
