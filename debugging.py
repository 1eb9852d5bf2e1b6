"""Distributed debugging for train_fsdp.py's --debug. The trainer imports this file only for that
flag: copy it beside the trainer to use it in your repo. slurm_submit.sh turns the flight recorder
on by itself."""

import os

import torch.distributed as dist


def debug_env(run_dir, rank):
    """Before the process group exists: torch's distributed debug level, NCCL's logging and the
    flight recorder (each rank's last 2000 collectives, dumped to RUN_DIR/flight_recorder/rank_<r>
    on a timeout; docs/slurm.md). A value set already (by slurm_submit.sh) wins. Rank 0 says so."""
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    dist.set_debug_level_from_env()  # torch reads the variable at import: too late without this
    prefix = os.path.join(os.path.abspath(run_dir), "flight_recorder", "rank_")
    settings = {"NCCL_DEBUG": "INFO", "TORCH_FR_BUFFER_SIZE": "2000",
                "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                "TORCH_FR_DUMP_TEMP_FILE": prefix, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix}
    for name, value in settings.items():  # older releases read TORCH_NCCL_*, not TORCH_FR_*
        os.environ.setdefault(name, value)
    if rank == 0:
        print(f"distributed debug level {dist.get_debug_level().name}, "
              f"NCCL_DEBUG={os.environ.get('NCCL_DEBUG')}", flush=True)
