"""Train a decoder-only Transformer or a Free Transformer with FSDP, DDP or on one device.

One file, raw torch.distributed. Read main() top to bottom: config -> distributed setup -> data
-> model -> wrapping -> optimizer -> loop -> checkpoint -> exit. The file follows the same order:
the config and the seams, the distributed setup, one function per distributed choice (wrapping,
gradient sync, clipping, precision, scaler, state dicts), the optimizer, the step, checkpoints,
the run directory and logging; the command-line and TOML parsing, then main(), come last.

    python train_fsdp.py                                  # one process (CPU or one GPU)
    torchrun --nproc_per_node=4 train_fsdp.py             # one node, 4 GPUs
    srun python train_fsdp.py                             # Slurm tasks, no torchrun

To train your own model, copy this file alone into your repo (it imports nothing of this project
but in its default seams, when they run) and call run() from your script with your seams:

    train_fsdp.run(build_model=..., compute_loss=..., load_dataset=...,   # see "Seams" below
                   model_config=MyModelConfig, data_config=MyDataConfig)  # your settings' dataclasses

Each field of those dataclasses is then a flag, a key of the [model] / [data] table of --config,
saved in config.json and checked on resume. run() gives the exit codes, signal handling and
shutdown of `python train_fsdp.py`. README: "Training your own model".
"""

import argparse
import collections
import contextlib
import dataclasses
import datetime
import fcntl
import functools
import importlib
import itertools
import json
import math
import os
import pickle
import random
import re
import resource
import shutil
import signal
import socket
import sys
import time
import tomllib
import typing
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    CPUOffloadPolicy,
    MixedPrecision,
    MixedPrecisionPolicy,
    ShardingStrategy,
    fully_shard,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

# =============================================================================================
# Configuration: one tree of dataclasses. Every field is a command-line flag (--field-name),
# a key of the TOML table of its section, and may be set by a preset.
# Precedence: command line > config file > preset > default.


def opt(default, help, choices=None):
    """A config field whose help text (and valid values) become the command-line flag's."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class FSDPConfig:
    sharding_strategy: str = opt("FULL_SHARD", "how parameters, gradients and optimizer state are split",
                                 ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"])
    hybrid_shard_size: int = opt(0, "processes per shard group for HYBRID_SHARD*; 0 = processes per node")
    backward_prefetch: str = opt("BACKWARD_PRE", "when to all-gather the next unit's parameters in backward",
                                 ["BACKWARD_PRE", "BACKWARD_POST", "NONE"])
    forward_prefetch: bool = opt(False, "issue the next unit's all-gather before the current forward")
    limit_all_gathers: bool = opt(True, "rate-limit all-gathers so the CPU cannot run ahead and blow memory")
    use_orig_params: bool = opt(True, "keep original parameters visible (needed for per-parameter weight "
                                "decay and torch.compile)")
    cpu_offload: bool = opt(False, "keep sharded parameters and gradients on CPU")
    sync_module_states: bool = opt(False, "broadcast rank 0's weights to all ranks at wrap time")
    meta_init: bool = opt(False, "build the model on the meta device and materialise it unit by unit "
                          "(models too big for one host's RAM)")
    auto_wrap: str = opt("auto", "FSDP unit rule, for fsdp and fsdp2 alike: module (the block classes), lambda "
                         "(a predicate on them), size (min_num_params), auto (module from 100M parameters; below, "
                         "the whole model is one unit)", ["auto", "module", "lambda", "size"])
    min_num_params: int = opt(1_000_000, "parameters per unit for --auto-wrap size")
    activation_checkpointing: bool = opt(False, "recompute blocks in backward (non-reentrant checkpoint_wrapper)")
    ac_every: int = opt(1, "checkpoint every k-th block (1 = all)")
    param_dtype: str = opt("bf16", "dtype of parameters in forward/backward", ["bf16", "fp16", "fp32"])
    reduce_dtype: str = opt("fp32", "dtype of gradient reduction", ["bf16", "fp16", "fp32"])
    buffer_dtype: str = opt("fp32", "dtype of buffers (the built-in models have none: RoPE is computed in fp32)",
                            ["bf16", "fp16", "fp32"])
    autocast: bool = opt(False, "fsdp, fsdp2: run forward and loss under torch.autocast(param_dtype) too, as ddp and "
                         "none do: its fp32 ops (cross_entropy, softmax, layer_norm, ...) then run in fp32, e.g. the "
                         "loss of a model that computes its own")


@dataclass
class TrainConfig:
    preset: str = opt("", "named setting bundle; individual flags override it",
                      ["", "single_node_fsdp", "multi_node_fsdp", "large_scale_fsdp", "ddp"])
    strategy: str = opt("fsdp", "data parallelism: fsdp (FSDP1, FullyShardedDataParallel), fsdp2 (fully_shard), ddp, "
                        "none (one process)", ["fsdp", "fsdp2", "ddp", "none"])
    seed: int = opt(1337, "seed for init, data order and sampling")
    global_batch: int = opt(64, "sequences per optimizer step, over all ranks and micro-batches")
    micro_batch: int = opt(0, "sequences per rank per forward; 0 = global_batch / world_size")
    grad_accum_mode: str = opt("auto", "auto: sync under fsdp, no_sync otherwise (both accumulate in reduce_dtype); "
                               "no_sync: reduce once per step (full-size grads held; FSDP1 accumulates them in "
                               "param_dtype: in bf16 ~2x the gradient error of sync at 32 micro-batches); sync: reduce "
                               "every micro-batch (less memory, more traffic)", ["auto", "no_sync", "sync"])
    max_steps: int = opt(0, "optimizer steps; 0 = derived from --epochs")
    epochs: float = opt(1.0, "passes over the training set when --max-steps is 0")
    lr: float = opt(1e-3, "peak learning rate")
    min_lr_ratio: float = opt(0.1, "final learning rate as a fraction of the peak")
    warmup_steps: int = opt(50, "linear warmup steps")
    lr_schedule: str = opt("cosine", "after warmup, cosine: decay to min_lr_ratio * lr at step --lr-decay-steps, "
                           "then that rate; wsd: lr, then a linear decay over the last --lr-decay-steps steps of "
                           "--max-steps (README: learning-rate schedule)", ["cosine", "wsd"])
    lr_decay_steps: int = opt(0, "cosine: the step where the decay ends; wsd: the decay's length; 0 = --max-steps "
                              "(cosine) or a fifth of it (wsd) at the run's first launch, then kept on resume")
    lr_scale_base_batch: int = opt(0, "if > 0, scale lr linearly by global_batch / this")
    weight_decay: float = opt(0.1, "AdamW weight decay, on >= 2-D weights only")
    beta1: float = opt(0.9, "AdamW beta1")
    beta2: float = opt(0.95, "AdamW beta2")
    grad_clip: float = opt(1.0, "max global gradient norm; 0 = no clipping")
    eval_every: int = opt(100, "validate every N steps (and at the end); 0 = only at the end")
    eval_samples: int = opt(512, "validation sequences per evaluation")
    log_every: int = opt(10, "log metrics every N steps")
    skip_nonfinite: bool = opt(False, "skip an optimizer step whose gradient norm is NaN/inf instead of stopping")
    out_dir: str = opt("", "run directory; empty = runs/<model class>-<date-time>")
    overwrite: bool = opt(False, "start afresh in a run directory that holds a run (its checkpoints are deleted)")
    compile: bool = opt(False, "torch.compile the model (see --compile-scope; fsdp forces use_orig_params) and the "
                        "loss")
    compile_scope: str = opt("model", "what --compile compiles: model (the whole wrapped model) or blocks (each "
                             "block in place before wrapping: identical blocks share one graph, so compiling takes "
                             "one block's time); fsdp2 compiles each block whenever the blocks are FSDP units",
                             ["model", "blocks"])
    compile_mode: str = opt("auto", "torch.compile mode of the model: auto (reduce-overhead under 100M parameters, "
                            "else default), default, reduce-overhead (CUDA graphs: "
                            "one launch for a graph's kernels, for small models on a GPU), max-autotune-no-cudagraphs",
                            ["auto", "default", "reduce-overhead", "max-autotune-no-cudagraphs"])
    profile: bool = opt(False, "write a Chrome trace of steps 2-4 per rank into the run directory")
    debug: bool = opt(False, "TORCH_DISTRIBUTED_DEBUG=DETAIL, NCCL/gloo debug logging and the flight recorder "
                      "(dumps into RUN_DIR/flight_recorder when a collective times out)")
    tensorboard: bool = opt(False, "also write every metric and the config to TensorBoard event files in "
                            "RUN_DIR/tensorboard (pip install tensorboard)")
    wandb: str = opt("", "also log every metric and the config to this W&B project (pip install wandb; "
                     "WANDB_MODE=offline logs without internet, `wandb sync` later); a resume continues the run")


@dataclass
class CheckpointConfig:
    checkpoint_type: str = opt("sharded", "sharded: torch.distributed.checkpoint, every rank writes its shard, "
                               "reshardable; full: one consolidated file written by rank 0", ["sharded", "full"])
    save_every: int = opt(0, "save a checkpoint every N steps; 0 = only at the end (and on SIGTERM/SIGUSR1)")
    save_final: bool = opt(True, "save a checkpoint at the end (benchmarks turn it off)")
    keep_checkpoints: int = opt(3, "keep the newest K complete checkpoints")
    keep_best: bool = opt(False, "also keep the checkpoint of lowest validation loss (the Free Transformer's is the "
                          "bound CE + KL, comparable with a baseline's CE; named by checkpoints/best, "
                          "never pruned); each --save-every and final save is then evaluated first")
    async_save: bool = opt(False, "write the --save-every checkpoints in the background (DCP async_save: staged to "
                           "CPU, on a GPU into a pinned host copy of the rank's state kept for the run, which FSDP1 "
                           "fills from a second, passing host copy; published at a later step once every rank has "
                           "written); stop and final saves stay synchronous")
    full_optimizer: bool = opt(True, "full checkpoints also hold the optimizer state (needed to resume)")
    resume: str = opt("auto", "auto: continue from the run directory's latest complete checkpoint; never: "
                      "refuse a run directory that holds a run; or a checkpoint directory to continue from")
    init_from: str = opt("", "start a new run from the weights of this checkpoint (run dir, step dir or model.pt)")


def project_model_config():
    import model as model_lib  # this project's model.py, imported only where its seams are used
    return model_lib.ModelConfig()


def project_data_config():
    import data as data_lib  # this project's data.py, likewise
    return data_lib.DataConfig()


@dataclass
class NoSettings:
    """The [model] or [data] section of seams that bring no settings of their own."""


@dataclass
class Config:
    # The seams' settings (run()'s model_config and data_config); by default this project's.
    model: typing.Any = field(default_factory=project_model_config)
    data: typing.Any = field(default_factory=project_data_config)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


# Bundles named as in common FSDP guides. Each sets fields of the sections above.
PRESETS = {
    "single_node_fsdp": {"train": {"strategy": "fsdp"},
                         "fsdp": {"sharding_strategy": "FULL_SHARD", "backward_prefetch": "BACKWARD_PRE",
                                  "limit_all_gathers": True, "activation_checkpointing": False}},
    "multi_node_fsdp": {"train": {"strategy": "fsdp"},
                        "fsdp": {"sharding_strategy": "HYBRID_SHARD", "backward_prefetch": "BACKWARD_PRE",
                                 "forward_prefetch": True, "limit_all_gathers": True}},
    "large_scale_fsdp": {"train": {"strategy": "fsdp"},
                         "fsdp": {"sharding_strategy": "FULL_SHARD", "backward_prefetch": "BACKWARD_PRE",
                                  "limit_all_gathers": True, "activation_checkpointing": True,
                                  "meta_init": True}},
    "ddp": {"train": {"strategy": "ddp"}},
}

# What only FSDP reads (param_dtype and activation checkpointing serve DDP and one device too).
FSDP_ONLY = {"sharding_strategy", "hybrid_shard_size", "backward_prefetch", "forward_prefetch", "limit_all_gathers",
             "use_orig_params", "cpu_offload", "sync_module_states", "auto_wrap", "min_num_params", "reduce_dtype",
             "buffer_dtype", "autocast"}
# FSDP1 settings FSDP2 has no form for: said, not refused, when changed from the default.
FSDP2_IGNORED = {"backward_prefetch", "limit_all_gathers", "use_orig_params", "sync_module_states", "buffer_dtype"}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Dense bf16 peak per GPU (datasheet, no sparsity), for MFU.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "GH200": 989e12, "A100": 312e12, "L40S": 362e12}
EXIT_FAILED, EXIT_BAD_INPUT, EXIT_PREEMPTED = 1, 2, 3  # 3: stopped by a signal, checkpoint saved
STOPPED_FILE = "stopped.json"  # in the run directory after an exit with code 3; removed at the next start
# --auto-wrap auto: below this many parameters the whole model is one FSDP unit. Per-block units
# save only the transient gather of one block's weights, under 200 MB of bf16 here, and cost host
# time per unit per step (10.7M parameters on one H200: 44 ms a step in 13 units, 25 ms in one).
ONE_UNIT_BELOW = 100_000_000
RUN_LOCK = "run.lock"  # in the run directory: locked by rank 0 while a run writes there, naming its process
FR_ENTRIES = 2000  # collectives each rank's flight recorder keeps (--debug; slurm_submit.sh sets its own)

# Warnings torch prints on every rank for choices made here on purpose (FSDP1's ShardedTensor
# state dicts, NO_SHARD on one process, gloo+nccl groups): silenced so rank 0's log stays readable.
for pattern in ("Please use DTensor instead", "_get_pg_default_device", "Multiple backends are registered",
                "FSDP is switching to use `NO_SHARD`", "When using ``NO_SHARD``", "torch.distributed.checkpoint"):
    warnings.filterwarnings("ignore", message=f".*{pattern}")


class BadInput(Exception):
    """A mistake in what the user asked for: reported in one line, exit code 2."""


class RunFailed(Exception):
    """The run cannot go on (non-finite loss, a save that failed): one line, exit code 1."""


class CorruptCheckpoint(RunFailed):
    """A checkpoint whose files cannot be read; --resume auto tries an older one."""


class Preempted(Exception):
    """SIGTERM/SIGUSR1 arrived: the checkpoint is saved, exit with EXIT_PREEMPTED."""


# =============================================================================================
# Seams: model, loss, data and their settings. These defaults train this project's model.py on its
# data.py, imported only where they run: in your repo (its own model.py, data/, ...) pass yours to
# run() (tests/test_seams.py does, in a throwaway repo). Your seams' settings are dataclasses,
# run(model_config=..., data_config=...): cfg.model and cfg.data, each field a flag, a key of the
# [model] / [data] table of --config, saved in config.json and compared on resume (refused when it
# changed). Optional on such a dataclass: check(self) and resolve(self, data) (before anything is
# set up; once the data is loaded: fill derived fields), raising ValueError (one line, exit 2) on
# bad values; RESUME_FREE, the fields a resume may change; PRESETS, {field: {value: {section:
# {key: value}}}}, bundles a field names (--size); saved_fields(table), a saved run's table with
# the fields it predates filled in.


def build_model(cfg):
    """Returns (model, wrap_classes, checkpoint_classes): the module, the block classes FSDP
    makes into units, and the block classes activation checkpointing recomputes."""
    import model as model_lib
    model = model_lib.build_model(cfg.model)
    wrap = {model_lib.DecoderBlock, model_lib.LatentSampler}
    return model, wrap, {model_lib.DecoderBlock}


def compute_loss(model, x, y, cfg):
    """Returns (loss, dict of detached scalars to log). In training the loss is backpropagated;
    in evaluation (model.eval()) it is the figure runs are compared by and --keep-best ranks:
    the CE for the baseline, the bound CE + KL for the Free Transformer (model.comparable_losses).
    Under --compile the loss is compiled too: the cross-entropy over the vocabulary runs fused
    instead of writing fp32 copies of the logits."""
    import model as model_lib
    logits, latent = model(x)
    loss, parts = (compiled_lm_loss() if cfg.train.compile else model_lib.lm_loss)(logits, y, latent, cfg.model.kappa)
    if latent is not None and not model.training:
        loss, comparable = model_lib.comparable_losses(model, x, y, parts)
        parts.update(comparable)
    return loss, parts


@functools.cache
def compiled_lm_loss():
    import model as model_lib
    return torch.compile(model_lib.lm_loss)  # made on first use: torch.compile loads dynamo (~1 s)


@typing.runtime_checkable
class BatchSource(typing.Protocol):
    """What the trainer reads from the dataset load_dataset returns (data.Dataset is one). Rows
    are addressed, not iterated: a step's rows are the same at any world size and after a resume."""

    seq_len: int  # tokens per row: x and y are (rows, seq_len) int64 tensors, y is x shifted by one
    vocab_size: int  # token ids are below it (a model config's resolve(data) may read it)
    n_val: int  # validation rows
    tokenizer_path: str  # saved with every checkpoint, for sampling; "" when there is none
    # Optional: digests, {source: digest} of what the rows are made from (corpus files, tokenizer),
    # saved with every checkpoint; a resume refuses changed ones (data.Dataset has them for text).

    def train_batch(self, step: int, global_batch: int, start: int, count: int):
        """(x, y): rows [start, start + count) of training step `step`'s global batch."""

    def val_batch(self, start: int, count: int):
        """(x, y): the fixed validation rows [start, start + count)."""

    def steps_per_epoch(self, global_batch: int) -> int:
        """Optimizer steps per pass over the training rows (for --epochs)."""


def load_dataset(cfg, rank) -> BatchSource:
    """Rank 0 tokenises and caches; everyone then opens the cache read-only. Bad settings:
    raise BadInput (one line, exit 2)."""
    import data as data_lib
    agree(lambda: data_lib.prepare_data(cfg.data), rank)
    try:
        return data_lib.load_data(cfg.data, cfg.train.seed)
    except data_lib.DataError as e:
        raise BadInput(str(e))


# =============================================================================================
# Distributed setup


@dataclass(frozen=True)
class Topology:
    """Where this process sits among the others; set up once, then only read."""

    rank: int
    local_rank: int  # on this node: picks the GPU
    world: int  # processes in all
    local_world: int  # processes on this node
    device: torch.device
    backend: str  # nccl or gloo
    owner: bool = True  # this process created the process group (a test driver may have)
    control: object = None  # the group for small control messages (stop flags, errors): gloo, on the CPU
    mesh: object = None  # the device mesh, where the strategy uses one (device_mesh)


def setup_distributed(cfg):
    """Rank, world size and local rank from torchrun (RANK/WORLD_SIZE/LOCAL_RANK) or from Slurm
    (SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID) when started by srun without torchrun, else a
    single process. The device comes from the LOCAL rank: the global rank breaks on node 2."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world, local_rank = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    elif int(env.get("SLURM_STEP_NUM_TASKS", "1")) > 1:
        # SLURM_STEP_NUM_TASKS is set by srun for its tasks; SLURM_NTASKS alone would also
        # match a plain `python train_fsdp.py` typed inside an allocation of several tasks.
        rank, world = int(env["SLURM_PROCID"]), int(env["SLURM_STEP_NUM_TASKS"])
        local_rank = int(env["SLURM_LOCALID"])
        local_world = world // int(env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", "1")))
        if "MASTER_ADDR" not in env:
            raise BadInput("srun without torchrun: set MASTER_ADDR (first host of the allocation) and MASTER_PORT")
        env.setdefault("MASTER_PORT", "29500")
    else:
        rank, world, local_rank, local_world = 0, 1, 0, 1

    if cfg.train.debug:
        # torch reads TORCH_DISTRIBUTED_DEBUG once, when torch.distributed is imported: setting the
        # variable now is not enough, so set the level itself too, before the process group exists.
        env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        env.setdefault("NCCL_DEBUG", "INFO")
        dist.set_debug_level_from_env()
        # The flight recorder is read when the process group is made, so it is set here (a value
        # already in the environment, e.g. from slurm_submit.sh, wins).
        for name, value in flight_recorder_env(cfg.train.out_dir or "runs").items():
            env.setdefault(name, value)
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise BadInput(f"local rank {local_rank} but only {torch.cuda.device_count()} GPUs visible "
                           "on this node; launch at most that many processes per node")
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    timeout = datetime.timedelta(minutes=30)
    owner = not dist.is_initialized()  # a caller (e.g. a test driver) may have set up the group already
    if owner and world == 1:
        # FSDP and DDP need a process group even for one process; an in-memory store needs no port.
        dist.init_process_group(group_backends(cfg, backend), store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    elif owner:
        dist.init_process_group(group_backends(cfg, backend), rank=rank, world_size=world, timeout=timeout,
                                device_id=device if backend == "nccl" else None)
    if rank == 0 and backend == "gloo" and owner:
        print("no CUDA device: running on CPU with the gloo backend")
    # Small control messages (stop flags, error strings) go through gloo on the CPU, so reading
    # them never waits for the GPU stream.
    control = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
    return Topology(rank=rank, local_rank=local_rank, world=world, local_world=local_world, device=device,
                    backend=backend, owner=owner, control=control)


def group_backends(cfg, backend):
    """The default process group's backends. FSDP2 with --cpu-offload keeps the gradients on the
    host, and clip_grad_norm_ (and fp16's GradScaler) all-reduce what they compute from them
    there: on GPUs the group then also needs gloo for CPU tensors (torchtitan does the same)."""
    if backend == "nccl" and cfg.train.strategy == "fsdp2" and cfg.fsdp.cpu_offload:
        return "cuda:nccl,cpu:gloo"
    return backend


def hybrid_shard_size(cfg, topo):
    """Processes per shard group for HYBRID_SHARD*: the flag, or the processes of one node."""
    return cfg.fsdp.hybrid_shard_size or topo.local_world


def agree(fn, rank):
    """Run fn on rank 0 only (file-system work) and share its result or its error with every
    rank, so all ranks exit together instead of the others hanging at the next collective."""
    out = [None, None]  # error, result
    if rank == 0:
        try:
            out[1] = fn()
        except (BadInput, RunFailed, ValueError) as e:  # ValueError: a seam's bad setting
            out[0] = str(e)
        except OSError as e:  # e.g. --out-dir is a file, a read-only or full disk
            out[0] = f"{e.strerror}: {e.filename}"
        except Exception as e:  # anything else (a file that is not a checkpoint, ...) must not hang the others
            out[0] = f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(out, src=0)
    if out[0]:
        raise BadInput(out[0])
    return out[1]


def any_rank_error(error, topo):
    """The first error (a string, or None) of any rank, on every rank: a rank that fails alone
    must stop every rank, not leave them waiting at the next collective."""
    errors = [None] * topo.world
    dist.all_gather_object(errors, error, group=topo.control)
    return next((e for e in errors if e), None)


# =============================================================================================
# Distributed choices: one function per concern, each branching on the strategy. Nothing else
# reads cfg.train.strategy; a new strategy is one more branch in each.


def wrap_model(model, wrap_classes, ckpt_classes, cfg, topo, init_fn=None):
    """The model on its device as FSDP1 or FSDP2 units (shard_units), DDP or plain, with
    activation checkpointing of every ac_every-th block and torch.compile. A model built on the
    meta device (--meta-init) is materialised and initialised here (init_fn: the model's
    per-module initialisation): FSDP1 unit by unit, FSDP2 once sharded, the others module by module,
    all in the same order (init_order) and with the same tensors (meta_init_fn), so the weights do
    not depend on the strategy or the world size."""
    f, device, strategy = cfg.fsdp, topo.device, cfg.train.strategy
    blocks = [m for m in model.modules() if isinstance(m, tuple(ckpt_classes))]
    units = shard_units(model, wrap_classes, cfg)
    n_params = parameter_count(model)  # before sharding
    regional = cfg.train.compile and compiles_blocks(cfg, n_params)
    mode = compile_mode(cfg, n_params)
    if regional and strategy != "fsdp2":
        for b in blocks:  # in place: the class stays, so the wrap rules and checkpointing still find it
            b.compile(mode=mode)
    if strategy == "fsdp2":
        model = fully_shard_model(model, units, blocks, cfg, topo, init_fn, mode if regional else None)
    else:
        materialise = meta_init_fn(model, init_fn, device) if f.meta_init else None
        if strategy == "fsdp":
            model = FSDP(model, param_init_fn=materialise, **fsdp_kwargs(cfg, units, topo))
        else:
            for m in init_order(model, units) if f.meta_init else []:
                materialise(m)
            if strategy == "ddp":
                # Gradients as views into DDP's all-reduce buckets: no second copy of every gradient.
                model = DDP(model.to(device), device_ids=[device.index] if device.type == "cuda" else None,
                            gradient_as_bucket_view=True)
            else:
                model = model.to(device)
        if f.activation_checkpointing:
            checkpoint_blocks(model, blocks[::f.ac_every])
    if cfg.train.compile and not regional:
        model = torch.compile(model, mode=mode)
    return model


def device_mesh(cfg, topo):
    """FSDP1 and FSDP2 shard over an explicit device mesh: 1-D over all processes, or for
    HYBRID_SHARD* 2-D, sharded inside a group of `shard` processes (a node) and replicated across
    groups (FSDP1's default would guess the node size from the GPU count). Given a mesh, FSDP1's
    state dicts hold DTensors like FSDP2's (without one, ShardedTensors). None for ddp and none."""
    if cfg.train.strategy not in ("fsdp", "fsdp2"):
        return None
    if "HYBRID" in cfg.fsdp.sharding_strategy:
        shard = hybrid_shard_size(cfg, topo)
        return init_device_mesh(topo.device.type, (topo.world // shard, shard), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(topo.device.type, (topo.world,), mesh_dim_names=("shard",))


def shard_units(model, wrap_classes, cfg):
    """The modules that become FSDP units, children before parents (the root holds the rest),
    for FSDP1 and FSDP2 alike. --auto-wrap module / lambda: the block classes (wrap_classes);
    size: bottom-up, a module whose parameters not yet in a unit number at least --min-num-params
    (ModuleList / ModuleDict excepted, as FSDP1's size policy does). A module that shares a
    parameter with a module outside it (a tied embedding and LM head) is never a unit: both
    stay in the root's unit, where one gather serves both."""
    f = cfg.fsdp
    if one_unit(f, parameter_count(model)):
        return []  # the root's unit holds everything
    holders = {}  # parameter -> the modules that hold it directly
    for m in model.modules():
        for p in m.parameters(recurse=False):
            holders.setdefault(p, []).append(m)
    units, taken = [], set()

    def visit(m):
        for child in m.children():
            visit(child)
        if m is model:
            return
        if f.auto_wrap == "size":
            free = sum(p.numel() for p in m.parameters() if p not in taken)
            chosen = free >= f.min_num_params and not isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict))
        else:
            chosen = isinstance(m, tuple(wrap_classes))
        inside = set(m.modules())
        if chosen and all(h in inside for p in m.parameters() for h in holders[p]):
            units.append(m)
            taken.update(m.parameters())
    visit(model)
    return units


def parameter_count(model):
    return sum(p.numel() for p in model.parameters())


def one_unit(f, n_params):
    """--auto-wrap auto on a model of n_params under ONE_UNIT_BELOW: no unit but the root."""
    return f.auto_wrap == "auto" and n_params < ONE_UNIT_BELOW


def compiles_blocks(cfg, n_params):
    """--compile compiles each block: under --compile-scope blocks, and under fsdp2 whenever the
    blocks are units of their own (a graph would break at every unit's hooks). An fsdp2 model of
    one unit (the root) is compiled whole, its hooks outside the graph, like the others."""
    return cfg.train.compile_scope == "blocks" or (cfg.train.strategy == "fsdp2" and not one_unit(cfg.fsdp, n_params))


def compile_mode(cfg, n_params):
    """--compile-mode auto: CUDA graphs (reduce-overhead) for a model under ONE_UNIT_BELOW
    parameters, whose step is kernel launches more than kernels (10.7M on one H200: none 15 -> 8
    ms a step, fsdp 21 -> 13, ddp on 2 GPUs 16 -> 8; fsdp on 2 H200s 26 -> 18, fsdp2 35 -> 24, the
    same losses at step 10); default above 100M, where graphs gained nothing (1b: 306 against 307 ms)
    and hold a memory pool of their own."""
    if cfg.train.compile_mode != "auto":
        return cfg.train.compile_mode
    return "reduce-overhead" if n_params < ONE_UNIT_BELOW else "default"


def init_order(model, units):
    """The modules in the order FSDP1 materialises a meta-device model: unit by unit (children
    first), breadth-first inside each down to the next unit, then the root's own modules. Every
    strategy initialises a --meta-init model in this order, so all give the same weights."""
    unit_set, order, seen = set(units), [], set()
    for top in units + [model]:
        queue = collections.deque([top])
        while queue:
            m = queue.popleft()
            order.append(m)
            for child in m.children():
                if child not in unit_set and child not in seen:
                    seen.add(child)
                    queue.append(child)
    return order


def meta_init_fn(model, init_fn, device):
    """--meta-init under FSDP1, DDP and one device: a function that allocates one module's own
    meta-device tensors on `device` and initialises them (init_tensors). A parameter that several
    modules share (a tied embedding and LM head, found from the model) is allocated once, at its
    first holder, and given to the others: to_empty, which FSDP1 would run module by module, gives
    each holder a copy of its own and unties them."""
    names = {m: name or type(model).__name__ for name, m in model.named_modules()}
    holders = collections.Counter(p for m in model.modules() for p in m.parameters(recurse=False))
    shared = {}  # meta parameter -> its allocation, until every holder has it

    def materialise(module):
        fresh = {}
        for n, p in module._parameters.items():
            if p is not None and p.is_meta:
                if p not in shared:
                    shared[p] = fresh[n] = torch.nn.Parameter(torch.empty_like(p, device=device), p.requires_grad)
                module._parameters[n] = shared[p]
                holders[p] -= 1
                if not holders[p]:
                    del shared[p]
        for n, b in module._buffers.items():
            if b is not None and b.is_meta:
                module._buffers[n] = fresh[n] = torch.empty_like(b, device=device)
        init_tensors(module, names[module], fresh, init_fn)
    return materialise


@torch.no_grad()
def init_tensors(module, name, fresh, init_fn):
    """Initialise the newly allocated tensors `fresh` ({attribute: tensor}) of `module` as building
    it and then the model's own initialisation would: its reset_parameters (which torch's modules
    run when built), then init_fn(module) (the model's init_module). They are NaN until then: one
    still NaN is one that nothing initialises, refused before training."""
    if not fresh:
        return
    for t in fresh.values():
        if t.is_floating_point():
            t.fill_(float("nan"))
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()
    if init_fn is not None:
        init_fn(module)
    for n, t in fresh.items():
        if t.is_floating_point() and t.isnan().any():
            raise BadInput(f"--meta-init: nothing initialises {name}.{n} ({type(module).__name__}): give the model an "
                           "init_module(module) that covers it, or the module a reset_parameters()")


@torch.no_grad()
def init_weights(model, order, init_fn):
    """--meta-init under FSDP2, after to_empty: initialise each module in `order` (init_tensors). A
    sharded (DTensor) parameter is initialised as a full-size tensor of which each rank keeps its
    shard, so the weights do not depend on the world size: one parameter at a time is held in full."""
    names = {m: name or type(model).__name__ for name, m in model.named_modules()}
    done = set()  # a parameter shared by modules (a tied embedding and head) is initialised at its first holder
    for m in order:
        own = {n: p for n, p in m._parameters.items() if isinstance(p, DTensor) and p not in done}
        done.update(own.values())
        full = {n: torch.empty(p.shape, dtype=p.dtype, device=p.to_local().device) for n, p in own.items()}
        plain = {n: t for n, t in itertools.chain(m._parameters.items(), m._buffers.items())
                 if t is not None and not isinstance(t, DTensor)}
        try:
            for n, t in full.items():
                m._parameters[n] = torch.nn.Parameter(t, requires_grad=own[n].requires_grad)
            init_tensors(m, names[m], {**plain, **full}, init_fn)
        finally:
            m._parameters.update(own)
        for n, p in own.items():
            p.to_local().copy_(distribute_tensor(full[n], p.device_mesh, p.placements, src_data_rank=None).to_local())


def checkpoint_blocks(model, chosen):
    """Non-reentrant checkpoint_wrapper around the `chosen` blocks (the reentrant variant fires
    FSDP's post-backward hooks twice); returns {block: its wrapper}."""
    chosen = set(chosen)
    apply_activation_checkpointing(
        model, check_fn=lambda m: m in chosen,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT))
    return {w._checkpoint_wrapped_module: w for w in model.modules() if isinstance(w, CheckpointWrapper)}


def fsdp_kwargs(cfg, units, topo):
    f = cfg.fsdp
    chosen = set(units)
    return dict(
        auto_wrap_policy=functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: m in chosen),
        sharding_strategy=ShardingStrategy[f.sharding_strategy],
        mixed_precision=MixedPrecision(param_dtype=DTYPES[f.param_dtype], reduce_dtype=DTYPES[f.reduce_dtype],
                                       buffer_dtype=DTYPES[f.buffer_dtype]),
        backward_prefetch=None if f.backward_prefetch == "NONE" else BackwardPrefetch[f.backward_prefetch],
        forward_prefetch=f.forward_prefetch,
        limit_all_gathers=f.limit_all_gathers,
        use_orig_params=f.use_orig_params,
        cpu_offload=CPUOffload(offload_params=f.cpu_offload),
        sync_module_states=f.sync_module_states,
        # On CPU FSDP1 needs device_id=cpu, otherwise it asks for an accelerator.
        device_id=topo.device,
        device_mesh=topo.mesh,
    )


def fully_shard_model(model, units, blocks, cfg, topo, init_fn, block_mode):
    """FSDP2. Activation checkpointing, then torch.compile of each block in `block_mode` (None:
    none; torchtitan's order), then fully_shard on each unit bottom-up and on the root.
    FULL_SHARD and HYBRID_SHARD reshard after forward (except the last block and the root, needed
    first in backward), SHARD_GRAD_OP and _HYBRID_SHARD_ZERO2 keep the gathered parameters until
    backward. A meta-device model is sharded on the meta device, then allocated (to_empty) and
    initialised (init_weights)."""
    f = cfg.fsdp
    order = init_order(model, units)  # before the wrappers below change the module tree
    outer = {b: b for b in blocks}  # the outermost module standing for each block
    if f.activation_checkpointing:
        outer.update(checkpoint_blocks(model, blocks[::f.ac_every]))
    if block_mode:
        parents = {c: (m, name) for m in model.modules() for name, c in m.named_children()}
        for b in blocks:
            parent, name = parents[outer[b]]
            outer[b] = torch.compile(outer[b], mode=block_mode)
            parent.register_module(name, outer[b])
    kw = dict(mesh=topo.mesh)
    if f.cpu_offload:  # pinned host memory needs a GPU
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=topo.device.type == "cuda")

    # Only the root casts its floating inputs to param_dtype, as FSDP1's MixedPrecision does. By
    # default FSDP2 casts every unit's, the fp32 rotary tables the blocks receive included (bf16
    # positions lose precision); the residual stream is already in param_dtype (it comes out of
    # the embedding and the blocks in it).
    def precision(cast_inputs):
        return MixedPrecisionPolicy(param_dtype=DTYPES[f.param_dtype], reduce_dtype=DTYPES[f.reduce_dtype],
                                    cast_forward_inputs=cast_inputs)
    reshard = fsdp2_reshards(f)
    sharded = [outer.get(u, u) for u in units]
    last = outer.get(blocks[-1]) if blocks else None
    for m in sharded:
        # The last block runs last in forward and first in backward: resharding it would free
        # parameters only to gather them again at once (torchtitan keeps it gathered too).
        fully_shard(m, reshard_after_forward=reshard and m is not last, mp_policy=precision(False), **kw)
    # The root (embedding, final norm, LM head) likewise: FSDP2's own default for the root.
    fully_shard(model, reshard_after_forward=False, mp_policy=precision(True), **kw)
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device="cpu" if f.cpu_offload else topo.device)
        init_weights(model, order, init_fn)
    if f.forward_prefetch:
        forward_prefetch_in_run_order(model, sharded)
    return model


def fsdp2_reshards(f):
    """FSDP2's reshard_after_forward for the units (FULL_SHARD and HYBRID_SHARD; the ZeRO-2
    strategies keep the gathered parameters until backward)."""
    return f.sharding_strategy in ("FULL_SHARD", "HYBRID_SHARD")


def forward_prefetch_in_run_order(root, units):
    """--forward-prefetch under FSDP2: each unit issues the next one's all-gather in forward
    (set_modules_to_forward_prefetch). The order is the first forward's, recorded by hooks that
    then remove themselves: the Free Transformer runs its latent sampler between two blocks."""
    order, handles = [], []

    def ran(module, args):
        if module not in order:
            order.append(module)

    def done(module, args, output):
        for h in handles:
            h.remove()
        for a, b in zip(order, order[1:]):
            a.set_modules_to_forward_prefetch([b])
    handles += [m.register_forward_pre_hook(ran) for m in [root] + units]
    handles.append(root.register_forward_hook(done))


def local_parameter_count(model):
    """Parameters held by this rank (a DTensor's numel is its global size)."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())


@contextlib.contextmanager
def fsdp2_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def gradient_sync(model, cfg, last):
    """Around one micro-batch's forward and backward (no_sync must cover both): gradients are
    reduced on the step's last micro-batch, or on every one under --grad-accum-mode sync.
    Between reductions FSDP1 holds full-size gradients in param_dtype, DDP in fp32 and FSDP2
    in reduce_dtype."""
    if last or cfg.train.grad_accum_mode == "sync" or cfg.train.strategy == "none":
        return contextlib.nullcontext()
    if cfg.train.strategy == "fsdp2":
        return fsdp2_no_sync(model)
    return model.no_sync()


def clip_gradients(model, cfg):
    """Global gradient norm (and clipping when --grad-clip > 0). FSDP1 must use its own
    clip_grad_norm_: torch.nn.utils' version only sees this rank's shard. Under FSDP2 the
    gradients are DTensors and torch.nn.utils' norm is a DTensor: its full value is the global
    norm (its local one only this rank's)."""
    limit = cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf")
    if cfg.train.strategy == "fsdp":
        return model.clip_grad_norm_(limit)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), limit)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def precision_context(cfg, device):
    """FSDP1 and FSDP2 cast through their mixed-precision policies (parameters and activations in
    param_dtype): what the model and compute_loss compute is in param_dtype unless they cast it,
    or --autocast adds autocast. DDP and one device use autocast with that dtype instead: the
    matrix products run in it, but the weights and the residual stream stay fp32, so their
    numerics are not FSDP's."""
    if not autocasts(cfg):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[cfg.fsdp.param_dtype])


def autocasts(cfg):
    """Whether forward and loss run under autocast (precision_context): below fp32, always outside
    FSDP, under FSDP with --autocast."""
    return cfg.fsdp.param_dtype != "fp32" and (cfg.train.strategy not in ("fsdp", "fsdp2") or cfg.fsdp.autocast)


def loss_precision(cfg):
    """The start-up line on the precision compute_loss runs in (precision_context)."""
    dtype = cfg.fsdp.param_dtype
    if dtype == "fp32":
        return "loss: compute_loss runs in fp32"
    if not autocasts(cfg):
        return (f"loss: compute_loss gets the model's {dtype} outputs (FSDP computes in {dtype}, no autocast): a loss "
                f"it does not compute in fp32 (this project's casts the logits) is {dtype}; --autocast runs "
                "cross_entropy, softmax and norms in fp32")
    return f"loss: compute_loss runs under autocast {dtype}: cross_entropy, softmax and norms in fp32"


def grad_scaler(cfg, device):
    """fp16 needs loss scaling (None for bf16 and fp32). FSDP1's scaler sees overflow in any
    shard; under FSDP2 the amp scaler does, through DTensor (it all-reduces found_inf)."""
    if cfg.fsdp.param_dtype != "fp16":
        return None
    if cfg.train.strategy == "fsdp":
        return ShardedGradScaler(device.type)
    return torch.amp.GradScaler(device.type)


def state_dict_options(purpose, device=None, meta=None):
    """Options of the state dicts; the DCP helpers serve FSDP1, FSDP2, DDP and one device alike.
    "sharded save" (the dcp/ of a sharded checkpoint described by `meta`): when FSDP1 shards, it
    builds each DTensor shard by gathering a unit's state and cloning this rank's rows, so on a
    GPU the state dicts would hold a second copy of the rank's weights and AdamW state in GPU
    memory for the whole save (+13 GiB a GPU at 8b on 4 GPUs: a model that trains at the memory
    limit would die at its first save); cpu_offload moves each shard to the host as it is made.
    Left on the GPU: FSDP2's shards, which are the parameters and optimizer state themselves;
    FSDP1 unsharded (NO_SHARD, or one process), whose optimizer state dict is the AdamW moments
    themselves; DDP's and one device's whole tensors (--async-save stages them straight into its
    pinned copy).
    "save": gathered to rank 0 on CPU (cpu_offload); a CPU-only run skips the offload: FSDP1 then
    frees the gathered storage before cloning it (a segfault, seen on torch 2.13 with gloo), so
    every rank gathers instead. "load": every rank reads the whole file. "init" (--init-from):
    keys the model does not have are left out."""
    if purpose == "sharded save":
        cfg = meta["config"]
        shards = cfg["train"]["strategy"] == "fsdp" and cfg["fsdp"]["sharding_strategy"] != "NO_SHARD"
        return StateDictOptions(cpu_offload=shards and meta["world_size"] > 1 and device.type == "cuda")
    if purpose == "save":
        return StateDictOptions(full_state_dict=True, cpu_offload=device.type != "cpu")
    return StateDictOptions(full_state_dict=True, strict=purpose != "init")


def check_strategy(cfg, topo=None):
    """What each strategy accepts: called with the settings alone (before anything is set up),
    then again with the topology (world size and device)."""
    t, f = cfg.train, cfg.fsdp
    if t.strategy in ("fsdp", "fsdp2"):
        if topo and "HYBRID" in f.sharding_strategy and topo.world % hybrid_shard_size(cfg, topo):
            raise BadInput(f"--hybrid-shard-size {hybrid_shard_size(cfg, topo)} must divide the world size "
                           f"{topo.world}")
    if t.strategy == "fsdp2":
        if f.sharding_strategy == "NO_SHARD":
            raise BadInput("--sharding-strategy NO_SHARD has no FSDP2 form (it is replication): use --strategy ddp")
    elif t.strategy == "fsdp":
        if f.cpu_offload and t.grad_accum_mode == "sync":
            raise BadInput("--grad-accum-mode sync with --cpu-offload: FSDP overwrites instead of accumulating "
                           "offloaded gradients outside no_sync; use --grad-accum-mode no_sync")
        if topo and topo.device.type == "cpu" and f.cpu_offload:
            raise BadInput("--cpu-offload needs a GPU: without one the parameters already live on the CPU "
                           "(and FSDP's pinned-memory offload cannot run)")
        if topo and topo.device.type == "cpu" and f.sync_module_states:
            raise BadInput("--sync-module-states needs a GPU: FSDP1 broadcasts only GPU tensors; on CPU "
                           "every rank already builds the same weights from --seed")
    elif t.strategy == "none":
        if f.reduce_dtype == "fp16" and f.param_dtype != "fp16":
            raise BadInput("--reduce-dtype fp16 without --param-dtype fp16 has no meaning here")
        if topo and topo.world > 1:
            raise BadInput(f"--strategy none with {topo.world} processes would train {topo.world} "
                           "unsynchronised copies; use --strategy fsdp or ddp, or launch one process")


def resolve_strategy(cfg, topo):
    """The strategy's part of resolve_config: settings it needs changed, said on rank 0."""
    t, f = cfg.train, cfg.fsdp

    def say(line):
        if topo.rank == 0:
            print(line)
    if t.strategy in ("fsdp", "fsdp2") and "HYBRID" in f.sharding_strategy and hybrid_shard_size(cfg, topo) == 1 \
            and topo.world > 1:
        # One process per shard group is pure replication, which is DDP's job. (FSDP1 would turn
        # the group into NO_SHARD and then skip the all-reduce across replicas, seen on torch
        # 2.13: the replicas would silently diverge.)
        say(f"{f.sharding_strategy} with 1 process per shard group is pure replication: using DDP "
            "(--strategy ddp) across all processes")
        t.strategy = "ddp"
    if t.strategy == "fsdp2" and topo.world == 1 and fsdp2_reshards(f) and not f.cpu_offload:
        # One process holds every shard: resharding after forward frees only the param_dtype copy
        # and gathers (copies) it again in backward. FSDP1 turns into NO_SHARD here for the same
        # reason; FSDP2's nearest form is SHARD_GRAD_OP (0.5-0.9 points of MFU at 1b). Not under
        # --cpu-offload: there resharding is what keeps the model off the GPU.
        say(f"--strategy fsdp2 with 1 process: {f.sharding_strategy} would reshard only to gather again in "
            "backward; using SHARD_GRAD_OP")
        f.sharding_strategy = "SHARD_GRAD_OP"
    if t.grad_accum_mode == "auto":
        # FSDP1's no_sync accumulates in param_dtype; syncing every micro-batch accumulates the
        # sharded gradient in reduce_dtype. FSDP2 and DDP accumulate in reduce_dtype / fp32 anyway.
        t.grad_accum_mode = "sync" if t.strategy == "fsdp" and not f.cpu_offload else "no_sync"
        if t.strategy == "fsdp" and f.cpu_offload and f.param_dtype != f.reduce_dtype:
            say(f"--cpu-offload: accumulating with no_sync (FSDP1 offload allows no other), in {f.param_dtype}")
    if t.strategy == "fsdp" and t.compile and not f.use_orig_params:
        f.use_orig_params = True
        say("--compile: setting use_orig_params=True (FSDP1 + torch.compile requires it)")


def describe_strategy(cfg, one=False):
    """(headline, notes) of the start-up summary: what the strategy does with which dtypes, and
    settings that have no effect under it."""
    t, f = cfg.train, cfg.fsdp
    notes = []
    defaults = dataclasses.asdict(FSDPConfig())
    changed = {k: v for k, v in dataclasses.asdict(f).items() if v != defaults[k]}
    if t.strategy == "fsdp":
        headline = (f"strategy fsdp {f.sharding_strategy} wrap={f.auto_wrap} prefetch={f.backward_prefetch} | "
                    f"dtypes param={f.param_dtype} reduce={f.reduce_dtype} buffer={f.buffer_dtype}")
        if not f.use_orig_params and t.weight_decay > 0:
            notes.append("use_orig_params=False: FSDP flattens parameters, so weight decay applies to all of them "
                         "(norm weights too); pass --use-orig-params to exempt 1-D weights")
        return headline, notes
    if t.strategy == "fsdp2":
        reshard = fsdp2_reshards(f)
        # one: the model is one unit, the root, which FSDP2 keeps gathered after forward
        kept = "" if not reshard else " except the root" + (" and last block" if f.auto_wrap != "size" and not one
                                                            else "")
        headline = (f"strategy fsdp2 {f.sharding_strategy} (reshard_after_forward={reshard}{kept}) wrap={f.auto_wrap}"
                    f"{' forward_prefetch' if f.forward_prefetch else ''}{' cpu_offload' if f.cpu_offload else ''} | "
                    f"dtypes param={f.param_dtype} reduce={f.reduce_dtype}")
        ignored = [f"{flag_name(k)} {v}" for k, v in changed.items() if k in FSDP2_IGNORED]
        if ignored:
            notes.append(f"with --strategy fsdp2 these FSDP1 settings have no effect: {', '.join(ignored)} (FSDP2 "
                         "prefetches the next unit in backward, keeps the original parameters, needs no all-gather "
                         "limit, has no buffer dtype; every rank builds the same weights from --seed)")
        return headline, notes
    headline = f"strategy {t.strategy} | autocast {f.param_dtype} (reduce/buffer dtypes apply to FSDP only)"
    # Said, not refused: a config written for FSDP may be rerun as DDP to compare.
    ignored = [f"{flag_name(k)} {v}" for k, v in changed.items() if k in FSDP_ONLY]
    if ignored:
        notes.append(f"with --strategy {t.strategy} these FSDP settings have no effect: {', '.join(ignored)}")
    return headline, notes


# =============================================================================================
# Optimizer and schedule


@dataclass(frozen=True)
class Plan:
    """The batch layout and the length of the run: global batch = micro x world x accum."""

    micro: int  # sequences per rank per forward
    accum: int  # micro-batches per optimizer step
    seq_len: int
    tokens_per_step: int
    max_steps: int
    peak_lr: float


def plan_run(cfg, topo, data):
    """The Plan of a resolved config (checked by check_world: the global batch divides)."""
    t = cfg.train
    micro = t.micro_batch or t.global_batch // topo.world
    return Plan(micro=micro, accum=t.global_batch // (micro * topo.world), seq_len=data.seq_len,
                tokens_per_step=t.global_batch * data.seq_len,
                max_steps=t.max_steps, peak_lr=peak_lr(t))


def peak_lr(t):
    """--lr, scaled by global_batch / --lr-scale-base-batch when that is set."""
    return t.lr * (t.global_batch / t.lr_scale_base_batch if t.lr_scale_base_batch else 1.0)


def unwrapped_name(name):
    """A parameter's name in the plain model, whatever FSDP, DDP, checkpointing or compile added."""
    for wrapper in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(wrapper, "")
    return name.removeprefix("module.")


def build_optimizer(model, cfg, lr, device, decay_names):
    """AdamW with weight decay on the >= 2-D weights (decay_names, taken before wrapping: FSDP1
    exposes sharded parameters as 1-D views). With use_orig_params=False FSDP1 flattens each
    unit's parameters into one FlatParameter (named _flat_param), so decay cannot be told apart:
    it then goes to all."""
    named = [(unwrapped_name(n), p) for n, p in model.named_parameters() if p.requires_grad]
    if any(n.endswith("_flat_param") for n, _ in named):
        groups = [{"params": [p for _, p in named], "weight_decay": cfg.train.weight_decay}]
    else:
        groups = [{"params": [p for n, p in named if n in decay_names], "weight_decay": cfg.train.weight_decay},
                  {"params": [p for n, p in named if n not in decay_names], "weight_decay": 0.0}]
    # Fused AdamW needs the parameters on the GPU, and it rejects ShardedGradScaler's found_inf
    # (shape [1], seen on torch 2.11), so fp16 takes the foreach implementation.
    fused = device.type == "cuda" and not cfg.fsdp.cpu_offload and cfg.fsdp.param_dtype != "fp16"
    return torch.optim.AdamW(groups, lr=lr, betas=(cfg.train.beta1, cfg.train.beta2), fused=fused)


def lr_at(step, peak, cfg, max_steps):
    """The rate of step `step` (from 0) of a run of max_steps: a linear warmup, then cosine: decay
    reaching min_lr_ratio * peak at step --lr-decay-steps (the run's first max_steps), that rate
    after it; wsd: the peak, then a linear decay over the last --lr-decay-steps steps to
    min_lr_ratio * peak at the last step. (--lr-decay-steps 0 here: the default for max_steps.)"""
    t, floor = cfg.train, cfg.train.min_lr_ratio
    if step < t.warmup_steps:
        return peak * (step + 1) / t.warmup_steps
    if t.lr_schedule == "wsd":
        decay = t.lr_decay_steps or max(1, max_steps // 5)
        return peak * (1 - (1 - floor) * min(1.0, max(0.0, (step + 1 - max_steps + decay) / decay)))
    progress = (step - t.warmup_steps) / max(1, (t.lr_decay_steps or max_steps) - 1 - t.warmup_steps)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def schedule_change(cfg, before, start):
    """What a resume at step `start` with another --max-steps or schedule does to the rates (one
    line): the steps the run had planned whose rate changes, and the steps added. `before`: the
    saved run's [train] table (runs saved before --lr-schedule: cosine over their max_steps)."""
    t, peak = cfg.train, peak_lr(cfg.train)
    old_steps = before.get("max_steps") or t.max_steps
    old = dataclasses.replace(cfg, train=dataclasses.replace(t, lr_schedule=before.get("lr_schedule", "cosine"),
                                                             lr_decay_steps=before.get("lr_decay_steps") or 0))
    planned = range(start, min(old_steps, t.max_steps))
    moved = [s for s in planned if not math.isclose(lr_at(s, peak, old, old_steps), lr_at(s, peak, cfg, t.max_steps))]
    if moved:
        s = moved[0]
        parts = [f"steps {s + 1}-{moved[-1] + 1} of the plan change rate (step {s + 1}: "
                 f"{lr_at(s, peak, old, old_steps):.2e} -> {lr_at(s, peak, cfg, t.max_steps):.2e})"]
    else:
        parts = [f"steps {start + 1}-{planned[-1] + 1} keep their planned rates"] if planned else []
    if t.max_steps > old_steps:
        parts.append(f"steps {old_steps + 1}-{t.max_steps} are added, at {lr_at(old_steps, peak, cfg, t.max_steps):.2e}"
                     f" to {lr_at(t.max_steps - 1, peak, cfg, t.max_steps):.2e}")
    return f"learning rate ({t.lr_schedule}, lr_decay_steps {t.lr_decay_steps}): " + "; ".join(parts or ["unchanged"])


# =============================================================================================
# Training step and evaluation


def micro_batches(data, step, cfg, plan, topo):
    """This rank's micro-batches of step `step` on its device, and the seconds spent fetching
    them. Micro-batch m of rank r is rows [(m * world + r) * micro, ... + micro) of the step's
    global batch."""
    t0 = time.perf_counter()
    batches = []
    for m in range(plan.accum):
        start = (m * topo.world + topo.rank) * plan.micro
        x, y = data.train_batch(step, cfg.train.global_batch, start, plan.micro)
        batches.append((x.to(topo.device, non_blocking=True), y.to(topo.device, non_blocking=True)))
    return batches, time.perf_counter() - t0


def train_step(model, optimizer, scaler, batches, cfg, loss_fn):
    """One optimizer step over the micro-batches. Each micro-batch loss is divided by their
    number, so the summed gradient equals the gradient of the mean loss over the global batch.
    Returns (mean losses, global gradient norm, whether the step was skipped)."""
    totals, accum = {}, len(batches)
    for m, (x, y) in enumerate(batches):
        new_graph_step(cfg)
        with gradient_sync(model, cfg, last=m == accum - 1):
            with precision_context(cfg, x.device):
                loss, parts = loss_fn(model, x, y, cfg)
            scaled = loss / accum
            (scaler.scale(scaled) if scaler else scaled).backward()
        for k, v in {"loss": loss.detach(), **parts}.items():
            totals[k] = totals.get(k, 0.0) + v.float() / accum
    if scaler:
        scaler.unscale_(optimizer)
    grad_norm = clip_gradients(model, cfg)
    # The norm is global (the same on every rank), so every rank takes the same decision.
    skipped = cfg.train.skip_nonfinite and scaler is None and not torch.isfinite(grad_norm).item()
    if scaler:
        scaler.step(optimizer)  # skips the step itself when the scaled gradients overflowed
        scaler.update()
    elif not skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return totals, grad_norm, skipped


def new_graph_step(cfg):
    """A new forward begins: under CUDA graphs (--compile-mode reduce-overhead) the memory of the
    last replay's outputs, all read by now, may be reused. Nothing to do without graphs."""
    if cfg.train.compile:
        torch.compiler.cudagraph_mark_step_begin()


@torch.no_grad()
def evaluate(model, data, cfg, topo, micro, loss_fn):
    """Mean loss over the fixed validation rows, world-size independent. Every rank runs the
    same number of forwards (FSDP forwards are collectives); a rank with no rows left runs a
    dummy row weighted 0."""
    n = min(cfg.train.eval_samples, data.n_val)
    model.eval()
    sums = {}
    for chunk in range(0, n, micro * topo.world):
        start = chunk + topo.rank * micro
        count = max(0, min(micro, n - start))
        x, y = data.val_batch(start if count else 0, count or 1)
        new_graph_step(cfg)
        with precision_context(cfg, topo.device):
            loss, parts = loss_fn(model, x.to(topo.device), y.to(topo.device), cfg)
        for k, v in {"loss": loss, **parts}.items():
            sums[k] = sums.get(k, 0.0) + v.float() * count
    model.train()
    return all_reduce_scalars({k: v / n for k, v in sums.items()}, topo.device)


def all_reduce_scalars(values, device, op=dist.ReduceOp.SUM):
    """{name: scalar tensor or number} reduced over all ranks in one collective, as floats."""
    keys = sorted(values)
    vec = torch.stack([torch.as_tensor(values[k], device=device) for k in keys])
    dist.all_reduce(vec, op=op)
    return dict(zip(keys, vec.tolist()))


# The first step whose loss is not finite, tracked on the device without a sync per step and
# checked (a collective) at log steps and before every save.
NEVER = 2 ** 62


def note_nonfinite(first_bad, step, loss, grad_norm=None):
    """first_bad, or `step` when it is the first whose loss (or gradient norm) is not finite."""
    finite = torch.isfinite(loss)
    if grad_norm is not None:
        finite &= torch.isfinite(grad_norm.to(loss.device))
    return torch.where(~finite & (first_bad == NEVER), step, first_bad)


def check_finite(first_bad):
    """RunFailed on every rank when any rank has seen a non-finite loss (a collective)."""
    worst = first_bad.clone()
    dist.all_reduce(worst, op=dist.ReduceOp.MIN)
    if worst.item() != NEVER:
        raise RunFailed(f"the loss or its gradient became NaN/inf at step {worst.item()}; stopped without "
                        "saving that state (the latest checkpoint is still the last good one); lower --lr or "
                        "pass --skip-nonfinite")


# =============================================================================================
# Checkpoints
#
# run_dir/checkpoints/step_0000100/   one complete checkpoint, made visible by an atomic rename
#     meta.json         step, tokens seen, type, world size, config, tokenizer, scaler, file sizes
#     dcp/              sharded: torch.distributed.checkpoint files (model + optimizer), any world size
#     model.pt          full: consolidated model (+ optimizer); also written at the end of a sharded run
#     rng_rank{r}.pt    every RNG state of rank r (torch CPU and CUDA, numpy, Python)
# run_dir/checkpoints/latest          the newest complete checkpoint's name, written last
#
# A save writes into checkpoints/.tmp-step_N and renames it when every rank has finished, so a
# process killed at any moment leaves the previous checkpoint as latest. FSDP's legacy
# LOCAL_STATE_DICT is not offered: it is tied to one world size and flattening, and DCP's
# sharded format supersedes it.


def checkpoint_path(run_dir, step):
    return os.path.join(run_dir, "checkpoints", f"step_{step:07d}")


def staging_path(path):
    """Where the checkpoint `path` is written before the rename that publishes it."""
    return os.path.join(os.path.dirname(path), ".tmp-" + os.path.basename(path))


def checkpoint_meta(cfg, step, tokens_seen, tokenizer, scaler, world, val_loss=None, digests=None):
    """What meta.json holds besides the file sizes (publish_checkpoint adds those). `val_loss`:
    the validation loss of this very step, when it was evaluated (what --keep-best compares);
    `digests`: the data's (BatchSource), which a resume compares."""
    return {"step": step, "tokens_seen": tokens_seen, "type": cfg.checkpoint.checkpoint_type, "world_size": world,
            "config": dataclasses.asdict(cfg), "tokenizer": tokenizer,
            "scaler": scaler.state_dict() if scaler else None, "val_loss": val_loss, "data": digests}


def consolidated_payload(state, meta):
    """The single-file format: torch.load(path, weights_only=True)["model"] loads into an unwrapped model."""
    return {"model": state, "config": meta["config"], "step": meta["step"], "tokens_seen": meta["tokens_seen"],
            "tokenizer": meta["tokenizer"]}


def fsync_path(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path, text):
    with open(path + ".tmp", "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(path + ".tmp", path)


def sharded_state(model, optimizer, options=None):
    """What a sharded checkpoint's dcp/ holds, to save or to load into: the model's and the
    optimizer's state dicts (each rank its shards under FSDP; collectives)."""
    return {"model": get_model_state_dict(model, options=options),
            "optim": get_optimizer_state_dict(model, optimizer, options=options)}


def write_rng_state(tmp, rank):
    """This rank's RNG states into the checkpoint being written in `tmp`, on disk before it returns."""
    path = os.path.join(tmp, f"rng_rank{rank}.pt")
    torch.save(rng_state(), path)
    fsync_path(path)


def rng_state():
    """Every RNG state as tensors and lists of plain numbers, which torch.load reads with
    weights_only=True (numpy's own state holds an array, a pickled class)."""
    key, numpy_keys, *numpy_rest = np.random.get_state()
    version, python_keys, gauss_next = random.getstate()
    return {"torch": torch.get_rng_state(), "numpy": [key, numpy_keys.tolist(), *numpy_rest],
            "python": [version, list(python_keys), gauss_next],
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def set_rng_state(state):
    """rng_state() back, or what releases before it saved (tuples, numpy's keys as an array)."""
    torch.set_rng_state(state["torch"])
    key, numpy_keys, *numpy_rest = state["numpy"]
    np.random.set_state((key, np.asarray(numpy_keys, dtype=np.uint32), *numpy_rest))
    version, python_keys, gauss_next = state["python"]
    random.setstate((version, tuple(python_keys), gauss_next))
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(path, meta, model, optimizer, c, topo, consolidate=False):
    """Save on every rank (state dicts and DCP are collectives) the checkpoint `path` described
    by `meta` (checkpoint_meta); `c`: the checkpoint settings. `consolidate` also writes the
    single-file model.pt next to a sharded checkpoint (done at the end of training)."""
    rank, tmp = topo.rank, make_staging_dir(path, meta, topo)
    error = None
    try:
        if meta["type"] == "sharded":
            opts = state_dict_options("sharded save", topo.device, meta)
            dcp.save(sharded_state(model, optimizer, opts), checkpoint_id=os.path.join(tmp, "dcp"))
        if meta["type"] == "full" or consolidate:
            opts = state_dict_options("save", topo.device)
            full = consolidated_payload(get_model_state_dict(model, options=opts), meta)
            if meta["type"] == "full" and c.full_optimizer:
                full["optim"] = get_optimizer_state_dict(model, optimizer, options=opts)
            if rank == 0:
                torch.save(full, os.path.join(tmp, "model.pt"))
                fsync_path(os.path.join(tmp, "model.pt"))
        write_rng_state(tmp, rank)
    except (Exception, CheckpointException) as e:  # a full disk on one rank must stop every rank, not
        # hang them (DCP's CheckpointException derives from BaseException, not Exception)
        error = error_text(e, rank, tmp)
    stop_if_save_failed(error, path, meta, topo)
    return publish_everywhere(path, meta, c, topo)


def error_text(e, rank, path=None):
    """`rank R: Type: message` of an exception raised on `rank` (writing into `path`). DCP's
    CheckpointException names only the failing ranks in its first line: the cause (e.g. OSError: No
    space left on device) is the first failing rank's own error, which every rank receives. A write
    that fails inside torch.save reads "unexpected pos" instead (the OSError, its context, stays on
    the rank that wrote): a file system of `path` left with no space is then named."""
    if isinstance(e, CheckpointException) and e.failures:
        rank, (e, _) = next(iter(e.failures.items()))
    text = f"rank {rank}: {type(e).__name__}: {e}".splitlines()[0]
    free = shutil.disk_usage(path).free if path and os.path.exists(path) else None
    if not isinstance(e, OSError) and free is not None and free < 2 ** 20:
        text += f" (its file system is full: {free:,} bytes free)"
    return text


def save_failed(meta, error):
    return RunFailed(f"saving the checkpoint of step {meta['step']} failed ({error.splitlines()[0]}); the previous "
                     "checkpoint is intact")


def make_staging_dir(path, meta, topo):
    """Rank 0 makes the empty staging directory of `path`; every rank returns it, or raises
    RunFailed on every rank. Also the barrier: no rank writes before the directory exists."""
    tmp, error = staging_path(path), None
    if topo.rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as e:
            error = f"{e.strerror}: {e.filename}"
    error = any_rank_error(error, topo)
    if error:
        raise save_failed(meta, error)
    return tmp


def stop_if_save_failed(error, path, meta, topo):
    """`error`: this rank's write error or None. When any rank has one, every rank raises
    RunFailed, rank 0 having deleted the staging directory (the previous checkpoint is untouched)."""
    error = any_rank_error(error, topo)
    if error:
        if topo.rank == 0:
            shutil.rmtree(staging_path(path), ignore_errors=True)
        raise save_failed(meta, error)


def publish_everywhere(path, meta, c, topo):
    """Once every rank has written its files: rank 0 publishes (publish_checkpoint), every rank
    learns whether that worked. Returns path."""
    error = None
    if topo.rank == 0:
        try:
            publish_checkpoint(path, meta, c.keep_checkpoints, c.keep_best)
        except OSError as e:
            shutil.rmtree(staging_path(path), ignore_errors=True)
            error = f"{e.strerror}: {e.filename}"
    error = any_rank_error(error, topo)
    if error:
        raise save_failed(meta, error)
    return path


@dataclass
class PendingSave:
    """An --async-save checkpoint that DCP is writing in the background."""

    path: str
    meta: dict
    future: object  # DCP's future of this rank's write (and of the save's collectives)
    started: float  # time.perf_counter() when it was handed over


@dataclass(frozen=True)
class AsyncSaver:
    """What --async-save keeps for the whole run (async_saver)."""

    group: object  # a gloo group of the background writer's own
    writer: object  # one DCP writer for every save: it also stages the state to host memory


def async_saver(c, topo):
    """--async-save's pieces, made once per run on every rank (None without it). The writer's
    collectives run in another thread: on training's group they could interleave with training's,
    so they get a gloo group of their own. On a GPU the writer keeps a pinned host copy of this
    rank's state between saves (allocated at the first): later saves stage at copy speed instead
    of page-faulting in fresh host memory (1b on one H100: BENCHMARKS.md)."""
    if not (c.async_save and c.save_every):
        return None
    return AsyncSaver(dist.new_group(backend="gloo"),
                      dcp.FileSystemWriter(".",  # each save names its own directory (checkpoint_id)
                                           cache_staged_state_dict=topo.device.type == "cuda"))


def start_async_save(path, meta, model, optimizer, topo, saver):
    """--async-save: on every rank, stage the sharded model and optimizer state to CPU and hand
    them to DCP's background writer (dcp.async_save), which returns once the copy is made, so
    training may change the weights at once (the previous save has ended: one at a time, so the
    writer's staged copy is free to reuse). The RNG states are written here, synchronously (they
    are small). async_save_done, then publish_everywhere, finish it at a later step boundary."""
    tmp, error, future = make_staging_dir(path, meta, topo), None, None
    try:
        opts = state_dict_options("sharded save", topo.device, meta)
        state = sharded_state(model, optimizer, opts)
        # Given the writer, DCP stages through it: a blocking copy to host memory.
        future = dcp.async_save(state, checkpoint_id=os.path.join(tmp, "dcp"), storage_writer=saver.writer,
                                process_group=saver.group)
        # Releases that stage in the background as well return a pair of futures: the write's is the one.
        future = getattr(future, "upload_completion", future)
        write_rng_state(tmp, topo.rank)
    except (Exception, CheckpointException) as e:
        error = error_text(e, topo.rank, tmp)
    stop_if_save_failed(error, path, meta, topo)
    return PendingSave(path, meta, future, time.perf_counter())


def async_save_done(pending, topo, wait=False):
    """At a step boundary, on every rank (a small all-reduce over the control group): True once
    every rank's background write of `pending` has completed; `wait`: first wait for this rank's.
    A write that failed on any rank raises RunFailed on every rank (save_failed's one line)."""
    if wait:
        pending.future.exception()  # blocks until the write has ended, whatever its outcome
    done = pending.future.done()
    e = pending.future.exception() if done else None
    error = error_text(e, topo.rank, staging_path(pending.path)) if e is not None else None
    flags = torch.tensor([int(not done), int(error is not None)])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=topo.control)
    if flags[1].item():
        stop_if_save_failed(error, pending.path, pending.meta, topo)
    return flags[0].item() == 0


def finish_background_save(pending, c, topo, log, wait=False):
    """On every rank at a step boundary: publish a --async-save checkpoint once every rank has
    written it (wait: first wait for this rank's write). Returns the save still under way, or None."""
    if pending is None:
        return None
    t0 = time.perf_counter()
    if not async_save_done(pending, topo, wait=wait):
        return pending
    publish_everywhere(pending.path, pending.meta, c, topo)
    waited = f"; waited {time.perf_counter() - t0:.1f} s for its end" if wait else ""
    log.line(f"saved {pending.path} in the background, {time.perf_counter() - pending.started:.1f} s after it "
             f"was staged{waited}")
    return None


def follow_marker(path):
    """RUN/checkpoints/latest or RUN/checkpoints/best (a file holding a checkpoint's name) ->
    that checkpoint's directory; any other path unchanged."""
    if os.path.basename(path.rstrip("/")) in ("latest", "best") and os.path.isfile(path):
        with open(path) as fh:
            return os.path.join(os.path.dirname(path), fh.read().strip())
    return path


def mark_best(root, keep_best):
    """checkpoints/best names the complete checkpoint of lowest validation loss (meta.json's
    val_loss; ties: the earlier step) among those that pass check_checkpoint (a damaged best gives
    way, said), written atomically like `latest`; without --keep-best, or with no such checkpoint,
    it is removed (nothing would keep the checkpoint it names). Returns that name, or None."""
    marker = os.path.join(root, "best")
    previous = os.path.basename(follow_marker(marker)) if os.path.isfile(marker) else None
    scored = []
    for name in complete_checkpoints(root) if keep_best else []:
        try:
            loss = check_checkpoint(os.path.join(root, name)).get("val_loss")
        except RunFailed as e:
            if name == previous:
                tqdm.write(f"{e}: {marker} no longer names it")
            continue
        if isinstance(loss, (int, float)) and math.isfinite(loss):
            scored.append((loss, name))
    if not scored:
        if os.path.exists(marker):
            os.remove(marker)
        return None
    best = min(scored)[1]
    if follow_marker(marker) != os.path.join(root, best):
        write_text_atomic(marker, best + "\n")
    return best


def publish_checkpoint(path, meta, keep, keep_best=False):
    """Rank 0, once every rank has written its files into staging_path(path): meta.json with
    the file sizes, the atomic rename, `latest`, `best` (mark_best), then pruning to the newest
    `keep` and the best."""
    tmp, root, name = staging_path(path), os.path.dirname(path), os.path.basename(path)
    files = {os.path.relpath(os.path.join(d, f), tmp): os.path.getsize(os.path.join(d, f))
             for d, _, fs in os.walk(tmp) for f in fs}
    write_text_atomic(os.path.join(tmp, "meta.json"), json.dumps({**meta, "files": files}, indent=1))
    shutil.rmtree(path + ".old", ignore_errors=True)  # left by a save killed mid-swap
    if os.path.exists(path):  # the same step saved again (after a resume): swap, then delete
        os.replace(path, path + ".old")
    os.replace(tmp, path)
    fsync_path(root)
    write_text_atomic(os.path.join(root, "latest"), name + "\n")  # last: it names a complete checkpoint
    shutil.rmtree(path + ".old", ignore_errors=True)
    best = mark_best(root, keep_best)
    for old in complete_checkpoints(root)[keep:]:
        if old not in (name, best):
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)


def complete_checkpoints(root):
    """Names of renamed (complete) checkpoint directories, newest save first. By save time, not
    by step: after resuming from an older checkpoint, the new saves are the ones to keep."""
    if not os.path.isdir(root):
        return []
    names = [n for n in os.listdir(root) if n.startswith("step_") and not n.endswith(".old")]

    def saved_at(name):
        meta = os.path.join(root, name, "meta.json")
        return (os.path.getmtime(meta) if os.path.exists(meta) else 0.0, name)
    return sorted(names, key=saved_at, reverse=True)


def check_checkpoint(path):
    """The checkpoint's meta if every file it lists is there with its size, else raise RunFailed."""
    try:
        with open(os.path.join(path, "meta.json")) as fh:
            meta = json.load(fh)
        for rel, size in meta["files"].items():
            actual = os.path.getsize(os.path.join(path, rel))
            if actual != size:
                raise RunFailed(f"{rel} has {actual} bytes, {size} expected (truncated?)")
        return meta
    except RunFailed as e:
        raise RunFailed(f"checkpoint {path} is incomplete or corrupted: {e}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise RunFailed(f"checkpoint {path} is incomplete or corrupted: {type(e).__name__}: {e}")


def find_resume_checkpoint(run_dir, notes, skip=()):
    """(path, meta) of the latest complete checkpoint of a run directory, falling back to older
    ones (saying so) when the newest is corrupted; (None, None) when there is none. `skip`: paths
    that passed this check but failed to load."""
    root = os.path.join(run_dir, "checkpoints")
    names = complete_checkpoints(root)
    try:
        with open(os.path.join(root, "latest")) as fh:
            latest = fh.read().strip()
        names = [latest] + [n for n in names if n != latest]
    except OSError:
        pass
    for name in names:
        if os.path.join(root, name) in skip:
            continue
        try:
            return os.path.join(root, name), check_checkpoint(os.path.join(root, name))
        except RunFailed as e:
            notes.append(f"{e}; trying an older checkpoint")
    return None, None


# Loading never runs code from a checkpoint, which may come from anyone (--init-from a
# colleague's run, a run directory copied from a shared filesystem). The .pt files are read
# with weights_only=True; DCP's .metadata, a plain pickle, by RestrictedUnpickler. A file that
# asks for anything else is refused (BadInput) before anything in it runs.

# The globals of DCP metadata: those of real checkpoints of every strategy (none, ddp, fsdp and
# fsdp2, HSDP, 1-4 processes, fp16, optimizer state), recorded by unpickling their .metadata, and
# every torch dtype. Each only builds a value; callables that could run code are not among them.
DCP_METADATA_GLOBALS = {("torch.distributed.checkpoint.metadata", name) for name in (
    "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
    "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath")} | {
    ("torch", name) for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
# What an RNG file of releases before rng_state() holds besides tensors: numpy's array, rebuilt
# by its _reconstruct (named numpy._core... by numpy 2, numpy.core... by numpy 1).
NUMPY_ARRAY_GLOBALS = [np.ndarray, np.dtype, type(np.dtype(np.uint32))] + [
    (np.ndarray(0).__reduce__()[0], f"numpy.{core}.multiarray._reconstruct") for core in ("_core", "core")]


def refusal(path, name):
    return (f"refused to load {path}: it asks for {name}, which no checkpoint holds (a pickle that can run "
            "code); nothing in it was run")


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles only the globals `allowed` ((module, name) pairs); any other refuses the file
    `path` (BadInput), checked before its module is imported."""

    def __init__(self, file, path, allowed):
        super().__init__(file)
        self.path, self.allowed = path, allowed

    def find_class(self, module, name):
        if (module, name) not in self.allowed:
            raise BadInput(refusal(self.path, f"{module}.{name}"))
        return super().find_class(module, name)


def load_weights_only(path, name=None, **kwargs):
    """torch.load with weights_only=True: tensors and plain values. A file (or a file object, named
    by `name`) that asks for any other global is refused (BadInput); bytes that are no pickle at
    all raise as torch raised them."""
    name = name or path
    try:
        return torch.load(path, map_location="cpu", weights_only=True, **kwargs)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL (\S+)", str(e))  # how torch names a global it does not admit
        if found:
            raise BadInput(refusal(name, found[1])) from None
        with open(path, "rb") if isinstance(path, str) else contextlib.nullcontext(path) as fh:
            fh.seek(0)  # a plain pickle torch does not parse (protocol 4, say)
            try:
                RestrictedUnpickler(fh, name, set()).load()  # refuses it at its first global
            except BadInput:
                raise
            except Exception:  # not a pickle either: damaged
                pass
        raise


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, except that a checkpoint's non-tensor entries (the optimizer's
    param_groups: lr, betas, ...) are read by load_weights_only: DCP's own planner unpickles them
    with weights_only=False, so a doctored .distcp file could run code."""

    def load_bytes(self, read_item, value):
        obj = load_weights_only(value, name=f"the entry {read_item.dest_index.fqn} of a .distcp file")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def dcp_load(state, dcp_dir):
    """dcp.load that runs no code from the checkpoint: its metadata through MetadataCheckingReader,
    its non-tensor entries through WeightsOnlyLoadPlanner. A refusal on any rank is BadInput (DCP
    wraps what load_bytes raises in a CheckpointException)."""
    try:
        dcp.load(state, storage_reader=dcp_reader(dcp_dir), planner=WeightsOnlyLoadPlanner())
    except CheckpointException as e:
        refused = [exc for exc, _ in e.failures.values() if isinstance(exc, BadInput)]
        if refused:
            raise refused[0] from None
        raise


class MetadataCheckingReader(dcp.FileSystemReader):
    """DCP's FileSystemReader with .metadata read by RestrictedUnpickler. The rest is its
    read_metadata as of torch 2.13: the same file (or a rank's own), storage_meta and load_id;
    storage_data and version are fields of the metadata, read as they are."""

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as fh:
            metadata = RestrictedUnpickler(fh, str(path), DCP_METADATA_GLOBALS).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def dcp_reader(dcp_dir):
    """The storage reader for dcp.load, its metadata read once here: a refusal inside dcp.load
    would be logged there and taken for missing metadata."""
    reader = MetadataCheckingReader(dcp_dir)
    reader.read_metadata()
    return reader


def load_checkpoint(path, model, optimizer, scaler, cfg, topo):
    """Restore model, optimizer, scaler and RNG states; returns the checkpoint's meta. A sharded
    checkpoint loads at any world size and sharding strategy (DCP reshards). A file that has its
    size but not its content fails here, on some ranks or all: every rank raises RunFailed (a
    refused one, see load_weights_only: BadInput)."""
    meta = check_checkpoint(path)
    error = None  # (message, what it is: "failed", "refused" or "unreadable") of this rank
    try:
        load_states(path, meta, model, optimizer, scaler, topo, cfg.train.seed)
    except RunFailed as e:  # readable, but not resumable (e.g. saved without optimizer state)
        error = (str(e), "failed")
    except BadInput as e:  # a file that asks to run code: stop, not an older checkpoint instead
        error = (str(e), "refused")
    except (torch.OutOfMemoryError, MemoryError) as e:  # the files may be fine: no fallback
        error = (f"loading {path} failed on rank {topo.rank}: {type(e).__name__}: {e}", "failed")
    except (Exception, CheckpointException) as e:  # bytes that do not load (CheckpointException is
        # a BaseException)
        error = (f"rank {topo.rank}: {type(e).__name__}: {e}", "unreadable")
    error = any_rank_error(error, topo)
    if error and error[1] == "unreadable":
        raise CorruptCheckpoint(f"checkpoint {path} is incomplete or corrupted: {error[0].splitlines()[0]}")
    if error:
        raise (BadInput if error[1] == "refused" else RunFailed)(error[0].splitlines()[0])
    return meta


def load_states(path, meta, model, optimizer, scaler, topo, seed):
    if meta["type"] == "sharded":
        # get_optimizer_state_dict initialises empty optimizer state first, so DCP has tensors to
        # load into even before the first step (otherwise resharding fails on missing keys).
        state = sharded_state(model, optimizer)
        dcp_load(state, os.path.join(path, "dcp"))
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"])
    else:
        payload = load_weights_only(os.path.join(path, "model.pt"), mmap=True)
        if "optim" not in payload:
            raise RunFailed(f"{path} holds no optimizer state (saved with --no-full-optimizer); start a new run "
                            "from its weights with --init-from instead")
        opts = state_dict_options("load")
        set_model_state_dict(model, payload["model"], options=opts)
        set_optimizer_state_dict(model, optimizer, payload["optim"], options=opts)
    if scaler and meta["scaler"]:
        scaler.load_state_dict(meta["scaler"])
    rng_file = os.path.join(path, f"rng_rank{topo.rank}.pt")
    if meta["world_size"] == topo.world:
        with torch.serialization.safe_globals(NUMPY_ARRAY_GLOBALS):  # files of earlier releases: exact too
            set_rng_state(load_weights_only(rng_file))
    else:  # other ranks, other streams: seed them from the step so the run stays reproducible
        torch.manual_seed(seed + topo.rank + 1_000_003 * meta["step"])


def load_resume_checkpoint(path, model, optimizer, scaler, cfg, topo, log):
    """load_checkpoint; under --resume auto a checkpoint that fails to load (a file with the right
    size and the wrong bytes) gives way to the next older complete one, saying so. Returns the
    path loaded and its meta."""
    failed, run_dir = [], cfg.train.out_dir
    while True:
        try:
            meta = load_checkpoint(path, model, optimizer, scaler, cfg, topo)
        except CorruptCheckpoint as e:
            if cfg.checkpoint.resume != "auto":
                raise
            failed.append(path)
            path, _ = agree(lambda: find_resume_checkpoint(run_dir, [], skip=failed), topo.rank)
            if path is None:
                raise RunFailed(f"{e}; no older complete checkpoint in {run_dir}: start from its weights with "
                                "--init-from, or afresh with --overwrite (which deletes its checkpoints)")
            log.line(f"{e}; trying an older checkpoint")
            continue
        if failed:  # resumed from an older step than planned: its later records will be logged again
            log.keep_metrics_until(meta["step"])
        return path, meta


def checkpoint_weights(path):
    """(kind, location) of the weights of a run dir, a step dir (or RUN/checkpoints/best or
    latest) or a model.pt, for --init-from. A checkpoint (a directory with meta.json) must pass
    the size check of a resume: a damaged one is reported before anything is written."""
    path = follow_marker(path)
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    if os.path.isfile(os.path.join(folder, "meta.json")):
        try:
            check_checkpoint(folder)
        except RunFailed as e:
            raise BadInput(f"--init-from {path}: {e}")
    if os.path.isfile(path):
        return "full", path
    if os.path.isdir(os.path.join(path, "checkpoints")):
        found, _ = find_resume_checkpoint(path, [])
        if found is None:
            raise BadInput(f"--init-from {path}: the run directory holds no complete checkpoint")
        path = found
    if os.path.isfile(os.path.join(path, "model.pt")):
        return "full", os.path.join(path, "model.pt")
    if os.path.isdir(os.path.join(path, "dcp")):
        return "sharded", os.path.join(path, "dcp")
    raise BadInput(f"--init-from {path}: not a checkpoint (no model.pt or dcp/ inside)")


def check_init_from(path, shapes):
    """--init-from's checkpoint must hold every parameter of the model with its shape (`shapes`:
    the unwrapped model's, by name); mismatches are reported by name. Runs before anything
    is written."""
    kind, where = checkpoint_weights(path)
    if kind == "full":
        state = load_weights_only(where, mmap=True)["model"]
        theirs = {k: tuple(v.shape) for k, v in state.items()}
    else:
        metadata = MetadataCheckingReader(where).read_metadata().state_dict_metadata
        theirs = {k.removeprefix("model."): tuple(m.size) for k, m in metadata.items()
                  if k.startswith("model.") and hasattr(m, "size")}
    problems = [f"{n}: checkpoint {theirs[n]} vs model {s}" for n, s in shapes.items()
                if n in theirs and theirs[n] != s]
    problems += [f"{n}: missing in the checkpoint" for n in shapes if n not in theirs]
    if problems:
        raise BadInput(f"--init-from {path}: shapes do not match: " + "; ".join(problems[:8]) +
                       (f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""))


def init_weights_from(path, model):
    """Load only the model weights of a checkpoint (fresh optimizer, step 0)."""
    kind, where = checkpoint_weights(path)
    if kind == "full":
        state = load_weights_only(where, mmap=True)["model"]
        set_model_state_dict(model, state, options=state_dict_options("init"))
    else:
        state = {"model": get_model_state_dict(model)}
        dcp_load(state, where)
        set_model_state_dict(model, state["model"])


def require_checkpoint_dir(path, flag, valid):
    """BadInput unless `path` is a checkpoint directory (one with meta.json): a path given by
    the user that is not one is a mistake in the input, not a corrupted checkpoint."""
    if not os.path.exists(path):
        raise BadInput(f"{flag} {path}: no such directory; valid: {valid}")
    if os.path.isdir(os.path.join(path, "checkpoints")):
        found = complete_checkpoints(os.path.join(path, "checkpoints"))
        example = os.path.join(path, "checkpoints", found[0] if found else "step_N")
        raise BadInput(f"{flag} {path} is a run directory, not a checkpoint directory (no meta.json); give one "
                       f"of its checkpoints, e.g. {example}")
    if not os.path.isfile(os.path.join(path, "meta.json")):
        raise BadInput(f"{flag} {path}: not a checkpoint directory (no meta.json); valid: {valid}")


def export_checkpoint(path):
    """Sharded checkpoint (or RUN/checkpoints/best or latest) -> the single-file model.pt beside
    it, in one process (no FSDP)."""
    path = follow_marker(path)
    require_checkpoint_dir(path, "--export", "a checkpoint directory such as RUN/checkpoints/step_N")
    meta = check_checkpoint(path)
    if os.path.exists(os.path.join(path, "model.pt")):  # a full checkpoint, or the last of a run
        print(f"{path} already holds a consolidated model.pt")
        return os.path.join(path, "model.pt")
    # Only the model's tensors, read by DCP in this one process: the optimizer's two fp32 copies
    # are never loaded or written (DCP's dcp_to_torch_save would). No process group exists here,
    # so dcp.load reads as one process by itself (its no_dist flag is not in every release).
    reader = MetadataCheckingReader(os.path.join(path, "dcp"))
    model_state = {key[len("model."):]: torch.empty(md.size, dtype=md.properties.dtype)
                   for key, md in reader.read_metadata().state_dict_metadata.items()
                   if key.startswith("model.") and isinstance(md, TensorStorageMetadata)}
    with warnings.catch_warnings():  # DCP warns that it assumes one process: that is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is")
        dcp.load({"model": model_state}, storage_reader=reader, planner=WeightsOnlyLoadPlanner())
    tmp = os.path.join(path, "export.tmp")
    torch.save(consolidated_payload(model_state, meta), tmp)
    os.replace(tmp, os.path.join(path, "model.pt"))
    # meta.json lists model.pt's size too (a damaged one is then found like any file of the checkpoint),
    # and keeps its mtime: the save's, by which complete_checkpoints orders the checkpoints.
    meta_path, saved = os.path.join(path, "meta.json"), os.stat(os.path.join(path, "meta.json"))
    meta["files"]["model.pt"] = os.path.getsize(os.path.join(path, "model.pt"))
    write_text_atomic(meta_path, json.dumps(meta, indent=1))
    os.utime(meta_path, ns=(saved.st_atime_ns, saved.st_mtime_ns))
    print(f"wrote {os.path.join(path, 'model.pt')}")
    return os.path.join(path, "model.pt")


# =============================================================================================
# Run directory and logging


def flight_recorder_env(run_dir):
    """PyTorch's flight recorder, for hangs: every rank keeps its last FR_ENTRIES collectives in a
    ring buffer, and NCCL's watchdog writes it to RUN_DIR/flight_recorder/rank_<r> when a
    collective times out (after the process group's 30 minutes). Read them with
    `python -m torch.distributed.flight_recorder.fr_trace RUN_DIR/flight_recorder` (README).
    Both names of each setting: releases before the TORCH_FR_* names read the TORCH_NCCL_* ones."""
    prefix = os.path.join(os.path.abspath(run_dir), "flight_recorder", "rank_")
    return {"TORCH_FR_BUFFER_SIZE": str(FR_ENTRIES), "TORCH_NCCL_TRACE_BUFFER_SIZE": str(FR_ENTRIES),
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_DUMP_TEMP_FILE": prefix,
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix}


def flight_recorder_dumps():
    """The path prefix of the flight recorder's dump files when it is on (set by --debug or
    slurm_submit.sh), else None."""
    if os.environ.get("TORCH_FR_BUFFER_SIZE", "0") in ("", "0"):
        return None
    return os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or None


# A resume may not change what the run computes: these training settings, and every field of the
# seams' sections (model, data) but those their dataclass lists in RESUME_FREE. Other changes
# (logging, max_steps, FSDP knobs, world size) are allowed and logged.
RESUME_FIXED = {"fsdp": set(), "checkpoint": set(),
                "train": {"seed", "global_batch", "lr", "min_lr_ratio", "warmup_steps", "lr_scale_base_batch",
                          "weight_decay", "beta1", "beta2", "grad_clip"}}


def config_changes(old, cfg):
    """(refused, allowed): 'section.key: old -> new' for every difference between a saved config
    and cfg."""
    refused, allowed = [], []
    for section, sec in sections(cfg).items():
        for key, value in dataclasses.asdict(sec).items():
            before = old.get(section, {}).get(key)
            if before == value:
                continue
            fixed = RESUME_FIXED[section] if section in RESUME_FIXED else set(dataclasses.asdict(sec))
            refuse = key in fixed and key not in getattr(sec, "RESUME_FREE", ())
            (refused if refuse else allowed).append(f"{section}.{key}: {before!r} -> {value!r}")
    return refused, allowed


def data_changes(old, new):
    """'data: SOURCE changed' (added, removed) for each difference between the data digests of a
    checkpoint and of this run (BatchSource.digests); none when either has none."""
    if old is None or new is None:
        return []
    return ([f"data: {k} changed" for k in new if k in old and new[k] != old[k]] +
            [f"data: {k} added" for k in new if k not in old] + [f"data: {k} removed" for k in old if k not in new])


def lock_run_dir(run_dir, notes):
    """Rank 0 locks RUN_DIR/run.lock (flock) for the run's lifetime, so that a run directory has
    one writer: a second launch into it is refused, naming the holder written inside. The kernel
    drops the lock when its process ends, however it ends: a killed run's lock never blocks a
    resume. Returns (the open lock file, or None on a file system without locks (said in
    `notes`), undo: restores what this call changed, for a launch refused afterwards)."""
    missing, d = [], os.path.abspath(run_dir)
    while not os.path.exists(d):
        missing.append(d)
        d = os.path.dirname(d)
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, RUN_LOCK)
    new, fh = not os.path.exists(path), open(path, "a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read().strip() or "another process"
        fh.close()
        raise BadInput(f"--out-dir {run_dir} is in use by {holder}: a run directory takes one run at a time; wait "
                       "for it to end or stop it, or choose another --out-dir")
    except OSError as e:  # e.g. Lustre mounted without flock
        fh.close()
        fh = None
        notes.append(f"{path}: no lock ({e.strerror}); a second launch into {run_dir} would not be refused")

    def rewrite(text):
        fh.seek(0)
        fh.truncate()
        fh.write(text)
        fh.flush()
    before = ""
    if fh:
        fh.seek(0)
        before = fh.read()
        rewrite(f"host {socket.gethostname()} pid {os.getpid()}\n")

    def undo():
        with contextlib.suppress(OSError):
            if new:
                os.remove(path)
            elif fh:
                rewrite(before)
            for d in missing:
                os.rmdir(d)
        if fh:
            fh.close()
    return fh, undo


def prepare_run_dir(cfg, rank, digests=None):
    """Lock the run directory (--out-dir; lock_run_dir), create it and decide what to resume from.
    Returns (checkpoint to resume or None, notes to log, the lock on rank 0). A run directory
    that holds a run is continued (--resume auto) when the config and the data (`digests`)
    match, refused otherwise, restarted with --overwrite."""
    run_dir, c = cfg.train.out_dir, cfg.checkpoint

    def decide():
        config_path, notes, resume, meta, old = os.path.join(run_dir, "config.json"), [], None, None, None
        root = os.path.join(run_dir, "checkpoints")
        # Checkpoints without a config.json (deleted by hand, say) are a run all the same.
        holds_run = (os.path.exists(config_path) or bool(complete_checkpoints(root))
                     or os.path.exists(os.path.join(root, "latest")))
        if c.resume not in ("auto", "never"):
            resume = follow_marker(c.resume.rstrip("/"))
            require_checkpoint_dir(resume, "--resume", "auto, never or a checkpoint directory")
            meta = check_checkpoint(resume)
            old = meta["config"]
        elif holds_run and cfg.train.overwrite:
            shutil.rmtree(os.path.join(run_dir, "checkpoints"), ignore_errors=True)
            notes.append(f"--overwrite: starting {run_dir} afresh (its checkpoints were deleted)")
        elif holds_run and c.resume == "never":
            raise BadInput(f"--out-dir {run_dir} already holds a run; pass --resume auto to continue it or "
                           "--overwrite to start afresh")
        elif holds_run:
            resume, meta = find_resume_checkpoint(run_dir, notes)
            if resume is None and notes:  # checkpoints there, none complete: training would replace them
                newest = notes[0].removesuffix("; trying an older checkpoint")
                raise BadInput(f"--out-dir {run_dir} holds a run but none of its checkpoints is complete (newest: "
                               f"{newest}); not training over it: start from other weights with --init-from, or "
                               "afresh with --overwrite (which deletes its checkpoints)")
            try:
                if resume:
                    old = meta["config"]
                else:
                    with open(config_path) as fh:
                        old = json.load(fh)
            except ValueError:
                raise BadInput(f"--out-dir {run_dir} already holds a run whose config.json cannot be read; choose "
                               "another directory or pass --overwrite")
        for section, sec in sections(cfg).items() if old is not None else ():  # fields the old run predates
            if hasattr(sec, "saved_fields"):
                old[section] = sec.saved_fields(old.get(section, {}))
        # The schedule's length is the run's, fixed at its first launch: a resume keeps it (a run
        # saved before lr_decay_steps existed decayed over its own max_steps, cosine).
        t, saved = cfg.train, (old or {}).get("train", {})
        t.lr_decay_steps = t.lr_decay_steps or saved.get("lr_decay_steps") or saved.get("max_steps") or \
            (t.max_steps if t.lr_schedule == "cosine" else max(1, t.max_steps // 5))
        if old is not None:
            refused, allowed = config_changes(old, cfg)
            changed = data_changes(meta.get("data") if meta else None, digests)
            other = " and ".join(w for w, lines in (("another config", refused), ("other data", changed)) if lines)
            if other and c.resume not in ("auto", "never"):  # --resume PATH: the run is that checkpoint's
                raise BadInput(f"--resume {c.resume} was saved with {other} ({'; '.join(refused + changed)}); "
                               "resuming would silently change its run: resume it with its own settings, or start "
                               "a new run from its weights with --init-from")
            if other:
                raise BadInput(f"--out-dir {run_dir} already holds a run with {other} "
                               f"({'; '.join(refused + changed)}); resuming would silently change it: choose "
                               "another directory or pass --overwrite")
            notes += [f"changed on resume: {line}" for line in allowed]
            if resume and any(line.startswith(("train.max_steps", "train.lr_")) for line in allowed):
                notes.append(f"changed on resume: {schedule_change(cfg, old['train'], meta['step'])}")
        if flight_recorder_dumps():  # the flight recorder's dumps need their directory
            os.makedirs(os.path.dirname(flight_recorder_dumps()), exist_ok=True)
        if os.path.exists(os.path.join(run_dir, STOPPED_FILE)):
            os.remove(os.path.join(run_dir, STOPPED_FILE))
        start = meta["step"] if resume else 0
        keep_metric_lines(os.path.join(run_dir, "metrics.jsonl"), start)
        if not resume and os.path.exists(os.path.join(run_dir, "training_log.txt")):
            os.remove(os.path.join(run_dir, "training_log.txt"))
        for name in os.listdir(root) if os.path.isdir(root) else []:
            if name.startswith(".tmp-"):  # left by a save that was killed
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        write_text_atomic(config_path, json.dumps(dataclasses.asdict(cfg), indent=2))
        return resume, notes, t.lr_decay_steps

    held = {}

    def locked_decide():
        notes = []
        lock, undo = lock_run_dir(run_dir, notes)
        try:
            resume, more, decay_steps = decide()
        except BaseException:
            undo()
            raise
        held["lock"] = lock
        return resume, notes + more, decay_steps
    resume, notes, cfg.train.lr_decay_steps = agree(locked_decide, rank)  # decided on rank 0
    return resume, notes, held.get("lock")


def keep_metric_lines(path, last_step):
    """Drop metric records after the step a run restarts from, so each step appears once."""
    if not os.path.exists(path):
        return
    keep = []
    with open(path) as fh:
        for line in fh:
            try:
                if json.loads(line).get("step", 0) <= last_step:
                    keep.append(line if line.endswith("\n") else line + "\n")
            except ValueError:  # a line torn by a crash mid-write
                continue
    write_text_atomic(path, "".join(keep))


class RunLog:
    """metrics.jsonl (one JSON object per event), training_log.txt (the same, readable) and the
    trackers asked for (--tensorboard, --wandb), which get every number of metrics.jsonl. A write to
    the files that fails (a full disk) is kept in `error`, not raised: rank 0 stopping alone would
    leave the others waiting in a collective; main() stops every rank on it at the next step."""

    def __init__(self, run_dir, rank):
        self.rank, self.trackers, self.sent_step, self.sent_keys = rank, [], None, set()
        self.error = None
        if rank == 0:
            self.jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a")
            self.text = open(os.path.join(run_dir, "training_log.txt"), "a")

    def write(self, fh, text):
        if self.error is None:
            try:
                fh.write(text)
                fh.flush()
            except OSError as e:
                self.failed(fh.name, e)

    def failed(self, what, e):
        """Keep the first failed write (main() stops every rank on it)."""
        self.error = self.error or f"writing {what} failed on rank 0 ({type(e).__name__}: {e}); the latest " \
                                   "checkpoint is intact"

    def line(self, msg):
        if self.rank == 0:
            self.write(self.text, msg + "\n")
            try:
                tqdm.write(msg)  # above the bar, in a terminal
            except OSError as e:  # stdout redirected to a full disk (a Slurm log)
                self.failed("stdout", e)

    def keep_metrics_until(self, step):
        if self.rank == 0:  # keep_metric_lines replaces the file: reopen it
            self.jsonl.close()
            keep_metric_lines(self.jsonl.name, step)
            self.jsonl = open(self.jsonl.name, "a")

    def start_trackers(self, cfg, start_step):
        if self.rank == 0:
            self.trackers = open_trackers(cfg, start_step, self.line)

    def metrics(self, record):
        if self.rank == 0:
            self.write(self.jsonl, json.dumps(record) + "\n")
            # The trackers get the floats the record already holds (no extra synchronisation), each
            # key once a step: a validation at a log step repeats its tokens_seen.
            step = record["step"]
            if step != self.sent_step:
                self.sent_step, self.sent_keys = step, set()
            scalars = {k: v for k, v in record.items()
                       if k != "step" and k not in self.sent_keys and isinstance(v, (int, float))}
            self.sent_keys |= set(scalars)
            for tracker in list(self.trackers):
                self.tracker_call(tracker, f"failed at step {step}", tracker.log, step, scalars)

    def tracker_call(self, tracker, what, fn, *args):
        """A tracker that fails (network, disk) is said once and dropped; the run goes on."""
        try:
            fn(*args)
        except Exception as e:
            self.trackers.remove(tracker)
            self.line(f"{tracker.name} {what} ({type(e).__name__}: {e}); training goes on without it")

    def step(self, rec, keys):
        """A training record (Meter.record) and its line; `keys`: the losses, in the order shown."""
        self.metrics(rec)
        parts = " ".join(f"{k} {rec[k]:.4f}" for k in keys)
        self.line(f"step {rec['step']:>6} | {parts} | lr {rec['lr']:.2e} | gnorm {rec['grad_norm']:.3f} | "
                  f"{rec['tokens_per_s']:,.0f} tok/s | {1000 * rec['step_time_s']:.1f} ms/step" +
                  (f" | mfu {100 * rec['mfu']:.1f}%" if "mfu" in rec else "") +
                  f" | mem {rec['mem_peak_gib']:.2f} GiB peak")

    def validation(self, step, val, tokens_seen):
        self.metrics({"step": step, "tokens_seen": tokens_seen, **{f"val_{k}": v for k, v in val.items()}})
        self.line(f"step {step:>6} | validation " + " ".join(f"{k} {v:.4f}" for k, v in val.items()))

    def close_trackers(self):
        for tracker in list(self.trackers):
            self.tracker_call(tracker, "failed to close", tracker.close)
        self.trackers = []

    def close(self):
        if self.rank == 0:
            for fh in (self.jsonl, self.text):
                with contextlib.suppress(OSError):  # a failed write is in self.error already
                    fh.close()


# Trackers: rank 0 only, opened once the step to continue from is known. Each has a name, log(step,
# scalars) and close(). A resume continues the same tracker run with no step twice: of the steps a
# stopped attempt logged after its checkpoint, TensorBoard shows the resumed values, W&B keeps the
# first ones (it takes no step twice).


class TensorBoardRun:
    """Event files in RUN_DIR/tensorboard; tags are the keys of metrics.jsonl."""
    name = "TensorBoard"

    def __init__(self, cfg, start_step):
        from torch.utils.tensorboard import SummaryWriter
        # purge_step: TensorBoard hides what earlier event files hold from this step on, as
        # keep_metric_lines drops it from metrics.jsonl (and the old run of an --overwrite).
        self.writer = SummaryWriter(os.path.join(cfg.train.out_dir, "tensorboard"), purge_step=start_step + 1)
        config = json.dumps(dataclasses.asdict(cfg), indent=1)
        self.writer.add_text("config", "    " + config.replace("\n", "\n    "), start_step)  # Markdown code

    def log(self, step, scalars):
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)

    def close(self):
        self.writer.close()


WANDB_STATE = "wandb_run.json"  # in the run directory: the W&B run's id and the last step it was sent


class WandbRun:
    """A W&B run in RUN_DIR/wandb (with WANDB_MODE=offline, `wandb sync RUN_DIR/wandb/offline-run-*`
    uploads it later). W&B takes no step twice, so a resume skips the steps the run already holds."""
    name = "W&B"

    def __init__(self, cfg, start_step):
        import wandb
        run_dir = cfg.train.out_dir
        self.state, saved = os.path.join(run_dir, WANDB_STATE), {}
        if start_step and os.path.exists(self.state):
            with open(self.state) as fh:
                saved = json.load(fh)
        self.last = self.skip_to = saved.get("step", 0)
        # console off: the trainer's own output stays as it is (training_log.txt has it all).
        self.run = wandb.init(project=cfg.train.wandb, id=saved.get("id"), resume="allow", dir=run_dir,
                              name=os.path.basename(os.path.abspath(run_dir)), config=dataclasses.asdict(cfg),
                              allow_val_change=True, settings=wandb.Settings(console="off"))
        self.save()

    def log(self, step, scalars):
        if step > self.skip_to:
            self.run.log(scalars, step=step)
            if step != self.last:
                self.last = step
                self.save()

    def save(self):  # replaced whole, not fsynced: it is small and rewritten every log step
        with open(self.state + ".tmp", "w") as fh:
            json.dump({"id": self.run.id, "step": self.last}, fh)
        os.replace(self.state + ".tmp", self.state)

    def close(self):
        self.run.finish()


def open_trackers(cfg, start_step, say):
    trackers = []
    for wanted, kind in ((cfg.train.tensorboard, TensorBoardRun), (cfg.train.wandb, WandbRun)):
        try:
            if wanted:
                trackers.append(kind(cfg, start_step))
        except Exception as e:
            say(f"{kind.name} could not start ({type(e).__name__}: {e}); training goes on without it")
    return trackers


def memory_stats(device):
    """(allocated, reserved, peak) in GiB; on CPU the process's peak resident set."""
    if device.type == "cuda":
        gib = 2 ** 30
        return (torch.cuda.memory_allocated(device) / gib, torch.cuda.memory_reserved(device) / gib,
                torch.cuda.max_memory_allocated(device) / gib)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    return 0.0, 0.0, peak


def peak_flops(device):
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


class Meter:
    """Throughput, MFU and memory over the steps since the last record, with evaluation and
    saving kept out (exclude)."""

    def __init__(self, topo, plan, flops_per_token):
        self.topo, self.plan, self.flops_per_token = topo, plan, flops_per_token
        self.peak = peak_flops(topo.device)
        self.reset()

    def reset(self):
        self.start, self.steps, self.data_time = time.perf_counter(), 0, 0.0

    def add_step(self, data_time):
        self.steps += 1
        self.data_time += data_time

    def exclude(self, since):
        self.start += time.perf_counter() - since

    def record(self, step, totals, lr, grad_norm, tokens_seen):
        """The log record of `step`: the losses averaged over ranks, throughput, memory (the most
        of any rank). Collectives: every rank, every log step."""
        world, device = self.topo.world, self.topo.device
        losses = all_reduce_scalars({k: v / world for k, v in totals.items()}, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - self.start
        step_time = elapsed / self.steps
        mem = all_reduce_scalars(dict(zip(("mem_alloc_gib", "mem_reserved_gib", "mem_peak_gib"),
                                          memory_stats(device))), device, op=dist.ReduceOp.MAX)
        rec = {"step": step, **losses, "lr": lr, "grad_norm": float(grad_norm),
               "tokens_per_s": self.plan.tokens_per_step / step_time, "step_time_s": step_time,
               "data_fraction": self.data_time / elapsed, "tokens_seen": tokens_seen,
               "mem_alloc_gib": mem["mem_alloc_gib"], "mem_reserved_gib": mem["mem_reserved_gib"],
               "mem_peak_gib": mem["mem_peak_gib"]}
        if self.peak and self.flops_per_token:
            rec["mfu"] = self.flops_per_token * rec["tokens_per_s"] / world / self.peak
        return rec


def log_summary(log, cfg, topo, plan, params, n_val):
    """Rank 0's start-up lines: where it runs, the strategy, the parameters (`params`: total and
    trainable of the plain model, per_rank after wrapping), the batch layout, what is ignored, how
    many validation rows (of n_val) each evaluation reads, what is saved and kept."""
    t, c, device = cfg.train, cfg.checkpoint, topo.device
    one = one_unit(cfg.fsdp, params["total"])
    headline, notes = describe_strategy(cfg, one=one)
    log.line(f"world {topo.world} | backend {topo.backend} | device {device} "
             f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else ''}".rstrip())
    log.line(headline)
    log.line(loss_precision(cfg))
    if t.compile:
        mode = compile_mode(cfg, params["total"])
        log.line(f"compile: {'each block' if compiles_blocks(cfg, params['total']) else 'the model'}"
                 f", mode {mode}{' (CUDA graphs on a GPU)' if mode == 'reduce-overhead' else ''}")
    if t.strategy in ("fsdp", "fsdp2") and cfg.fsdp.auto_wrap == "auto":
        log.line("--auto-wrap auto: " + (
            f"the whole model is one FSDP unit (under {ONE_UNIT_BELOW // 10 ** 6}M parameters per-block units cost "
            "host time each step and save little memory); --auto-wrap module makes each block a unit"
            if one else "each block is an FSDP unit (the module rule)"))
    log.line(f"parameters: total {params['total']:,} | trainable {params['trainable']:,} | on rank 0 "
             f"{params['per_rank'][0]:,} (fewest on a rank {min(params['per_rank']):,}, "
             f"most {max(params['per_rank']):,})")
    log.line(f"batch: global {t.global_batch} = micro {plan.micro} x world {topo.world} x accum {plan.accum} "
             f"({t.grad_accum_mode}) | seq {plan.seq_len} | {plan.tokens_per_step:,} tokens/step | "
             f"{plan.max_steps} steps")
    for note in notes:
        log.line(note)
    if peak_flops(device) is None and device.type == "cuda":
        log.line(f"MFU not reported: unknown bf16 peak for {torch.cuda.get_device_name(device)}")
    if t.debug:
        log.line(f"distributed debug level {dist.get_debug_level().name}, NCCL_DEBUG={os.environ.get('NCCL_DEBUG')}")
    if flight_recorder_dumps():
        log.line(f"flight recorder: the last {os.environ['TORCH_FR_BUFFER_SIZE']} collectives per rank, dumped on "
                 f"a collective timeout (NCCL) to {flight_recorder_dumps()}<rank>")
    rows = min(t.eval_samples, n_val)
    log.line(f"evaluation: {f'every {t.eval_every} steps' if t.eval_every else 'at the end'}"
             f"{' and at each save (--keep-best)' if c.keep_best else ''} | {rows:,} validation rows each, " +
             ("the whole split" if rows == n_val else f"of {n_val:,} (--eval-samples {t.eval_samples})"))
    saves = f"every {c.save_every} steps" if c.save_every else "at the end"
    if c.save_every and c.async_save:
        saves += " in the background (--async-save)"
    log.line(f"run directory: {t.out_dir} | checkpoints: {c.checkpoint_type}, {saves}, keep the newest "
             f"{c.keep_checkpoints}{' and the best' if c.keep_best else ''}")


def start_profiler(cfg, rank):
    """--profile: a Chrome trace of steps 2-4 per rank in the run directory; else None."""
    if not cfg.train.profile:
        return None
    profiler = torch.profiler.profile(
        schedule=torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(os.path.join(cfg.train.out_dir, f"trace_rank{rank}.json")))
    profiler.start()
    return profiler


# A stop reason beside the signal numbers: this worker's launcher (torchrun) has exited. Larger
# than any signal number, so the MAX all-reduce of the reasons names it when it is one of them.
LAUNCHER_GONE = 1000


def install_stop_handlers():
    """SIGTERM and SIGUSR1 (Slurm sends them before preemption or the time limit) only set a
    flag; every rank then finishes its step, saves and exits together."""
    flag = {"signal": 0}

    def handler(signum, frame):
        flag["signal"] = signum
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    return flag, previous


def launcher_pid():
    """The pid of the torchrun that started this worker, or None when torchrun did not. torchrun
    starts its workers in sessions of their own, so a torchrun killed by a signal it does not
    forward (SIGUSR1, SIGKILL) leaves them training alone, unseen by the next launch that shares
    their run directory. A worker whose parent is no longer this pid stops like on SIGTERM.
    Not without torchrun: a `nohup python train_fsdp.py` outlives its shell on purpose."""
    return os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None


def stop_reason(code):
    if code == LAUNCHER_GONE:
        return "launcher gone (torchrun exited and left its workers running)"
    return f"signal {signal.Signals(code).name}"


def write_stopped(run_dir, step, topo):
    """Rank 0 writes stopped.json (for launchers that cannot see our exit code: torchrun turns 3
    into 1), then every rank waits for every other. With that, no process exits before every
    rank's save and the file are on disk: save_checkpoint returns on a rank only after all ranks
    have written their files and rank 0 has published the checkpoint (its last step is a
    collective), and this is the next collective. Under `srun --kill-on-bad-exit`, the first
    node whose torchrun exits has Slurm kill the others: by then nothing is left to write."""
    error = None
    if topo.rank == 0:
        try:
            write_text_atomic(os.path.join(run_dir, STOPPED_FILE), json.dumps({"step": step}) + "\n")
        except OSError as e:
            error = f"{e.strerror}: {e.filename}"
    error = any_rank_error(error, topo)
    if error:
        raise RunFailed(f"the checkpoint of step {step} is saved, but {STOPPED_FILE} could not be written "
                        f"({error}): a launcher will take this stop for a failure")


# =============================================================================================
# Command line and TOML; the checks and the resolution of the config


def sections(cfg):
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def flag_name(name):
    return "--" + name.replace("_", "-")


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        if message.startswith("unrecognized arguments"):
            message += " (python train_fsdp.py --help lists the valid flags)"
        raise BadInput(message)


def field_type(section, f):
    """int, float, str or bool: the types a setting may have (a string under `from __future__
    import annotations`)."""
    typ = {"int": int, "float": float, "str": str, "bool": bool}.get(f.type, f.type)
    if typ not in (int, float, str, bool):
        raise BadInput(f"{section}.{f.name}: type {f.type!r}; a setting is an int, float, str or bool")
    return typ


def build_arg_parser(cfg=None):
    """The flags of cfg's fields (by default this project's sections: Config())."""
    parser = OneLineParser(description="Train with FSDP / DDP / one device. Every setting is a flag; "
                           "--config FILE.toml sets the same fields by [section].", allow_abbrev=False)
    parser.add_argument("--config", default="", help="TOML file with [model], [data], [fsdp], [train], "
                        "[checkpoint] tables")
    parser.add_argument("--export", metavar="CHECKPOINT_DIR", default=argparse.SUPPRESS,
                        help="write CHECKPOINT_DIR/model.pt from a sharded checkpoint, then exit (given alone)")
    owner = {}  # flag -> the field that has it: a seam's setting may not reuse a trainer's flag
    for section, obj in sections(cfg or Config()).items():
        group = parser.add_argument_group(section)
        for f in dataclasses.fields(obj):
            flag = flag_name(f.name)
            if flag in owner:
                raise BadInput(f"{owner[flag]} and {section}.{f.name} would both be {flag}: rename one")
            owner[flag] = f"{section}.{f.name}"
            kw = dict(dest=f"{section}.{f.name}", default=argparse.SUPPRESS, help=f.metadata.get("help", ""))
            if field_type(section, f) is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
            else:
                group.add_argument(flag, type=field_type(section, f), choices=f.metadata.get("choices"), **kw)
    return parser


def set_field(cfg, section, key, value, source):
    """Set cfg.<section>.<key> = value after checking key, type and choices."""
    sec = sections(cfg).get(section)
    if sec is None:
        raise BadInput(f"{source}: unknown table [{section}]; valid tables: {', '.join(sections(cfg))}")
    fields = {f.name: f for f in dataclasses.fields(sec)}
    if key not in fields:
        raise BadInput(f"{source}: unknown key {section}.{key}; valid keys: {', '.join(fields)}")
    f = fields[key]
    typ = field_type(section, f)
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if type(value) is not typ:
        raise BadInput(f"{source}: {section}.{key} = {value!r} must be of type {typ.__name__}")
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise BadInput(f"{source}: {section}.{key} = {value!r}; valid values: {', '.join(map(repr, choices))}")
    setattr(sec, key, value)


def read_toml(config_path):
    """The tables of a --config file, each checked to be a table."""
    if not os.path.isfile(config_path):
        raise BadInput(f"--config {config_path}: no such file")
    try:
        with open(config_path, "rb") as fh:
            file_values = tomllib.load(fh)
    except tomllib.TOMLDecodeError as e:
        raise BadInput(f"--config {config_path}: not valid TOML ({e})")
    except UnicodeDecodeError as e:
        raise BadInput(f"--config {config_path}: not valid TOML, TOML files are UTF-8 ({e})")
    for section, table in file_values.items():
        if not isinstance(table, dict):
            raise BadInput(f"{config_path}: top-level key {section!r} must be a table like [train]")
    return file_values


def parse_config(argv, cfg=None):
    """The config of a command line: cfg (by default Config(), this project's sections) set from
    the bundles (--preset, and those a seam's settings name: --size), the file and the flags."""
    cfg = cfg or Config()
    args = vars(build_arg_parser(cfg).parse_args(argv))
    if "export" in args:
        raise BadInput("--export takes a checkpoint directory and no other flag")
    config_path = args.pop("config")
    cli = {}
    for dest, value in args.items():
        section, key = dest.split(".")
        cli.setdefault(section, {})[key] = value
    file_values = read_toml(config_path) if config_path else {}

    def chosen(section, key):  # a bundle's name itself follows command line > file > default
        return cli.get(section, {}).get(key, file_values.get(section, {}).get(key, ""))

    def source(section, key):
        return "the command line" if key in cli.get(section, {}) else config_path

    bundles = {("train", "preset"): PRESETS}
    bundles.update({(section, key): named for section, sec in sections(cfg).items()
                    for key, named in getattr(sec, "PRESETS", {}).items()})
    layers = []
    for (section, key), named in bundles.items():
        name = chosen(section, key)
        if name and name not in named:
            raise BadInput(f"{flag_name(key)} {name!r} (from {source(section, key)}); valid values: "
                           f"{', '.join(named)}")
        if name:
            layers.append((named[name], f"{key} {name}"))
    layers += [(file_values, config_path), (cli, "command line")]
    for values, where in layers:
        for section, table in values.items():
            for key, value in table.items():
                set_field(cfg, section, key, value, where)
    return cfg


def check_ranges(cfg):
    """Numbers outside their range, each reported by its flag before anything is written (the
    seams' own settings: their check())."""
    t, f, c = cfg.train, cfg.fsdp, cfg.checkpoint
    rules = [("global_batch", t.global_batch >= 1, ">= 1"), ("micro_batch", t.micro_batch >= 0, ">= 0"),
             ("max_steps", t.max_steps >= 0, ">= 0"), ("epochs", t.epochs > 0, "> 0"),
             ("lr", t.lr > 0, "> 0"), ("min_lr_ratio", 0 <= t.min_lr_ratio <= 1, "in [0, 1]"),
             ("warmup_steps", t.warmup_steps >= 0, ">= 0"), ("weight_decay", t.weight_decay >= 0, ">= 0"),
             ("beta1", 0 <= t.beta1 < 1, "in [0, 1)"), ("beta2", 0 <= t.beta2 < 1, "in [0, 1)"),
             ("grad_clip", t.grad_clip >= 0, ">= 0"), ("eval_every", t.eval_every >= 0, ">= 0"),
             ("eval_samples", t.eval_samples >= 1, ">= 1"), ("log_every", t.log_every >= 1, ">= 1"),
             ("save_every", c.save_every >= 0, ">= 0"), ("keep_checkpoints", c.keep_checkpoints >= 1, ">= 1"),
             ("lr_scale_base_batch", t.lr_scale_base_batch >= 0, ">= 0"),
             ("lr_decay_steps", t.lr_decay_steps >= 0, ">= 0"),
             ("ac_every", f.ac_every >= 1, ">= 1"), ("min_num_params", f.min_num_params >= 1, ">= 1"),
             ("hybrid_shard_size", f.hybrid_shard_size >= 0, ">= 0")]
    # inf passes a check like "> 0" and nan none: every float setting must be finite (an
    # infinite learning rate, epoch count or clip norm has no meaning; 0 turns clipping off).
    valid_of = {name: valid for name, _, valid in rules}
    for sec in sections(cfg).values():
        for fld in dataclasses.fields(sec):
            value = getattr(sec, fld.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise BadInput(f"{flag_name(fld.name)} {value}: must be a finite number" +
                               (f" {valid_of[fld.name]}" if fld.name in valid_of else ""))
    for name, ok, valid in rules:
        if not ok:
            value = next(getattr(sec, name) for sec in (t, f, c) if hasattr(sec, name))
            raise BadInput(f"{flag_name(name)} {value}: must be {valid}")


def check_config(cfg):
    """Every check the settings allow on their own, before anything is set up or written."""
    check_ranges(cfg)
    if cfg.checkpoint.async_save and cfg.checkpoint.checkpoint_type != "sharded":
        raise BadInput("--async-save needs --checkpoint-type sharded (a full checkpoint is one file that rank 0 "
                       "writes with torch.save)")
    seam_hooks(cfg, "check")
    check_strategy(cfg)
    for flag, wanted, module, package in (("--tensorboard", cfg.train.tensorboard, "torch.utils.tensorboard",
                                           "tensorboard"), ("--wandb", cfg.train.wandb, "wandb", "wandb")):
        try:  # optional packages, imported only when asked for (rank 0 uses them; every rank checks)
            if wanted:
                importlib.import_module(module)
        except ImportError:
            raise BadInput(f"{flag} needs the {package} package, which is not installed: pip install {package}")


def seam_hooks(cfg, name, *args):
    """Call the hook `name` (check, resolve) of every section that has one: the seams' settings
    check themselves. Their ValueError is bad input."""
    for sec in sections(cfg).values():
        if hasattr(sec, name):
            try:
                getattr(sec, name)(*args)
            except ValueError as e:
                raise BadInput(str(e)) from None


def check_world(cfg, topo):
    """The checks that need the world size and the device, before anything is written:
    global batch = micro-batch x world size x accumulation steps."""
    t, world = cfg.train, topo.world
    check_strategy(cfg, topo)
    if t.global_batch < world:
        raise BadInput(f"--global-batch {t.global_batch} is smaller than the world size {world}; every process "
                       "needs at least one sequence per step")
    micro = t.micro_batch or t.global_batch // world
    if t.global_batch % (micro * world):
        raise BadInput(f"--global-batch {t.global_batch} is not divisible by micro-batch {micro} x world size "
                       f"{world}; choose a global batch that is a multiple of {micro * world}")


def resolve_config(cfg, topo, data):
    """Fill in what the settings leave open, once the world and the data are known: the
    strategy's needs (resolve_strategy), the run's length, the seams' derived fields (resolve(data):
    the model's vocabulary, ...). With name_run_dir and the schedule's length (prepare_run_dir), the
    config is then only read; it is the one printed and saved."""
    resolve_strategy(cfg, topo)
    t = cfg.train
    t.max_steps = t.max_steps or math.ceil(t.epochs * data.steps_per_epoch(t.global_batch))
    seam_hooks(cfg, "resolve", data)


def name_run_dir(cfg, model):
    """--out-dir left empty: runs/<model class>-<date-time>, one name for all ranks."""
    if not cfg.train.out_dir:
        stamp = [datetime.datetime.now().strftime("%Y%m%d-%H%M%S")]
        dist.broadcast_object_list(stamp, src=0)
        cfg.train.out_dir = os.path.join("runs", f"{type(model).__name__.lower()}-{stamp[0]}")


# =============================================================================================
# main


def restore_state(resume, model, optimizer, scaler, cfg, topo, log):
    """Resume from a checkpoint, or take the weights of --init-from, or neither. Returns (step,
    tokens seen)."""
    if resume:
        t0 = time.perf_counter()
        resume, meta = load_resume_checkpoint(resume, model, optimizer, scaler, cfg, topo, log)
        log.line(f"resumed from {resume} in {time.perf_counter() - t0:.1f} s (step {meta['step']}, saved by "
                 f"{meta['world_size']} processes" +
                 ("" if meta["world_size"] == topo.world else "; RNG streams re-seeded for the new world size") + ")")
        return meta["step"], meta["tokens_seen"]
    if cfg.checkpoint.init_from:
        init_weights_from(cfg.checkpoint.init_from, model)
        log.line(f"initialised the weights from {cfg.checkpoint.init_from} (fresh optimizer, step 0)")
    return 0, 0


def main(argv=None, build_model=None, compute_loss=None, load_dataset=None, model_config=None,
         data_config=None):
    """One run, in the order of the file: config, distributed setup, data, model, wrapping,
    optimizer, loop, checkpoints, exit. The seams are arguments (see Seams above; run() passes
    them): those not given are this project's, and so are their settings (model.ModelConfig,
    data.DataConfig); model_config / data_config: the dataclasses of your seams' settings (none
    if not given)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--export"]:  # python train_fsdp.py --export RUN/checkpoints/step_N
        if len(argv) != 2:
            raise BadInput("usage: python train_fsdp.py --export CHECKPOINT_DIR")
        export_checkpoint(argv[1])
        return None
    # This project's seams read each other's output and settings: yours replace them in pairs.
    if bool(build_model) != bool(compute_loss) or (model_config and not build_model):
        raise BadInput("pass build_model, compute_loss (and model_config, if any) together: this project's read "
                       "what its own model returns and its settings")
    if data_config and not load_dataset:
        raise BadInput("data_config needs your load_dataset: this project's reads its own settings")
    this = sys.modules[__name__]
    sections_of = {"model": model_config or (NoSettings if build_model else project_model_config),
                   "data": data_config or (NoSettings if load_dataset else project_data_config)}
    build_model, load_dataset = build_model or this.build_model, load_dataset or this.load_dataset
    compute_loss = compute_loss or this.compute_loss
    cfg = parse_config(argv, Config(**{name: make() for name, make in sections_of.items()}))
    check_config(cfg)
    topo = setup_distributed(cfg)
    check_world(cfg, topo)
    data = load_dataset(cfg, topo.rank)
    resolve_config(cfg, topo, data)
    topo = dataclasses.replace(topo, mesh=device_mesh(cfg, topo))  # the mesh follows the resolved strategy
    plan = plan_run(cfg, topo, data)
    t, c, rank = cfg.train, cfg.checkpoint, topo.rank

    # Same seed on every rank for the weights, so unwrapped replicas start identical.
    torch.manual_seed(t.seed)
    with torch.device("meta") if cfg.fsdp.meta_init else contextlib.nullcontext():
        model, wrap_classes, ckpt_classes = build_model(cfg)
    name_run_dir(cfg, model)
    if c.init_from:  # a bad path or shape fails before anything is written
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        agree(lambda: check_init_from(c.init_from, shapes), rank)

    decay_names = {n for n, p in model.named_parameters() if p.dim() >= 2}
    params = {"total": parameter_count(model),
              "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    # For MFU: the model's own count of training flops per token, or, for a model that has none
    # (one of yours through the seams), the usual estimate of 6 per parameter.
    flops_tok = model.flops_per_token(plan.seq_len) if hasattr(model, "flops_per_token") else 6 * params["total"]
    eval_note = getattr(model, "evaluation_note", "")  # what the validation figures mean, where a model says
    # Before the run directory is touched: --meta-init refuses a module that nothing initialises here.
    model = wrap_model(model, wrap_classes, ckpt_classes, cfg, topo, getattr(model, "init_module", None))
    params["per_rank"] = [None] * topo.world
    dist.all_gather_object(params["per_rank"], local_parameter_count(model))
    resume, notes, lock = prepare_run_dir(cfg, rank, getattr(data, "digests", None))
    run_dir, log = t.out_dir, RunLog(t.out_dir, rank)
    if rank == 0:
        print(json.dumps(dataclasses.asdict(cfg), indent=1))
    torch.manual_seed(t.seed + rank)  # dropout and sampling differ per rank
    optimizer = build_optimizer(model, cfg, plan.peak_lr, topo.device, decay_names)
    scaler = grad_scaler(cfg, topo.device)

    for note in notes:
        log.line(note)
    start_step, tokens_seen = restore_state(resume, model, optimizer, scaler, cfg, topo, log)
    log_summary(log, cfg, topo, plan, params, data.n_val)
    if eval_note:
        log.line(eval_note)
    log.start_trackers(cfg, start_step)

    profiler = start_profiler(cfg, rank)
    stop_flag, previous_handlers = install_stop_handlers()
    launcher = launcher_pid()
    first_bad = torch.tensor(NEVER, device=topo.device)  # see note_nonfinite
    model.train()
    meter = Meter(topo, plan, flops_tok)
    # The bar is for a terminal: in a Slurm or redirected log its redraws would fill the file with
    # one endless line, and the log lines there carry the same numbers.
    bar = tqdm(total=plan.max_steps, initial=start_step, disable=rank != 0 or not sys.stderr.isatty(),
               dynamic_ncols=True, desc="train")
    saver = async_saver(c, topo)
    pending, evaluated = None, None  # the background save under way; the step last evaluated
    val = {}
    if start_step >= plan.max_steps:  # every rank: evaluation is collective
        log.line(f"{run_dir} already finished at step {start_step} (max_steps {plan.max_steps}): nothing to train; "
                 "pass a larger --max-steps to continue it")
        val = evaluate(model, data, cfg, topo, plan.micro, compute_loss)
    try:
        for step in range(start_step, plan.max_steps):
            lr = lr_at(step, plan.peak_lr, cfg, plan.max_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batches, data_time = micro_batches(data, step, cfg, plan, topo)
            totals, grad_norm, skipped = train_step(model, optimizer, scaler, batches, cfg, compute_loss)
            if skipped:
                log.line(f"step {step + 1}: gradient norm {float(grad_norm)}, optimizer step skipped")
            elif not t.skip_nonfinite:
                # A finite loss can still give NaN gradients; either poisons the weights. Under fp16
                # the grad scaler owns non-finite gradients (it skips the step and lowers the
                # scale), but not a non-finite loss: the forward itself overflowed.
                first_bad = note_nonfinite(first_bad, step + 1, totals["loss"], None if scaler else grad_norm)
            tokens_seen += plan.tokens_per_step
            meter.add_step(data_time)
            bar.update(1)
            if profiler:
                profiler.step()
            if launcher is not None and os.getppid() != launcher:
                stop_flag["signal"] = LAUNCHER_GONE
            stop = torch.tensor([stop_flag["signal"], int(log.error is not None)])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX, group=topo.control)
            if stop[1].item():  # rank 0 could not write the log (a full disk): every rank stops
                raise RunFailed(log.error or "rank 0 could not write the run's log")  # (other ranks have none)
            stop = stop[:1]
            last = step == plan.max_steps - 1
            if (step + 1) % t.log_every == 0 or last:
                check_finite(first_bad)
                log.step(meter.record(step + 1, totals, lr, grad_norm, tokens_seen), sorted(totals))
                meter.reset()
            pending = finish_background_save(pending, c, topo, log)
            save_due = (c.save_every and (step + 1) % c.save_every == 0) or (last and c.save_final)
            # --keep-best compares checkpoints by the validation loss of their step: a save is evaluated
            # first (not a stop's: the time before the kill is short).
            if (t.eval_every and (step + 1) % t.eval_every == 0) or last or (c.keep_best and save_due and
                                                                             not stop.item()):
                t0 = time.perf_counter()
                val = evaluate(model, data, cfg, topo, plan.micro, compute_loss)
                log.validation(step + 1, val, tokens_seen)
                evaluated = step + 1
                meter.exclude(t0)  # keep evaluation out of the throughput
            if save_due or stop.item():
                check_finite(first_bad)  # never save a state that has seen a non-finite loss
                t0 = time.perf_counter()
                pending = finish_background_save(pending, c, topo, log, wait=True)  # one at a time, in order
                meta = checkpoint_meta(cfg, step + 1, tokens_seen, data.tokenizer_path, scaler, topo.world,
                                       val_loss=val["loss"] if evaluated == step + 1 else None,
                                       digests=getattr(data, "digests", None))
                path, t1 = checkpoint_path(run_dir, step + 1), time.perf_counter()
                if c.async_save and not (last or stop.item()):  # a stop or the end: synchronous, below
                    pending = start_async_save(path, meta, model, optimizer, topo, saver)
                    log.line(f"staged {path} in {time.perf_counter() - t1:.1f} s; writing it in the background")
                else:
                    save_checkpoint(path, meta, model, optimizer, c, topo, consolidate=last)
                    log.line(f"saved {path} in {time.perf_counter() - t1:.1f} s")
                meter.exclude(t0)  # and saving
            if stop.item() and not last:
                write_stopped(run_dir, step + 1, topo)
                raise Preempted(f"{stop_reason(stop.item())} at step {step + 1}: checkpoint saved, "
                                f"exiting with code {EXIT_PREEMPTED}; run the same command with --out-dir "
                                f"{run_dir} to resume")
        pending = finish_background_save(pending, c, topo, log, wait=True)  # --no-save-final: the last one
    finally:
        if pending:  # stopped by an error: let the write end before the process groups are destroyed
            pending.future.exception()
            if rank == 0:  # and leave no staging directory
                shutil.rmtree(staging_path(pending.path), ignore_errors=True)
        bar.close()
        log.close_trackers()
        if profiler:
            profiler.stop()
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)
    log.line("final validation: " + " ".join(f"{k} {v:.4f}" for k, v in val.items()))
    log.close()
    failed = torch.tensor([int(log.error is not None)])
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=topo.control)  # also the barrier: every rank has ended
    if failed.item():
        raise RunFailed(log.error or "rank 0 could not write the run's log")  # (other ranks have none)
    if lock:
        lock.close()  # the next run may take the directory (the kernel would drop the lock at exit anyway)
    if topo.owner:
        dist.destroy_process_group()
    return val


def run(argv=None, **seams):
    """The entry point, of `python train_fsdp.py` and of your own model's script: main(argv,
    **seams), then exit. Bad input: one line on stderr (rank 0), exit 2. A run that cannot go on:
    one line, exit 1. Stopped by SIGTERM/SIGUSR1 after saving: exit 3 (requeue me). Finished: 0."""
    code, message = 0, None
    try:
        main(argv, **seams)
    except BadInput as e:
        code, message = EXIT_BAD_INPUT, f"error: {e}"
    except RunFailed as e:
        code, message = EXIT_FAILED, f"error: {e}"
    except Preempted as e:
        code, message = EXIT_PREEMPTED, str(e)
    if message and int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == 0:
        print(message, file=sys.stderr)
    if dist.is_initialized():
        dist.destroy_process_group()
    leave(code)


def leave(code):
    """Exit without tearing down the interpreter. A gloo worker thread (the CPU backend, and the
    control group on GPUs) may still be releasing the tensors of a finished collective; if that
    needs the GIL while Python is finalising, the process aborts with SIGABRT after a run that
    succeeded (seen on torch 2.13 under CPU load; the race is described in pytorch PR #179291).
    Everything is written and closed by now."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
