#!/usr/bin/env bash
# Train with torchrun under Slurm: one srun task per node, torchrun starts one process per GPU.
#
# Submit from the repository root (the job's working directory):
#   sbatch slurm_submit.sh [train_fsdp.py flags...]
# Override any #SBATCH line on the command line, any variable below from the environment:
#   sbatch --nodes=4 --time=48:00:00 slurm_submit.sh --size 1b
#   TOTAL_BATCH_SIZE=512 BATCH_SIZE_PER_DEVICE=8 VENV=~/venvs/fsdp sbatch slurm_submit.sh
#   sbatch --export=ALL,TOTAL_BATCH_SIZE=512,RUN_DIR=runs/big slurm_submit.sh
# CPU-only cluster (no GPU gres configured): ask for no GPUs, which also overrides the header
# (sbatch refuses --gpus-per-node=8 there), and for the CPUs the nodes have:
#   sbatch --gpus-per-node=0 --cpus-per-task=2 slurm_submit.sh ...   (or SBATCH_GPUS_PER_NODE=0)
#   then CPU_PROCS_PER_NODE (default 2) gloo processes run on each node.
# GPU nodes whose cluster has no GPU gres: the same --gpus-per-node=0, and say how many GPUs:
#   GPUS_PER_NODE=8 sbatch --gpus-per-node=0 slurm_submit.sh ...
#
# Variables (environment; all optional):
#   TOTAL_BATCH_SIZE (64), BATCH_SIZE_PER_DEVICE (8)   sequences per optimizer step / per forward
#   RUN_DIR (runs/slurm-$SLURM_JOB_ID)                 the trainer's --out-dir; a requeued job resumes it
#   GPUS_PER_NODE        processes per node; default: Slurm's GPU allocation, else nvidia-smi's count
#   CPU_PROCS_PER_NODE (2)   processes per node when the node has no GPU
#   HEAD_NODE, RDZV_PORT     rendezvous host and port of several nodes; default: the first node, a
#                            free port found there. One node: torchrun binds a free port (localhost:0)
#   SHUTDOWN_TIMEOUT (110)   seconds torchrun waits for the workers' checkpoint after SIGTERM
#   PYTHON (python3), VENV, CONDA_ENV, MODULES, OMP_NUM_THREADS, NCCL_DEBUG
#   TORCH_FR_BUFFER_SIZE (2000)   flight recorder entries per rank (0 = off), dumped on a hang
#
# Preemption and the time limit: Slurm sends USR1 to this batch shell 120 s before the limit
# (--signal=B:...); scancel --batch --signal=USR1 JOBID does the same by hand. The shell sends
# SIGTERM to the training step (torchrun and its workers), each worker finishes its step, saves a
# checkpoint and exits, and the job requeues itself: the same job id runs this script again with
# the same RUN_DIR, and the trainer resumes from the checkpoint (--resume auto). A plain scancel
# cancels for good (no requeue).
#
#SBATCH --job-name=fsdp-train
#SBATCH --output=slurm-%x-%j.out
#SBATCH --error=slurm-%x-%j.err
#SBATCH --open-mode=append
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
# (--open-mode=append: a requeued run adds to the same output files. B: sends USR1 to this shell
# only. Send stop signals to this shell, as above: a USR1 that reaches torchrun directly is
# forwarded to the workers only by torch versions that have torchrun --signals-to-handle (set
# below); older ones die of it, and Slurm then ends the step with its workers, unsaved.)
set -euo pipefail

fail() {  # bad input: one clear line on stderr, exit 2, before anything starts
    echo "error: $*" >&2
    exit 2
}

# --- environment: a venv or conda env named by a variable, optional modules ---------------
# shellcheck disable=SC2086  # MODULES may name several modules: split on purpose
if [[ -n "${MODULES:-}" ]]; then module load ${MODULES}; fi
if [[ -n "${VENV:-}" ]]; then set +u; source "${VENV}/bin/activate"; set -u; fi
if [[ -n "${CONDA_ENV:-}" ]]; then   # a batch shell has not run conda's init: load its hook first
    command -v conda >/dev/null || fail "CONDA_ENV=${CONDA_ENV} but no conda on PATH (load its module with MODULES)"
    set +u   # conda's activation scripts (and packages' activate.d) read unset variables
    eval "$(conda shell.bash hook)"
    conda activate "${CONDA_ENV}"
    set -u
fi
PYTHON=${PYTHON:-python3}
[[ -f train_fsdp.py ]] || fail "train_fsdp.py not found in $(pwd): submit from the repository root (or pass --chdir)"
[[ -n "${SLURM_JOB_ID:-}" ]] || fail "not inside a Slurm job: submit with sbatch slurm_submit.sh"

# --- processes per node: what Slurm gave us, not a hard-coded count ------------------------
NNODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
if [[ -z "${GPUS_PER_NODE:-}" ]]; then
    if [[ -n "${SLURM_GPUS_ON_NODE:-}" ]]; then
        GPUS_PER_NODE=${SLURM_GPUS_ON_NODE}
    elif [[ -n "${SLURM_GPUS_PER_NODE:-}" ]]; then
        GPUS_PER_NODE=${SLURM_GPUS_PER_NODE##*:}      # "8" or "h100:8"
    else                                              # no GPU gres on this cluster: count them
        GPUS_PER_NODE=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    fi
fi
[[ "${GPUS_PER_NODE}" =~ ^[0-9]+$ ]] || fail "GPUS_PER_NODE=${GPUS_PER_NODE} is not a number of GPUs"
if (( GPUS_PER_NODE == 0 )); then
    PROCS_PER_NODE=${CPU_PROCS_PER_NODE:-2}
    [[ "${PROCS_PER_NODE}" =~ ^[1-9][0-9]*$ ]] || fail "CPU_PROCS_PER_NODE=${PROCS_PER_NODE} must be a positive integer"
    echo "no GPU on this node: ${PROCS_PER_NODE} CPU processes per node with gloo (CPU_PROCS_PER_NODE)"
else
    PROCS_PER_NODE=${GPUS_PER_NODE}
fi
WORLD_SIZE=$((NNODES * PROCS_PER_NODE))
# The task's CPUs shared by the processes of a node (a thread count per GPU process of 32 would
# oversubscribe the node 8 times).
CPUS_PER_PROC=$(( ${SLURM_CPUS_PER_TASK:-${PROCS_PER_NODE}} / PROCS_PER_NODE ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( CPUS_PER_PROC > 0 ? CPUS_PER_PROC : 1 ))}

# --- batch: accumulation = total / (per-device x devices), checked before anything starts ---
TOTAL_BATCH_SIZE=${TOTAL_BATCH_SIZE:-64}
BATCH_SIZE_PER_DEVICE=${BATCH_SIZE_PER_DEVICE:-8}
[[ "${TOTAL_BATCH_SIZE}" =~ ^[1-9][0-9]*$ ]] || fail "TOTAL_BATCH_SIZE=${TOTAL_BATCH_SIZE} must be a positive integer"
[[ "${BATCH_SIZE_PER_DEVICE}" =~ ^[1-9][0-9]*$ ]] || fail "BATCH_SIZE_PER_DEVICE=${BATCH_SIZE_PER_DEVICE} must be a positive integer"
PER_STEP=$((BATCH_SIZE_PER_DEVICE * WORLD_SIZE))
if (( TOTAL_BATCH_SIZE % PER_STEP != 0 )); then
    fail "TOTAL_BATCH_SIZE=${TOTAL_BATCH_SIZE} is not divisible by BATCH_SIZE_PER_DEVICE=${BATCH_SIZE_PER_DEVICE}" \
         "x ${WORLD_SIZE} processes (${NNODES} nodes x ${PROCS_PER_NODE}); use a multiple of ${PER_STEP}"
fi
GRAD_ACCUM=$((TOTAL_BATCH_SIZE / PER_STEP))

# --- rendezvous on the first node of the allocation (where this batch script runs) ----------
# One node: torchrun binds port 0 and so takes a free port as it binds it (jobs that share a
# node never collide). Several nodes must all be told the port before the head node's torchrun
# binds it, so a free one is looked up there first (RDZV_PORT chooses it instead).
if [[ "${NNODES}" -eq 1 && -z "${RDZV_PORT:-}" ]]; then
    RDZV_ENDPOINT=localhost:0
else
    HEAD_NODE=${HEAD_NODE:-$(scontrol show hostnames "${SLURM_JOB_NODELIST}" | head -n 1)}
    RDZV_PORT=${RDZV_PORT:-$("${PYTHON}" -c 'import socket; s=socket.socket(); s.bind(("",0)); print(s.getsockname()[1])')}
    RDZV_ENDPOINT=${HEAD_NODE}:${RDZV_PORT}
fi
RUN_DIR=${RUN_DIR:-runs/slurm-${SLURM_JOB_ID}}
echo "job ${SLURM_JOB_ID} (restart ${SLURM_RESTART_COUNT:-0}): ${NNODES} nodes x ${PROCS_PER_NODE} = ${WORLD_SIZE} processes" \
     "| rendezvous ${RDZV_ENDPOINT} | OMP_NUM_THREADS ${OMP_NUM_THREADS}"
echo "batch: total ${TOTAL_BATCH_SIZE} = ${BATCH_SIZE_PER_DEVICE} per device x ${WORLD_SIZE} processes x accumulation ${GRAD_ACCUM}"
echo "run directory: ${RUN_DIR}"

# NCCL hygiene (uncomment what your cluster needs):
#   NCCL_DEBUG=INFO              print NCCL's setup; use WARN once the job runs
#   NCCL_SOCKET_IFNAME=ib0       the interface that connects the nodes (hangs at start when wrong)
#   TORCH_NCCL_ASYNC_ERROR_HANDLING=1   turn a stuck collective into an error after the timeout
#                                (the trainer's process-group timeout is 30 minutes)
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# Hang diagnosis: PyTorch's flight recorder keeps each rank's last collectives in a ring buffer
# and NCCL's watchdog dumps it into RUN_DIR/flight_recorder/rank_<r> when a collective times out
# (the trainer's process-group timeout is 30 minutes); the README (Troubleshooting, "Hangs or
# NCCL timeouts in training") says how to read the dumps. The trainer makes the directory. TORCH_FR_BUFFER_SIZE=0 turns it off; the
# TORCH_NCCL_* names are what releases before the TORCH_FR_* ones read.
FR_PREFIX="$(realpath -m "${RUN_DIR}")/flight_recorder/rank_"
export TORCH_FR_BUFFER_SIZE=${TORCH_FR_BUFFER_SIZE:-2000}
export TORCH_NCCL_TRACE_BUFFER_SIZE=${TORCH_NCCL_TRACE_BUFFER_SIZE:-${TORCH_FR_BUFFER_SIZE}}
export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
export TORCH_FR_DUMP_TEMP_FILE=${TORCH_FR_DUMP_TEMP_FILE:-${FR_PREFIX}}
export TORCH_NCCL_DEBUG_INFO_TEMP_FILE=${TORCH_NCCL_DEBUG_INFO_TEMP_FILE:-${TORCH_FR_DUMP_TEMP_FILE}}
# After SIGTERM torchrun waits this long for its workers (to finish the step and save) before
# SIGKILL. Newer torch reads it (torchrun --shutdown-timeout); older torch waits 30 s.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-110}
# torchrun forwards these to its workers (its default lacks USR1, which would kill it); torch
# versions without --signals-to-handle ignore the variable.
export PET_SIGNALS_TO_HANDLE=${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}

# --- stop on USR1 (time limit, preemption) or TERM: ask the trainer to save, then requeue -----
# The TERM goes to the job's steps, not to srun: srun answers a TERM by killing its tasks, while
# `scancel --signal=TERM JOBID` (without --batch) signals every process of the training step and
# not this shell. torchrun forwards it to its workers as well and waits for them; each worker
# finishes its step, saves a checkpoint and exits with code 3. On several nodes no worker exits
# before every rank's save is complete (the trainer ends its stop with a collective after the
# save and stopped.json), so srun --kill-on-bad-exit, which ends the other nodes' tasks when the
# first torchrun exits, finds nothing left to write.
STOP_SIGNAL=""
request_stop() {
    [[ -n "${STOP_SIGNAL}" ]] && return 0   # already stopping
    STOP_SIGNAL=$1
    echo "$(date '+%F %T') SIG$1: asking the trainer to save and stop (SIGTERM to the job's steps)"
    scancel --signal=TERM "${SLURM_JOB_ID}" || true
}
trap 'request_stop USR1' USR1
trap 'request_stop TERM' TERM

# Stopped on request: requeue, so the same job id, and so the same RUN_DIR, runs again and
# resumes from its latest complete checkpoint. The trainer saved, wrote RUN_DIR/stopped.json and
# exited 3 (torchrun itself exits 1, so the file is what says the stop was clean). Without the
# file the trainer failed after the signal (or the signal came while it was still starting):
# requeued all the same, once, since the resume starts from a complete checkpoint; if the next
# run fails after a signal too (a save that always fails, say), the job ends
# (RUN_DIR/requeued_after_failure marks the first time; a clean stop or a finished run clears
# it). Not requeued when Slurm is already ending the job (JobState COMPLETING: a plain scancel,
# which also sends TERM, or the time limit reached without the USR1 warning): submitting again
# with the same RUN_DIR resumes. Requeueing ends this shell.
finish() {
    local code=$1 state marker="${RUN_DIR}/requeued_after_failure"
    if [[ -n "${SRUN_PID:-}" && -n "${STOP_SIGNAL}" && ${code} -ne 0 && ! -f "${RUN_DIR}/stopped.json" ]]; then
        if [[ -f "${marker}" ]]; then
            echo "$(date '+%F %T') signal ${STOP_SIGNAL}, and the trainer failed again (exit code ${code}) without" \
                 "saving a stop checkpoint: not requeueing; its error: line above says why" >&2
            exit "${code}"
        fi
        echo "$(date '+%F %T') signal ${STOP_SIGNAL}, but the trainer exited with code ${code} without saving" \
             "a stop checkpoint (its error: line above says why); the next run resumes from the latest" \
             "complete one" >&2
        mkdir -p "${RUN_DIR}" && touch "${marker}"
    elif [[ -n "${SRUN_PID:-}" ]] && { [[ -f "${RUN_DIR}/stopped.json" ]] || (( code == 0 )); }; then
        rm -f "${marker}"
    fi
    if [[ -n "${STOP_SIGNAL}" && ${code} -ne 0 ]] || (( code == 3 )); then
        if [[ -f "${RUN_DIR}/stopped.json" ]]; then
            echo "$(date '+%F %T') the trainer saved and stopped cleanly (${RUN_DIR}/stopped.json); torchrun's" \
                 "SignalException tracebacks above are its usual report of the signal, not an error" >&2
        fi
        state=$(scontrol show job "${SLURM_JOB_ID}" 2>/dev/null | grep -o 'JobState=[A-Z_]*' || true)
        if [[ "${state}" != "JobState=RUNNING" ]]; then
            echo "$(date '+%F %T') stopped (signal ${STOP_SIGNAL:-none}, exit code ${code}, ${state}): not requeueing;" \
                 "submit again with RUN_DIR=${RUN_DIR} to resume"
            exit "${code}"
        fi
        echo "$(date '+%F %T') stopped (signal ${STOP_SIGNAL:-none}, exit code ${code}):" \
             "requeueing job ${SLURM_JOB_ID}; the next run resumes from ${RUN_DIR}"
        scontrol requeue "${SLURM_JOB_ID}"
        exit 0
    fi
    echo "$(date '+%F %T') srun exited with code ${code}"
    exit "${code}"
}
if [[ -n "${STOP_SIGNAL}" ]]; then finish 3; fi   # stopped before training started

# One srun task per node; torchrun starts PROCS_PER_NODE processes on each and meets the others
# at the c10d rendezvous on the head node. srun runs in the background so that this shell can
# handle the signals while it waits (bash runs a trap only between commands).
rm -f "${RUN_DIR}/stopped.json"   # left by the stop before a requeue; the trainer writes it anew
# --cpus-per-task again: srun does not inherit sbatch's value on Slurm 22.05 and later, and its
# step would otherwise bind every process of the node to one CPU.
srun --kill-on-bad-exit=1 ${SLURM_CPUS_PER_TASK:+--cpus-per-task=${SLURM_CPUS_PER_TASK}} "${PYTHON}" -m torch.distributed.run \
    --nnodes="${NNODES}" --nproc_per_node="${PROCS_PER_NODE}" \
    --rdzv_backend=c10d --rdzv_endpoint="${RDZV_ENDPOINT}" --rdzv_id="${SLURM_JOB_ID}" \
    train_fsdp.py --global-batch "${TOTAL_BATCH_SIZE}" --micro-batch "${BATCH_SIZE_PER_DEVICE}" \
    --out-dir "${RUN_DIR}" "$@" &
SRUN_PID=$!

# `wait` returns early (status > 128) when a trapped signal arrives: wait again until srun exits.
while :; do
    CODE=0; wait "${SRUN_PID}" || CODE=$?
    (( CODE > 128 )) || break
    if kill -0 "${SRUN_PID}" 2>/dev/null; then continue; fi   # interrupted; srun still running
    LAST=0; wait "${SRUN_PID}" || LAST=$?                    # it exited meanwhile: bash kept its status
    if (( LAST != 127 )); then CODE=${LAST}; fi
    break
done
finish "${CODE}"
