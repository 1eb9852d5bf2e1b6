"""train_fsdp.py's --export: a sharded checkpoint consolidated into the single-file model.pt
beside it, in one process, with no process group:

    python train_fsdp.py --export RUN/checkpoints/step_N      # or RUN/checkpoints/best, latest

A file of its own because it runs after training, never during it: the trainer imports it only
for --export (copy it beside train_fsdp.py to use that flag in your repo). It reads through the
trainer's own loading, which runs no code from the checkpoint's files."""

import json
import os
import warnings

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata


def export(path, trainer):
    """The checkpoint directory `path` (latest and best followed) gets model.pt; returns its path.
    `trainer`: the train_fsdp module that runs, whose errors it raises. Only the model's tensors
    are read: the optimizer's two fp32 copies never are."""
    path, meta = trainer.require_checkpoint_dir(
        path, "--export", "a checkpoint directory such as RUN/checkpoints/step_N")
    model_pt = os.path.join(path, "model.pt")
    if os.path.exists(model_pt):  # a full checkpoint, or the last of a run
        print(f"{path} already holds a consolidated model.pt")
        return model_pt
    dcp_dir = os.path.join(path, "dcp")
    metadata = trainer.read_dcp_metadata(dcp_dir).state_dict_metadata
    model_state = {key.removeprefix("model."): torch.empty(md.size, dtype=md.properties.dtype)
                   for key, md in metadata.items()
                   if key.startswith("model.") and isinstance(md, TensorStorageMetadata)}
    with warnings.catch_warnings():  # no process group: DCP says it reads as one process, as meant
        warnings.filterwarnings("ignore", message="torch.distributed is")
        trainer.dcp_load({"model": model_state}, dcp_dir)
    tmp = os.path.join(path, "export.tmp")
    torch.save(trainer.consolidated_payload(model_state, meta), tmp)
    os.replace(tmp, model_pt)
    # meta.json lists model.pt too (a damaged one is then found like any file of the checkpoint),
    # and keeps its mtime: the save's, by which the trainer orders the checkpoints.
    meta_path = os.path.join(path, "meta.json")
    saved = os.stat(meta_path)
    meta["files"]["model.pt"] = os.path.getsize(model_pt)
    trainer.write_text_atomic(meta_path, json.dumps(meta, indent=1))
    os.utime(meta_path, ns=(saved.st_atime_ns, saved.st_mtime_ns))
    print(f"wrote {model_pt}")
    return model_pt
