"""train_fsdp.py's --export: a sharded checkpoint consolidated into the single-file model.pt
beside it, in one process, with no process group:

    python train_fsdp.py --export RUN/checkpoints/step_N      # or RUN/checkpoints/best, latest

A file of its own because it runs after training, never during it: the trainer imports it only
for --export, and for the digest of frozen weights (LoRA's base), which a resume and an export
check (copy it beside train_fsdp.py in your repo). It reads through the trainer's own loading,
which runs no code from the checkpoint's files."""

import concurrent.futures
import hashlib
import json
import os
import warnings

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

FROZEN = "frozen weights (--init-from)"  # their files' digest, among the data's in meta.json


def weights_digest(path, trainer):
    """sha256 over the files of --init-from's weights: its safetensors, model.pt or dcp/."""
    kind, where = trainer.checkpoint_weights(path)
    files = [where] if os.path.isfile(where) else [
        os.path.join(where, n) for n in sorted(os.listdir(where))
        if kind != "hf" or n.endswith(".safetensors")]
    with concurrent.futures.ThreadPoolExecutor() as pool:  # hashlib lets go of the GIL
        return hashlib.sha256(" ".join(pool.map(file_sha256, files)).encode()).hexdigest()


def file_sha256(path):
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


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
    model_state, of_model = saved_model(path, trainer), meta
    if meta["config"].get("model", {}).get("lora_rank"):  # adapters only: merged into their base
        model_state, of_model = merged_lora(path, meta, model_state, trainer)
    tmp = os.path.join(path, "export.tmp")
    torch.save(trainer.consolidated_payload(model_state, of_model), tmp)
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


def saved_model(path, trainer):
    """The model's tensors in the sharded checkpoint `path`, read in this one process."""
    dcp_dir = os.path.join(path, "dcp")
    metadata = trainer.read_dcp_metadata(dcp_dir).state_dict_metadata
    model_state = {key.removeprefix("model."): torch.empty(md.size, dtype=md.properties.dtype)
                   for key, md in metadata.items()
                   if key.startswith("model.") and isinstance(md, TensorStorageMetadata)}
    with warnings.catch_warnings():  # no process group: DCP says it reads as one process, as meant
        warnings.filterwarnings("ignore", message="torch.distributed is")
        trainer.dcp_load({"model": model_state}, dcp_dir)
    return model_state


def merged_lora(path, meta, adapters, trainer):
    """(state dict, meta) of the plain model that a LoRA checkpoint of this project's model.py
    (its `adapters`) computes: the base weights of the run's --init-from, refused if their files
    changed since, with the adapters merged in (model.merge_lora); the config says lora_rank 0."""
    import model as model_lib

    config, base = meta["config"], meta["config"]["checkpoint"]["init_from"]
    if weights_digest(base, trainer) != (meta.get("data") or {}).get(FROZEN):
        raise trainer.BadInput(f"{path} holds LoRA adapters for the weights of {base}, whose files "
                               "have changed since the run: merging would give another model")
    cfg = model_lib.ModelConfig(**model_lib.saved_fields(config["model"]))
    model = model_lib.build_model(cfg)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is")
        trainer.init_weights_from(base, model)
    state = model_lib.merge_lora({**model.state_dict(), **adapters}, cfg)
    plain = {**config, "model": {**config["model"], "lora_rank": 0}}
    return state, {**meta, "config": plain}
