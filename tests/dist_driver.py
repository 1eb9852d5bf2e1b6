"""Runs several short trainings inside one process group (torchrun) or one process.

Usage: [torchrun --nproc_per_node=N] python tests/dist_driver.py RUNS.json
RUNS.json maps a run name to a list of train_fsdp.py arguments; each run writes its own
--out-dir. Starting torch once per process for many runs keeps the test suite fast.
"""
import json
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_fsdp  # noqa: E402

if __name__ == "__main__":
    with open(sys.argv[1]) as fh:
        runs = json.load(fh)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    for name, argv in runs.items():
        train_fsdp.main(argv)
    if dist.is_initialized():
        dist.destroy_process_group()
    train_fsdp.leave(0)  # see leave(): avoids a gloo teardown race at interpreter exit
