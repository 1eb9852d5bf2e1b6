#!/usr/bin/env bash
# Submit:   sbatch slurm_submit.sh [train_fsdp.py flags...]
# Override: sbatch --nodes=4 --gpus-per-node=8 --time=48:00:00 slurm_submit.sh --size 1b
#           TOTAL_BATCH_SIZE=512 BATCH_SIZE_PER_DEVICE=8 VENV=~/venvs/fsdp sbatch slurm_submit.sh
#
#SBATCH --job-name=fsdp-train
#SBATCH --output=slurm-%x-%j.out
#SBATCH --error=slurm-%x-%j.err
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=24:00:00
#SBATCH --signal=USR1@120
#SBATCH --requeue
set -euo pipefail

# --- environment: a venv or conda env named by a variable, optional modules ---------------
if [[ -n "${MODULES:-}" ]]; then module load ${MODULES}; fi
if [[ -n "${VENV:-}" ]]; then source "${VENV}/bin/activate"; fi
if [[ -n "${CONDA_ENV:-}" ]]; then conda activate "${CONDA_ENV}"; fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}

# --- what Slurm gave us, not a hard-coded count ---------------------------------------------
NNODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
GPUS_PER_NODE=${GPUS_PER_NODE:-$(nvidia-smi -L 2>/dev/null | grep -c GPU || true)}
if [[ "${GPUS_PER_NODE}" -eq 0 ]]; then
    GPUS_PER_NODE=${CPU_PROCS_PER_NODE:-2}   # CPU-only nodes: gloo processes per node
    echo "no GPU on this node: ${GPUS_PER_NODE} CPU processes per node with gloo"
fi
WORLD_SIZE=$((NNODES * GPUS_PER_NODE))

# --- batch: accumulation = total / (per-device x devices), checked before anything starts ---
TOTAL_BATCH_SIZE=${TOTAL_BATCH_SIZE:-64}
BATCH_SIZE_PER_DEVICE=${BATCH_SIZE_PER_DEVICE:-8}
PER_STEP=$((BATCH_SIZE_PER_DEVICE * WORLD_SIZE))
if (( TOTAL_BATCH_SIZE % PER_STEP != 0 )); then
    echo "error: TOTAL_BATCH_SIZE=${TOTAL_BATCH_SIZE} is not divisible by BATCH_SIZE_PER_DEVICE=${BATCH_SIZE_PER_DEVICE}" \
         "x ${WORLD_SIZE} devices (${NNODES} nodes x ${GPUS_PER_NODE}); use a multiple of ${PER_STEP}" >&2
    exit 2
fi
GRAD_ACCUM=$((TOTAL_BATCH_SIZE / PER_STEP))

# --- rendezvous on the first node of the allocation -----------------------------------------
HEAD_NODE=$(scontrol show hostnames "${SLURM_JOB_NODELIST}" | head -n 1)
RDZV_PORT=${RDZV_PORT:-$((29500 + SLURM_JOB_ID % 1000))}
RUN_DIR=${RUN_DIR:-runs/slurm-${SLURM_JOB_ID}}
echo "job ${SLURM_JOB_ID}: ${NNODES} nodes x ${GPUS_PER_NODE} = ${WORLD_SIZE} processes | head ${HEAD_NODE}:${RDZV_PORT}"
echo "batch: total ${TOTAL_BATCH_SIZE} = ${BATCH_SIZE_PER_DEVICE} per device x ${WORLD_SIZE} x accumulation ${GRAD_ACCUM}"
echo "run directory: ${RUN_DIR}"

# NCCL hygiene (uncomment what your cluster needs):
#   NCCL_DEBUG=INFO              print NCCL's setup; use WARN once the job runs
#   NCCL_SOCKET_IFNAME=ib0       the interface that connects the nodes (hangs at start when wrong)
#   TORCH_NCCL_ASYNC_ERROR_HANDLING=1   turn a stuck collective into an error after the timeout
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

# One srun task per node; torchrun starts GPUS_PER_NODE processes on each and meets the others
# at the c10d rendezvous on the head node.
srun --kill-on-bad-exit=1 python -m torch.distributed.run \
    --nnodes="${NNODES}" --nproc_per_node="${GPUS_PER_NODE}" \
    --rdzv_backend=c10d --rdzv_endpoint="${HEAD_NODE}:${RDZV_PORT}" --rdzv_id="${SLURM_JOB_ID}" \
    train_fsdp.py --global-batch "${TOTAL_BATCH_SIZE}" --micro-batch "${BATCH_SIZE_PER_DEVICE}" \
    --out-dir "${RUN_DIR}" "$@"
