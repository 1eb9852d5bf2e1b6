"""Train a decoder-only Transformer or a Free Transformer with FSDP, DDP or on one device.

One file, raw torch.distributed. Read main() top to bottom: config -> distributed setup ->
model -> wrapping -> data -> optimizer -> loop -> checkpoint -> exit.

    python train_fsdp.py                                  # one process (CPU or one GPU)
    torchrun --nproc_per_node=4 train_fsdp.py             # one node, 4 GPUs
    srun python train_fsdp.py                             # Slurm tasks, no torchrun

To train your own model, change the four seams: build_model, compute_loss, load_dataset
(the batch source) and the block classes that build_model returns (the FSDP wrap unit and
the activation-checkpointing unit). main() takes each as an argument.
"""

import argparse
import contextlib
import dataclasses
import datetime
import functools
import json
import math
import os
import random
import resource
import shutil
import signal
import sys
import time
import tomllib
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (BackwardPrefetch, CPUOffload, FullyShardedDataParallel as FSDP,
                                    MixedPrecision, ShardingStrategy)
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.fsdp.wrap import (ModuleWrapPolicy, lambda_auto_wrap_policy,
                                         size_based_auto_wrap_policy)
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import data as data_lib
import model as model_lib

# =============================================================================================
# Configuration: one tree of dataclasses. Every field is a command-line flag (--field-name),
# a key of the TOML table of its section, and may be set by a preset.
# Precedence: command line > config file > preset > default.


opt = data_lib.opt  # a dataclass field with its help line (and valid values): one helper for all sections


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
    auto_wrap: str = opt("module", "FSDP unit policy: module (ModuleWrapPolicy on the block class), lambda "
                         "(predicate), size (min_num_params)", ["module", "lambda", "size"])
    min_num_params: int = opt(1_000_000, "parameters per unit for --auto-wrap size")
    activation_checkpointing: bool = opt(False, "recompute blocks in backward (non-reentrant checkpoint_wrapper)")
    ac_every: int = opt(1, "checkpoint every k-th block (1 = all)")
    param_dtype: str = opt("bf16", "dtype of parameters in forward/backward", ["bf16", "fp16", "fp32"])
    reduce_dtype: str = opt("fp32", "dtype of gradient reduction", ["bf16", "fp16", "fp32"])
    buffer_dtype: str = opt("fp32", "dtype of buffers (the built-in models have none: RoPE is computed in fp32)",
                            ["bf16", "fp16", "fp32"])


@dataclass
class TrainConfig:
    preset: str = opt("", "named setting bundle; individual flags override it",
                      ["", "single_node_fsdp", "multi_node_fsdp", "large_scale_fsdp", "ddp"])
    strategy: str = opt("fsdp", "data parallelism", ["fsdp", "ddp", "none"])
    seed: int = opt(1337, "seed for init, data order and sampling")
    global_batch: int = opt(64, "sequences per optimizer step, over all ranks and micro-batches")
    micro_batch: int = opt(0, "sequences per rank per forward; 0 = global_batch / world_size")
    grad_accum_mode: str = opt("no_sync", "no_sync: reduce once per step (full-size grads held); sync: reduce "
                               "every micro-batch (less memory, more traffic)", ["no_sync", "sync"])
    max_steps: int = opt(0, "optimizer steps; 0 = derived from --epochs")
    epochs: float = opt(1.0, "passes over the training set when --max-steps is 0")
    lr: float = opt(1e-3, "peak learning rate")
    min_lr_ratio: float = opt(0.1, "final learning rate as a fraction of the peak")
    warmup_steps: int = opt(50, "linear warmup steps before cosine decay")
    lr_scale_base_batch: int = opt(0, "if > 0, scale lr linearly by global_batch / this")
    weight_decay: float = opt(0.1, "AdamW weight decay, on >= 2-D weights only")
    beta1: float = opt(0.9, "AdamW beta1")
    beta2: float = opt(0.95, "AdamW beta2")
    grad_clip: float = opt(1.0, "max global gradient norm; 0 = no clipping")
    eval_every: int = opt(100, "validate every N steps (and at the end); 0 = only at the end")
    eval_samples: int = opt(512, "validation sequences per evaluation")
    log_every: int = opt(10, "log metrics every N steps")
    skip_nonfinite: bool = opt(False, "skip an optimizer step whose gradient norm is NaN/inf instead of stopping")
    out_dir: str = opt("", "run directory; empty = runs/<arch>-<date-time>")
    overwrite: bool = opt(False, "start afresh in a run directory that holds a run (its checkpoints are deleted)")
    compile: bool = opt(False, "torch.compile the model (forces use_orig_params with FSDP)")
    profile: bool = opt(False, "write a Chrome trace of steps 2-4 per rank into the run directory")
    debug: bool = opt(False, "TORCH_DISTRIBUTED_DEBUG=DETAIL and NCCL/gloo debug logging")


@dataclass
class CheckpointConfig:
    checkpoint_type: str = opt("sharded", "sharded: torch.distributed.checkpoint, every rank writes its shard, "
                               "reshardable; full: one consolidated file written by rank 0", ["sharded", "full"])
    save_every: int = opt(0, "save a checkpoint every N steps; 0 = only at the end (and on SIGTERM/SIGUSR1)")
    save_final: bool = opt(True, "save a checkpoint at the end (benchmarks turn it off)")
    keep_checkpoints: int = opt(3, "keep the newest K complete checkpoints")
    full_optimizer: bool = opt(True, "full checkpoints also hold the optimizer state (needed to resume)")
    resume: str = opt("auto", "auto: continue from the run directory's latest complete checkpoint; never: "
                      "refuse a run directory that holds a run; or a checkpoint directory to continue from")
    init_from: str = opt("", "start a new run from the weights of this checkpoint (run dir, step dir or model.pt)")


@dataclass
class Config:
    model: model_lib.ModelConfig = field(default_factory=model_lib.ModelConfig)
    data: data_lib.DataConfig = field(default_factory=data_lib.DataConfig)
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

# Warnings torch prints on every rank for choices made here on purpose (FSDP1's ShardedTensor
# state dicts, NO_SHARD on one process, gloo+nccl groups): silenced so rank 0's log stays readable.
for pattern in ("Please use DTensor instead", "_get_pg_default_device", "Multiple backends are registered",
                "FSDP is switching to use `NO_SHARD`", "When using ``NO_SHARD``", "torch.distributed.checkpoint"):
    warnings.filterwarnings("ignore", message=f".*{pattern}")

# What only FSDP reads (param_dtype and activation checkpointing serve DDP and one device too).
FSDP_ONLY = {"sharding_strategy", "hybrid_shard_size", "backward_prefetch", "forward_prefetch", "limit_all_gathers",
             "use_orig_params", "cpu_offload", "sync_module_states", "auto_wrap", "min_num_params", "reduce_dtype",
             "buffer_dtype"}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Dense bf16 peak per GPU (datasheet, no sparsity), for MFU.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "GH200": 989e12, "A100": 312e12, "L40S": 362e12}
EXIT_FAILED, EXIT_BAD_INPUT, EXIT_PREEMPTED = 1, 2, 3  # 3: stopped by a signal, checkpoint saved
STOPPED_FILE = "stopped.json"  # in the run directory after an exit with code 3; removed at the next start


class BadInput(Exception):
    """A mistake in what the user asked for: reported in one line, exit code 2."""


class RunFailed(Exception):
    """The run cannot go on (non-finite loss, a save that failed): one line, exit code 1."""


class CorruptCheckpoint(RunFailed):
    """A checkpoint whose files cannot be read; --resume auto tries an older one."""


def sections(cfg):
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def flag_name(name):
    return "--" + name.replace("_", "-")


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        if message.startswith("unrecognized arguments"):
            message += " (python train_fsdp.py --help lists the valid flags)"
        raise BadInput(message)


def build_arg_parser():
    parser = OneLineParser(description="Train with FSDP / DDP / one device. Every setting is a flag; "
                           "--config FILE.toml sets the same fields by [section].", allow_abbrev=False)
    parser.add_argument("--config", default="", help="TOML file with [model], [data], [fsdp], [train], "
                        "[checkpoint] tables")
    parser.add_argument("--export", metavar="CHECKPOINT_DIR", default=argparse.SUPPRESS,
                        help="write CHECKPOINT_DIR/model.pt from a sharded checkpoint, then exit (given alone)")
    for section, obj in sections(Config()).items():
        group = parser.add_argument_group(section)
        for f in dataclasses.fields(obj):
            kw = dict(dest=f"{section}.{f.name}", default=argparse.SUPPRESS, help=f.metadata.get("help", ""))
            if f.type in (bool, "bool"):
                group.add_argument(flag_name(f.name), action=argparse.BooleanOptionalAction, **kw)
            else:
                typ = {"int": int, "float": float, "str": str}.get(f.type, f.type)
                group.add_argument(flag_name(f.name), type=typ, choices=f.metadata.get("choices"), **kw)
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
    typ = {"int": int, "float": float, "str": str, "bool": bool}.get(f.type, f.type)
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if type(value) is not typ:
        raise BadInput(f"{source}: {section}.{key} = {value!r} must be of type {typ.__name__}")
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise BadInput(f"{source}: {section}.{key} = {value!r}; valid values: {', '.join(map(repr, choices))}")
    setattr(sec, key, value)


def parse_config(argv):
    args = vars(build_arg_parser().parse_args(argv))
    if "export" in args:
        raise BadInput("--export takes a checkpoint directory and no other flag")
    config_path = args.pop("config")
    cli = {}
    for dest, value in args.items():
        section, key = dest.split(".")
        cli.setdefault(section, {})[key] = value
    file_values = {}
    if config_path:
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

    cfg = Config()

    def chosen(section, key):  # a preset name itself follows command line > file > default
        return cli.get(section, {}).get(key, file_values.get(section, {}).get(key, ""))

    layers = []
    preset = chosen("train", "preset")
    if preset:
        if preset not in PRESETS:
            raise BadInput(f"--preset {preset!r} (from {'the command line' if 'preset' in cli.get('train', {}) else config_path}); "
                           f"valid presets: {', '.join(PRESETS)}")
        layers.append((PRESETS[preset], f"preset {preset}"))
    size = chosen("model", "size")
    if size:
        if size not in model_lib.SIZE_PRESETS:
            raise BadInput(f"--size {size!r} (from {'the command line' if 'size' in cli.get('model', {}) else config_path}); "
                           f"valid sizes: {', '.join(model_lib.SIZE_PRESETS)}")
        layers.append(({"model": model_lib.SIZE_PRESETS[size]}, f"size {size}"))
    layers += [(file_values, config_path), (cli, "command line")]
    for values, source in layers:
        for section, table in values.items():
            for key, value in table.items():
                set_field(cfg, section, key, value, source)
    return cfg


def check_ranges(cfg):
    """Numbers outside their range, each reported by its flag before anything is written."""
    m, t, f, c = cfg.model, cfg.train, cfg.fsdp, cfg.checkpoint
    rules = [("global_batch", t.global_batch >= 1, ">= 1"), ("micro_batch", t.micro_batch >= 0, ">= 0"),
             ("max_steps", t.max_steps >= 0, ">= 0"), ("epochs", t.epochs > 0, "> 0"),
             ("lr", t.lr > 0, "> 0"), ("min_lr_ratio", 0 <= t.min_lr_ratio <= 1, "in [0, 1]"),
             ("warmup_steps", t.warmup_steps >= 0, ">= 0"), ("weight_decay", t.weight_decay >= 0, ">= 0"),
             ("beta1", 0 <= t.beta1 < 1, "in [0, 1)"), ("beta2", 0 <= t.beta2 < 1, "in [0, 1)"),
             ("grad_clip", t.grad_clip >= 0, ">= 0"), ("eval_every", t.eval_every >= 0, ">= 0"),
             ("eval_samples", t.eval_samples >= 1, ">= 1"), ("log_every", t.log_every >= 1, ">= 1"),
             ("save_every", cfg.checkpoint.save_every >= 0, ">= 0"),
             ("keep_checkpoints", cfg.checkpoint.keep_checkpoints >= 1, ">= 1"), ("lr_scale_base_batch", t.lr_scale_base_batch >= 0, ">= 0"),
             ("ac_every", f.ac_every >= 1, ">= 1"), ("min_num_params", f.min_num_params >= 1, ">= 1"),
             ("hybrid_shard_size", f.hybrid_shard_size >= 0, ">= 0"),
             ("n_layer", m.n_layer >= 1, ">= 1"), ("d_model", m.d_model >= 1, ">= 1"),
             ("n_head", m.n_head >= 1, ">= 1"), ("n_kv_head", m.n_kv_head >= 0, ">= 0"),
             ("ffn_hidden", m.ffn_hidden >= 0, ">= 0"), ("vocab_size", m.vocab_size >= 0, ">= 0"),
             ("dropout", 0 <= m.dropout < 1, "in [0, 1)"), ("init_std", m.init_std > 0, "> 0"),
             ("kappa", m.kappa >= 0, ">= 0"), ("mapper_chunk", m.mapper_chunk >= 1, ">= 1"),
             ("rope_theta", m.rope_theta > 0, "> 0"), ("norm_eps", m.norm_eps > 0, "> 0"),
             ("val_fraction", 0 < cfg.data.val_fraction <= 0.5, "in (0, 0.5]")]
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
            value = next(getattr(sec, name) for sec in (m, t, f, c, cfg.data) if hasattr(sec, name))
            raise BadInput(f"{flag_name(name)} {value}: must be {valid}")


def check_config(cfg):
    t, f = cfg.train, cfg.fsdp
    check_ranges(cfg)
    if f.cpu_offload and t.grad_accum_mode == "sync" and t.strategy == "fsdp":
        raise BadInput("--grad-accum-mode sync with --cpu-offload: FSDP overwrites instead of accumulating "
                       "offloaded gradients outside no_sync; use --grad-accum-mode no_sync")
    if f.meta_init and t.strategy != "fsdp":
        raise BadInput(f"--meta-init needs --strategy fsdp (got {t.strategy})")
    if f.meta_init and cfg.model.tie_embeddings:
        raise BadInput("--meta-init with --tie-embeddings: materialising unit by unit breaks the tie; "
                       "use one of them")
    if "fp16" in (f.param_dtype, f.reduce_dtype) and t.strategy == "none" and f.param_dtype != "fp16":
        raise BadInput("--reduce-dtype fp16 without --param-dtype fp16 has no meaning here")
    try:
        model_lib.resolve_model_config(cfg.model)
    except ValueError as e:
        raise BadInput(str(e))


# =============================================================================================
# Distributed setup


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

    if cfg.train.strategy == "fsdp" and not torch.cuda.is_available():
        if cfg.fsdp.cpu_offload:
            raise BadInput("--cpu-offload needs a GPU: without one the parameters already live on the CPU "
                           "(and FSDP's pinned-memory offload cannot run)")
        if cfg.fsdp.sync_module_states:
            raise BadInput("--sync-module-states needs a GPU: FSDP1 broadcasts only GPU tensors; on CPU "
                           "every rank already builds the same weights from --seed")
    if cfg.train.debug:
        # torch reads TORCH_DISTRIBUTED_DEBUG once, when torch.distributed is imported: setting the
        # variable now is not enough, so set the level itself too, before the process group exists.
        env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        env.setdefault("NCCL_DEBUG", "INFO")
        dist.set_debug_level_from_env()
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
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    elif owner:
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout,
                                device_id=device if backend == "nccl" else None)
    if rank == 0 and backend == "gloo" and owner:
        print("no CUDA device: running on CPU with the gloo backend")
    # Small control messages (stop flags, error strings) go through gloo on the CPU, so reading
    # them never waits for the GPU stream.
    control = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
    return dict(rank=rank, world=world, local_rank=local_rank, local_world=local_world,
                device=device, backend=backend, owner=owner, control=control)


def check_world(cfg, dist_info):
    """Checks that need the world size, before anything is written. Returns (micro, accum):
    global batch = micro-batch x world size x accumulation steps."""
    t, f, world = cfg.train, cfg.fsdp, dist_info["world"]
    if t.strategy == "none" and world > 1:
        raise BadInput(f"--strategy none with {world} processes would train {world} unsynchronised copies; "
                       "use --strategy fsdp or ddp, or launch one process")
    if t.global_batch < world:
        raise BadInput(f"--global-batch {t.global_batch} is smaller than the world size {world}; every process "
                       "needs at least one sequence per step")
    micro = t.micro_batch or t.global_batch // world
    if t.global_batch % (micro * world):
        raise BadInput(f"--global-batch {t.global_batch} is not divisible by micro-batch {micro} x world size "
                       f"{world}; choose a global batch that is a multiple of {micro * world}")
    if t.strategy == "fsdp" and "HYBRID" in f.sharding_strategy:
        shard = hybrid_shard_size(cfg, dist_info)
        if world % shard:
            raise BadInput(f"--hybrid-shard-size {shard} must divide the world size {world}")
        if shard == 1 and world > 1:
            # One process per shard group is pure replication. FSDP1 would turn the group into
            # NO_SHARD and then skip the all-reduce across replicas (seen on torch 2.13): the
            # replicas would silently diverge. NO_SHARD over everyone computes what was asked.
            if dist_info["rank"] == 0:
                print(f"{f.sharding_strategy} with 1 process per shard group is pure replication: "
                      "using NO_SHARD across all processes")
            f.sharding_strategy = "NO_SHARD"
    return micro, t.global_batch // (micro * world)


def hybrid_shard_size(cfg, dist_info):
    """Processes per shard group for HYBRID_SHARD*: the flag, or the processes of one node."""
    return cfg.fsdp.hybrid_shard_size or dist_info["local_world"]


def agree(fn, rank):
    """Run fn on rank 0 only (file-system work) and share its result or its error with every
    rank, so all ranks exit together instead of the others hanging at the next collective."""
    out = [None, None]  # error, result
    if rank == 0:
        try:
            out[1] = fn()
        except (BadInput, RunFailed, data_lib.DataError) as e:
            out[0] = str(e)
        except OSError as e:  # e.g. --out-dir is a file, a read-only or full disk
            out[0] = f"{e.strerror}: {e.filename}"
        except Exception as e:  # anything else (a file that is not a checkpoint, ...) must not hang the others
            out[0] = f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(out, src=0)
    if out[0]:
        raise BadInput(out[0])
    return out[1]


# =============================================================================================
# Seams: model, loss, data. Replace these three to train your own model with this file.


def build_model(cfg):
    """Returns (model, wrap_classes, checkpoint_classes): the module, the block classes FSDP
    makes into units, and the block classes activation checkpointing recomputes."""
    model = model_lib.build_model(cfg.model)
    wrap = {model_lib.DecoderBlock, model_lib.LatentSampler}
    return model, wrap, {model_lib.DecoderBlock}


def compute_loss(model, x, y, cfg):
    """Returns (loss to backpropagate, dict of detached scalars to log)."""
    logits, z_logits = model(x)
    return model_lib.lm_loss(logits, y, z_logits, cfg.model.kappa)


def load_dataset(cfg, rank):
    """Rank 0 tokenises and caches; everyone then opens the cache read-only."""
    agree(lambda: data_lib.prepare_data(cfg.data), rank)
    try:
        return data_lib.load_data(cfg.data, cfg.train.seed)
    except data_lib.DataError as e:
        raise BadInput(str(e))


# =============================================================================================
# Wrapping


def wrap_model(model, wrap_classes, ckpt_classes, cfg, dist_info, init_fn=None):
    t, f, device = cfg.train, cfg.fsdp, dist_info["device"]
    blocks = [m for m in model.modules() if isinstance(m, tuple(ckpt_classes))]
    if t.strategy == "none":
        model = model.to(device)
    elif t.strategy == "ddp":
        # Gradients as views into DDP's all-reduce buckets: no second copy of every gradient.
        model = DDP(model.to(device), device_ids=[device.index] if device.type == "cuda" else None,
                    gradient_as_bucket_view=True)
    else:
        model = FSDP(model, **fsdp_kwargs(cfg, wrap_classes, dist_info, init_fn))
    if f.activation_checkpointing:
        # Non-reentrant: the reentrant variant fires FSDP's post-backward hooks twice.
        chosen = set(blocks[::f.ac_every])
        apply_activation_checkpointing(
            model, check_fn=lambda m: m in chosen,
            checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT))
    if t.compile:
        model = torch.compile(model)
    return model


def fsdp_kwargs(cfg, wrap_classes, dist_info, init_fn):
    f = cfg.fsdp
    if f.auto_wrap == "module":
        policy = ModuleWrapPolicy(wrap_classes)
    elif f.auto_wrap == "lambda":
        # The predicate is where a custom rule goes (e.g. also wrap large embeddings).
        policy = functools.partial(lambda_auto_wrap_policy,
                                   lambda_fn=lambda m: isinstance(m, tuple(wrap_classes)))
    else:
        policy = functools.partial(size_based_auto_wrap_policy, min_num_params=f.min_num_params)
    kw = dict(
        auto_wrap_policy=policy,
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
        device_id=dist_info["device"],
    )
    if "HYBRID" in f.sharding_strategy:
        # Shard inside a group of `shard` processes (a node), replicate across groups. An
        # explicit mesh, because FSDP's default guesses the node size from the GPU count.
        shard = hybrid_shard_size(cfg, dist_info)
        kw["device_mesh"] = init_device_mesh(dist_info["device"].type, (dist_info["world"] // shard, shard),
                                             mesh_dim_names=("replicate", "shard"))
    if f.meta_init:
        device = dist_info["device"]

        def param_init_fn(module):  # called once per module; initialise its own tensors only
            module.to_empty(device=device, recurse=False)
            if init_fn is not None:
                with torch.no_grad():
                    init_fn(module)
            elif hasattr(module, "reset_parameters"):
                module.reset_parameters()
        kw["param_init_fn"] = param_init_fn
    return kw


# =============================================================================================
# Optimizer and schedule


def unwrapped_name(name):
    """A parameter's name in the plain model, whatever FSDP, DDP, checkpointing or compile added."""
    for wrapper in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(wrapper, "")
    return name.removeprefix("module.")


def build_optimizer(model, cfg, lr, device, decay_names):
    """AdamW with weight decay on the >= 2-D weights (decay_names, taken before wrapping: FSDP1
    exposes sharded parameters as 1-D views). With use_orig_params=False FSDP flattens them into
    FlatParameters, so decay cannot be told apart: it then goes to all."""
    named = [(unwrapped_name(n), p) for n, p in model.named_parameters() if p.requires_grad]
    if cfg.train.strategy == "fsdp" and not cfg.fsdp.use_orig_params:
        groups = [{"params": [p for _, p in named], "weight_decay": cfg.train.weight_decay}]
    else:
        groups = [{"params": [p for n, p in named if n in decay_names], "weight_decay": cfg.train.weight_decay},
                  {"params": [p for n, p in named if n not in decay_names], "weight_decay": 0.0}]
    # Fused AdamW needs the parameters on the GPU, and it rejects ShardedGradScaler's found_inf
    # (shape [1], seen on torch 2.11), so fp16 takes the foreach implementation.
    fused = device.type == "cuda" and not cfg.fsdp.cpu_offload and cfg.fsdp.param_dtype != "fp16"
    return torch.optim.AdamW(groups, lr=lr, betas=(cfg.train.beta1, cfg.train.beta2), fused=fused)


def lr_at(step, peak, cfg, max_steps):
    """Linear warmup, then cosine decay reaching min_lr_ratio * peak at the last step."""
    t = cfg.train
    if step < t.warmup_steps:
        return peak * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, max_steps - 1 - t.warmup_steps)
    return peak * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def clip_gradients(model, max_norm, strategy):
    """Global gradient norm (and clipping when max_norm > 0). FSDP must use its own
    clip_grad_norm_: torch.nn.utils' version only sees this rank's shard."""
    limit = max_norm if max_norm > 0 else float("inf")
    if strategy == "fsdp":
        return model.clip_grad_norm_(limit)
    return torch.nn.utils.clip_grad_norm_(model.parameters(), limit)


# =============================================================================================
# Training step, evaluation, checkpoint


def precision_context(cfg, device):
    """FSDP casts through MixedPrecision; DDP and one device use autocast for the same dtype."""
    dtype = DTYPES[cfg.fsdp.param_dtype]
    if cfg.train.strategy == "fsdp" or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def train_step(model, optimizer, scaler, data, step, accum, micro, cfg, dist_info, loss_fn):
    """One optimizer step over accum micro-batches. Each micro-batch loss is divided by accum,
    so the summed gradient equals the gradient of the mean loss over the global batch.
    Returns (mean losses, global gradient norm, whether the step was skipped, seconds spent
    fetching batches on this rank)."""
    rank, world, device = dist_info["rank"], dist_info["world"], dist_info["device"]
    totals, data_time = {}, 0.0
    for m in range(accum):
        start = (m * world + rank) * micro
        t0 = time.perf_counter()
        x, y = (t.to(device, non_blocking=True) for t in data.train_batch(step, cfg.train.global_batch, start, micro))
        data_time += time.perf_counter() - t0
        last = m == accum - 1
        skip_sync = not last and cfg.train.grad_accum_mode == "no_sync" and cfg.train.strategy != "none"
        # no_sync must cover both forward and backward of the micro-batch.
        with model.no_sync() if skip_sync else contextlib.nullcontext():
            with precision_context(cfg, device):
                loss, parts = loss_fn(model, x, y, cfg)
            scaled = loss / accum
            (scaler.scale(scaled) if scaler else scaled).backward()
        for k, v in {"loss": loss.detach(), **parts}.items():
            totals[k] = totals.get(k, 0.0) + v.float() / accum
    if scaler:
        scaler.unscale_(optimizer)
    grad_norm = clip_gradients(model, cfg.train.grad_clip, cfg.train.strategy)
    # The norm is global (the same on every rank), so every rank takes the same decision.
    skipped = cfg.train.skip_nonfinite and scaler is None and not torch.isfinite(grad_norm).item()
    if scaler:
        scaler.step(optimizer)  # skips the step itself when the scaled gradients overflowed
        scaler.update()
    elif not skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return totals, grad_norm, skipped, data_time


@torch.no_grad()
def evaluate(model, data, cfg, dist_info, micro, loss_fn):
    """Mean loss over the fixed validation rows, world-size independent. Every rank runs the
    same number of forwards (FSDP forwards are collectives); a rank with no rows left runs a
    dummy row weighted 0."""
    rank, world, device = dist_info["rank"], dist_info["world"], dist_info["device"]
    n = min(cfg.train.eval_samples, data.n_val)
    model.eval()
    sums = {}
    for chunk in range(0, n, micro * world):
        start = chunk + rank * micro
        count = max(0, min(micro, n - start))
        x, y = data.val_batch(start if count else 0, count or 1)
        with precision_context(cfg, device):
            loss, parts = loss_fn(model, x.to(device), y.to(device), cfg)
        for k, v in {"loss": loss, **parts}.items():
            sums[k] = sums.get(k, 0.0) + v.float() * count
    model.train()
    keys = sorted(sums)
    vec = torch.stack([torch.as_tensor(sums[k], device=device) for k in keys]) / n
    dist.all_reduce(vec)
    return dict(zip(keys, vec.tolist()))


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


def full_state_options(device):
    """Full state dicts are gathered to rank 0 on CPU (cpu_offload). A CPU-only run skips the
    offload: FSDP1 then frees the gathered storage before cloning it (a segfault, seen on
    torch 2.13 with gloo), so every rank gathers instead."""
    return StateDictOptions(full_state_dict=True, cpu_offload=device.type != "cpu")


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


def rng_state():
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def set_rng_state(state):
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def consolidated_payload(state, config, step, tokens_seen, tokenizer):
    """The single-file format: torch.load(path)["model"] loads into an unwrapped model."""
    return {"model": state, "config": config, "step": step, "tokens_seen": tokens_seen, "tokenizer": tokenizer}


def any_rank_error(error, dist_info):
    """The first error (a string, or None) of any rank, on every rank: a rank that fails alone
    must stop every rank, not leave them waiting at the next collective."""
    errors = [None] * dist_info["world"]
    dist.all_gather_object(errors, error, group=dist_info["control"])
    return next((e for e in errors if e), None)


def save_checkpoint(model, optimizer, scaler, cfg, run_dir, step, tokens_seen, data, dist_info, consolidate):
    """Save on every rank (state dicts and DCP are collectives). `consolidate` also writes the
    single-file model.pt next to a sharded checkpoint (done at the end of training)."""
    rank, c = dist_info["rank"], cfg.checkpoint
    root = os.path.join(run_dir, "checkpoints")
    name = f"step_{step:07d}"
    tmp, final = os.path.join(root, f".tmp-{name}"), os.path.join(root, name)
    error = None
    if rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as e:
            error = f"{e.strerror}: {e.filename}"
    failed = f"saving the checkpoint of step {step} failed ({{}}); the previous checkpoint is intact"
    error = any_rank_error(error, dist_info)  # also the barrier: no rank writes before the directory exists
    if error:
        raise RunFailed(failed.format(error))
    try:
        if c.checkpoint_type == "sharded":
            state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
            dcp.save(state, checkpoint_id=os.path.join(tmp, "dcp"))
        if c.checkpoint_type == "full" or consolidate:
            opts = full_state_options(dist_info["device"])
            full = consolidated_payload(get_model_state_dict(model, options=opts), dataclasses.asdict(cfg), step,
                                        tokens_seen, data.tokenizer_path)
            if c.checkpoint_type == "full" and c.full_optimizer:
                full["optim"] = get_optimizer_state_dict(model, optimizer, options=opts)
            if rank == 0:
                torch.save(full, os.path.join(tmp, "model.pt"))
                fsync_path(os.path.join(tmp, "model.pt"))
        torch.save(rng_state(), os.path.join(tmp, f"rng_rank{rank}.pt"))
        fsync_path(os.path.join(tmp, f"rng_rank{rank}.pt"))
    except (Exception, CheckpointException) as e:  # a full disk on one rank must stop every rank, not
        # hang them (DCP's CheckpointException derives from BaseException, not Exception)
        error = f"rank {rank}: {type(e).__name__}: {e}"
    error = any_rank_error(error, dist_info)
    if error:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise RunFailed(failed.format(error.splitlines()[0]))
    if rank == 0:
        try:
            publish_checkpoint(tmp, final, root, name, step, tokens_seen, cfg, data, scaler, dist_info["world"])
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            error = f"{e.strerror}: {e.filename}"
    error = any_rank_error(error, dist_info)
    if error:
        raise RunFailed(failed.format(error))
    return final


def publish_checkpoint(tmp, final, root, name, step, tokens_seen, cfg, data, scaler, world):
    """Rank 0, once every rank has written its files: meta.json, the atomic rename, `latest`,
    then keep-K pruning."""
    files = {os.path.relpath(os.path.join(d, f), tmp): os.path.getsize(os.path.join(d, f))
             for d, _, fs in os.walk(tmp) for f in fs}
    meta = {"step": step, "tokens_seen": tokens_seen, "type": cfg.checkpoint.checkpoint_type, "world_size": world,
            "config": dataclasses.asdict(cfg), "tokenizer": data.tokenizer_path,
            "scaler": scaler.state_dict() if scaler else None, "files": files}
    write_text_atomic(os.path.join(tmp, "meta.json"), json.dumps(meta, indent=1))
    shutil.rmtree(final + ".old", ignore_errors=True)  # left by a save killed mid-swap
    if os.path.exists(final):  # the same step saved again (after a resume): swap, then delete
        os.replace(final, final + ".old")
    os.replace(tmp, final)
    fsync_path(root)
    write_text_atomic(os.path.join(root, "latest"), name + "\n")  # last: it names a complete checkpoint
    shutil.rmtree(final + ".old", ignore_errors=True)
    for old in complete_checkpoints(root)[cfg.checkpoint.keep_checkpoints:]:
        if old != name:
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


def load_checkpoint(path, model, optimizer, scaler, cfg, dist_info):
    """Restore model, optimizer, scaler and RNG states; returns (step, tokens_seen). A sharded
    checkpoint loads at any world size and sharding strategy (DCP reshards). A file that has its
    size but not its content fails here, on some ranks or all: every rank raises RunFailed."""
    meta = check_checkpoint(path)
    error = None  # (message, whether the files are unreadable) of this rank
    try:
        load_states(path, meta, model, optimizer, scaler, cfg, dist_info)
    except RunFailed as e:  # readable, but not resumable (e.g. saved without optimizer state)
        error = (str(e), False)
    except (torch.OutOfMemoryError, MemoryError) as e:  # the files may be fine: no fallback
        error = (f"loading {path} failed on rank {dist_info['rank']}: {type(e).__name__}: {e}", False)
    except (Exception, CheckpointException) as e:  # bytes that do not load (CheckpointException is
        # a BaseException)
        error = (f"rank {dist_info['rank']}: {type(e).__name__}: {e}", True)
    error = any_rank_error(error, dist_info)
    if error and error[1]:
        raise CorruptCheckpoint(f"checkpoint {path} is incomplete or corrupted: {error[0].splitlines()[0]}")
    if error:
        raise RunFailed(error[0].splitlines()[0])
    return meta["step"], meta["tokens_seen"], meta


def load_states(path, meta, model, optimizer, scaler, cfg, dist_info):
    if meta["type"] == "sharded":
        # get_optimizer_state_dict initialises empty optimizer state first, so DCP has tensors to
        # load into even before the first step (otherwise resharding fails on missing keys).
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=os.path.join(path, "dcp"))
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"])
    else:
        payload = torch.load(os.path.join(path, "model.pt"), map_location="cpu", mmap=True, weights_only=True)
        if "optim" not in payload:
            raise RunFailed(f"{path} holds no optimizer state (saved with --no-full-optimizer); start a new run "
                            "from its weights with --init-from instead")
        opts = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, payload["model"], options=opts)
        set_optimizer_state_dict(model, optimizer, payload["optim"], options=opts)
    if scaler and meta["scaler"]:
        scaler.load_state_dict(meta["scaler"])
    rng_file = os.path.join(path, f"rng_rank{dist_info['rank']}.pt")
    if meta["world_size"] == dist_info["world"]:
        set_rng_state(torch.load(rng_file, weights_only=False))
    else:  # other ranks, other streams: seed them from the step so the run stays reproducible
        torch.manual_seed(cfg.train.seed + dist_info["rank"] + 1_000_003 * meta["step"])


def load_resume_checkpoint(path, run_dir, model, optimizer, scaler, cfg, dist_info, log):
    """load_checkpoint; under --resume auto a checkpoint that fails to load (a file with the right
    size and the wrong bytes) gives way to the next older complete one, saying so. Returns the
    path loaded and load_checkpoint's (step, tokens_seen, meta)."""
    failed = []
    while True:
        try:
            loaded = load_checkpoint(path, model, optimizer, scaler, cfg, dist_info)
        except CorruptCheckpoint as e:
            if cfg.checkpoint.resume != "auto":
                raise
            failed.append(path)
            path, _ = agree(lambda: find_resume_checkpoint(run_dir, [], skip=failed), dist_info["rank"])
            if path is None:
                raise RunFailed(f"{e}; no older complete checkpoint in {run_dir}: start from its weights with "
                                "--init-from, or afresh with --overwrite (which deletes its checkpoints)")
            log.line(f"{e}; trying an older checkpoint")
            continue
        if failed:  # resumed from an older step than planned: its later records will be logged again
            log.keep_metrics_until(loaded[0])
        return path, loaded


def checkpoint_weights(path):
    """(kind, location) of the weights of a run dir, a step dir or a model.pt, for --init-from."""
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
        state = torch.load(where, map_location="cpu", mmap=True, weights_only=True)["model"]
        theirs = {k: tuple(v.shape) for k, v in state.items()}
    else:
        metadata = dcp.FileSystemReader(where).read_metadata().state_dict_metadata
        theirs = {k.removeprefix("model."): tuple(m.size) for k, m in metadata.items()
                  if k.startswith("model.") and hasattr(m, "size")}
    problems = [f"{n}: checkpoint {theirs[n]} vs model {s}" for n, s in shapes.items() if n in theirs and theirs[n] != s]
    problems += [f"{n}: missing in the checkpoint" for n in shapes if n not in theirs]
    if problems:
        raise BadInput(f"--init-from {path}: shapes do not match: " + "; ".join(problems[:8]) +
                       (f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""))


def init_weights_from(path, model):
    """Load only the model weights of a checkpoint (fresh optimizer, step 0)."""
    kind, where = checkpoint_weights(path)
    if kind == "full":
        state = torch.load(where, map_location="cpu", mmap=True, weights_only=True)["model"]
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
    else:
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=where)
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
    """Sharded checkpoint -> the single-file model.pt beside it, in one process (no FSDP)."""
    require_checkpoint_dir(path, "--export", "a checkpoint directory such as RUN/checkpoints/step_N")
    meta = check_checkpoint(path)
    if os.path.exists(os.path.join(path, "model.pt")):  # a full checkpoint, or the last of a run
        print(f"{path} already holds a consolidated model.pt")
        return os.path.join(path, "model.pt")
    # Only the model's tensors, read by DCP in this one process (no_dist: no process group): the
    # optimizer's two fp32 copies are never loaded or written (DCP's dcp_to_torch_save would).
    reader = dcp.FileSystemReader(os.path.join(path, "dcp"))
    model_state = {key[len("model."):]: torch.empty(md.size, dtype=md.properties.dtype)
                   for key, md in reader.read_metadata().state_dict_metadata.items()
                   if key.startswith("model.") and isinstance(md, TensorStorageMetadata)}
    with warnings.catch_warnings():  # DCP warns that it assumes one process: that is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": model_state}, storage_reader=reader, no_dist=True)
    tmp = os.path.join(path, "export.tmp")
    torch.save(consolidated_payload(model_state, meta["config"], meta["step"], meta["tokens_seen"],
                                    meta["tokenizer"]), tmp)
    os.replace(tmp, os.path.join(path, "model.pt"))
    print(f"wrote {os.path.join(path, 'model.pt')}")
    return os.path.join(path, "model.pt")


# =============================================================================================
# Observability


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


class RunLog:
    """metrics.jsonl (one JSON object per event) and training_log.txt (the same, readable)."""

    def __init__(self, run_dir, rank):
        self.rank = rank
        if rank == 0:
            self.jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a")
            self.text = open(os.path.join(run_dir, "training_log.txt"), "a")

    def line(self, msg):
        if self.rank == 0:
            tqdm.write(msg)
            self.text.write(msg + "\n")
            self.text.flush()

    def keep_metrics_until(self, step):
        if self.rank == 0:  # keep_metric_lines replaces the file: reopen it
            self.jsonl.close()
            keep_metric_lines(self.jsonl.name, step)
            self.jsonl = open(self.jsonl.name, "a")

    def metrics(self, record):
        if self.rank == 0:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()

    def close(self):
        if self.rank == 0:
            self.jsonl.close()
            self.text.close()


# A resume may not change what the run computes; other changes (logging, max_steps, FSDP
# knobs, world size) are allowed and logged.
RESUME_FIXED = {"model": None, "data": None,  # None: every key but those in RESUME_FREE
                "train": {"seed", "global_batch", "lr", "min_lr_ratio", "warmup_steps", "lr_scale_base_batch",
                          "weight_decay", "beta1", "beta2", "grad_clip"}}
RESUME_FREE = {"mapper_chunk", "size", "cache_dir"}


def config_changes(old, new):
    """(refused, allowed): 'section.key: old -> new' for every difference between two configs."""
    refused, allowed = [], []
    for section, table in new.items():
        for key, value in table.items():
            before = old.get(section, {}).get(key)
            if before == value:
                continue
            fixed = RESUME_FIXED.get(section, set())
            refuse = key not in RESUME_FREE and (fixed is None or key in fixed)
            (refused if refuse else allowed).append(f"{section}.{key}: {before!r} -> {value!r}")
    return refused, allowed


def prepare_run_dir(cfg, rank):
    """Create the run directory and decide what to resume from. Returns (run_dir, checkpoint
    to resume or None, notes to log). A run directory that holds a run is continued
    (--resume auto) when the config matches, refused otherwise, restarted with --overwrite."""
    if not cfg.train.out_dir:
        stamp = [datetime.datetime.now().strftime("%Y%m%d-%H%M%S")]
        dist.broadcast_object_list(stamp, src=0)  # one name for all ranks
        cfg.train.out_dir = os.path.join("runs", f"{cfg.model.arch}-{stamp[0]}")
    run_dir, c = cfg.train.out_dir, cfg.checkpoint

    def decide():
        config_path, notes, resume, meta, old = os.path.join(run_dir, "config.json"), [], None, None, None
        root = os.path.join(run_dir, "checkpoints")
        # Checkpoints without a config.json (deleted by hand, say) are a run all the same.
        holds_run = (os.path.exists(config_path) or bool(complete_checkpoints(root))
                     or os.path.exists(os.path.join(root, "latest")))
        if c.resume not in ("auto", "never"):
            resume = c.resume.rstrip("/")
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
        if old is not None:
            refused, allowed = config_changes(old, dataclasses.asdict(cfg))
            if refused:
                raise BadInput(f"--out-dir {run_dir} already holds a run with another config ({'; '.join(refused)}); "
                               "resuming would silently change it: choose another directory or pass --overwrite")
            notes += [f"changed on resume: {line}" for line in allowed]
        os.makedirs(run_dir, exist_ok=True)
        if os.path.exists(os.path.join(run_dir, STOPPED_FILE)):
            os.remove(os.path.join(run_dir, STOPPED_FILE))
        start = meta["step"] if resume else 0
        keep_metric_lines(os.path.join(run_dir, "metrics.jsonl"), start)
        if not resume and os.path.exists(os.path.join(run_dir, "training_log.txt")):
            os.remove(os.path.join(run_dir, "training_log.txt"))
        for name in os.listdir(os.path.join(run_dir, "checkpoints")) if os.path.isdir(
                os.path.join(run_dir, "checkpoints")) else []:
            if name.startswith(".tmp-"):  # left by a save that was killed
                shutil.rmtree(os.path.join(run_dir, "checkpoints", name), ignore_errors=True)
        write_text_atomic(config_path, json.dumps(dataclasses.asdict(cfg), indent=2))
        return resume, notes

    resume, notes = agree(decide, rank)
    return run_dir, resume, notes


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


# =============================================================================================
# main


class Preempted(Exception):
    """SIGTERM/SIGUSR1 arrived: the checkpoint is saved, exit with EXIT_PREEMPTED."""


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


def write_stopped(run_dir, step, dist_info):
    """Rank 0 writes stopped.json (for launchers that cannot see our exit code: torchrun turns 3
    into 1), then every rank waits for every other. With that, no process exits before every
    rank's save and the file are on disk: save_checkpoint returns on a rank only after all ranks
    have written their files and rank 0 has published the checkpoint (its last step is a
    collective), and this is the next collective. Under `srun --kill-on-bad-exit`, the first
    node whose torchrun exits has Slurm kill the others: by then nothing is left to write."""
    error = None
    if dist_info["rank"] == 0:
        try:
            write_text_atomic(os.path.join(run_dir, STOPPED_FILE), json.dumps({"step": step}) + "\n")
        except OSError as e:
            error = f"{e.strerror}: {e.filename}"
    error = any_rank_error(error, dist_info)
    if error:
        raise RunFailed(f"the checkpoint of step {step} is saved, but {STOPPED_FILE} could not be written "
                        f"({error}): a launcher will take this stop for a failure")


def main(argv=None, build_model=build_model, compute_loss=compute_loss, load_dataset=load_dataset):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--export"]:  # python train_fsdp.py --export RUN/checkpoints/step_N
        if len(argv) != 2:
            raise BadInput("usage: python train_fsdp.py --export CHECKPOINT_DIR")
        export_checkpoint(argv[1])
        return None
    cfg = parse_config(argv)
    check_config(cfg)
    dist_info = setup_distributed(cfg)
    rank, world, device = dist_info["rank"], dist_info["world"], dist_info["device"]
    t, f, c = cfg.train, cfg.fsdp, cfg.checkpoint

    micro, accum = check_world(cfg, dist_info)
    if t.compile and t.strategy == "fsdp" and not f.use_orig_params:
        f.use_orig_params = True
        if rank == 0:
            print("--compile: setting use_orig_params=True (FSDP1 + torch.compile requires it)")

    data = load_dataset(cfg, rank)
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = data.vocab_size
    elif cfg.model.vocab_size < data.vocab_size:
        raise BadInput(f"--vocab-size {cfg.model.vocab_size} is smaller than the data's {data.vocab_size}")

    # Same seed on every rank for the weights, so unwrapped replicas start identical.
    torch.manual_seed(t.seed)
    with torch.device("meta") if f.meta_init else contextlib.nullcontext():
        model, wrap_classes, ckpt_classes = build_model(cfg)
    if c.init_from:  # a bad path or shape fails before anything is written
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        agree(lambda: check_init_from(c.init_from, shapes), rank)
    run_dir, resume, notes = prepare_run_dir(cfg, rank)
    log = RunLog(run_dir, rank)
    if rank == 0:
        print(json.dumps(dataclasses.asdict(cfg), indent=1))

    decay_names = {n for n, p in model.named_parameters() if p.dim() >= 2}
    n_params = sum(p.numel() for p in model.parameters())
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # For MFU: the model's own count of training flops per token, or, for a model that has none
    # (one of yours through the seams), the usual estimate of 6 per parameter.
    flops_tok = model.flops_per_token(data.seq_len) if hasattr(model, "flops_per_token") else 6 * n_params
    model = wrap_model(model, wrap_classes, ckpt_classes, cfg, dist_info, getattr(model, "init_module", None))
    local_params = sum(p.numel() for p in model.parameters())
    rank_params = [None] * world
    dist.all_gather_object(rank_params, local_params)
    torch.manual_seed(t.seed + rank)  # dropout and sampling differ per rank

    max_steps = t.max_steps or math.ceil(t.epochs * data.steps_per_epoch(t.global_batch))
    peak_lr = t.lr * (t.global_batch / t.lr_scale_base_batch if t.lr_scale_base_batch else 1.0)
    optimizer = build_optimizer(model, cfg, peak_lr, device, decay_names)
    fp16 = f.param_dtype == "fp16"
    scaler = None
    if fp16:
        scaler = ShardedGradScaler(device.type) if t.strategy == "fsdp" else torch.amp.GradScaler(device.type)

    start_step, tokens_seen = 0, 0
    for note in notes:
        log.line(note)
    if resume:
        t0 = time.perf_counter()
        resume, (start_step, tokens_seen, meta) = load_resume_checkpoint(resume, run_dir, model, optimizer, scaler,
                                                                         cfg, dist_info, log)
        log.line(f"resumed from {resume} in {time.perf_counter() - t0:.1f} s (step {start_step}, saved by "
                 f"{meta['world_size']} processes" +
                 ("" if meta["world_size"] == world else "; RNG streams re-seeded for the new world size") + ")")
    elif c.init_from:
        init_weights_from(c.init_from, model)
        log.line(f"initialised the weights from {c.init_from} (fresh optimizer, step 0)")

    tokens_per_step = t.global_batch * data.seq_len
    peak = peak_flops(device)
    log.line(f"world {world} | backend {dist_info['backend']} | device {device} "
             f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else ''}".rstrip())
    log.line(f"strategy {t.strategy}" + (f" {f.sharding_strategy} wrap={f.auto_wrap} prefetch={f.backward_prefetch}"
                                         if t.strategy == "fsdp" else "") +
             (f" | dtypes param={f.param_dtype} reduce={f.reduce_dtype} buffer={f.buffer_dtype}"
              if t.strategy == "fsdp" else f" | autocast {f.param_dtype} (reduce/buffer dtypes apply to FSDP only)"))
    log.line(f"parameters: total {n_params:,} | trainable {n_trainable:,} | on rank 0 {local_params:,} "
             f"(fewest on a rank {min(rank_params):,}, most {max(rank_params):,})")
    log.line(f"batch: global {t.global_batch} = micro {micro} x world {world} x accum {accum} "
             f"({t.grad_accum_mode}) | seq {data.seq_len} | {tokens_per_step:,} tokens/step | {max_steps} steps")
    if t.strategy != "fsdp":  # said, not refused: a config written for FSDP may be rerun as DDP to compare
        defaults = dataclasses.asdict(FSDPConfig())
        ignored = [f"{flag_name(k)} {v}" for k, v in dataclasses.asdict(f).items()
                   if k in FSDP_ONLY and v != defaults[k]]
        if ignored:
            log.line(f"with --strategy {t.strategy} these FSDP settings have no effect: {', '.join(ignored)}")
    if t.strategy == "fsdp" and not f.use_orig_params and t.weight_decay > 0:
        log.line("use_orig_params=False: FSDP flattens parameters, so weight decay applies to all of them "
                 "(norm weights too); pass --use-orig-params to exempt 1-D weights")
    if peak is None and device.type == "cuda":
        log.line(f"MFU not reported: unknown bf16 peak for {torch.cuda.get_device_name(device)}")
    if t.debug:
        log.line(f"distributed debug level {dist.get_debug_level().name}, NCCL_DEBUG={os.environ.get('NCCL_DEBUG')}")
    log.line(f"run directory: {run_dir} | checkpoints: {c.checkpoint_type}")

    profiler = None
    if t.profile:
        profiler = torch.profiler.profile(
            schedule=torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1),
            on_trace_ready=lambda p: p.export_chrome_trace(os.path.join(run_dir, f"trace_rank{rank}.json")))
        profiler.start()

    stop_flag, previous_handlers = install_stop_handlers()
    launcher = launcher_pid()
    # The first step whose loss is not finite, tracked on the device without a sync per step
    # and checked (a collective) at log steps and before every save.
    never = 2 ** 62
    first_bad = torch.tensor(never, device=device)

    def check_finite():
        worst = first_bad.clone()
        dist.all_reduce(worst, op=dist.ReduceOp.MIN)
        if worst.item() != never:
            raise RunFailed(f"the loss or its gradient became NaN/inf at step {worst.item()}; stopped without "
                            "saving that state "
                            f"(the latest checkpoint is still the last good one); lower --lr or pass "
                            "--skip-nonfinite")

    model.train()
    window_start, window_steps, window_data = time.perf_counter(), 0, 0.0
    # The bar is for a terminal: in a Slurm or redirected log its redraws would fill the file with
    # one endless line, and the log lines there carry the same numbers.
    bar = tqdm(total=max_steps, initial=start_step, disable=rank != 0 or not sys.stderr.isatty(),
               dynamic_ncols=True, desc="train")
    val = {}
    if start_step >= max_steps:  # every rank: evaluation is collective
        log.line(f"{run_dir} already finished at step {start_step} (max_steps {max_steps}): nothing to train; "
                 "pass a larger --max-steps to continue it")
        val = evaluate(model, data, cfg, dist_info, micro, compute_loss)
    try:
        for step in range(start_step, max_steps):
            lr = lr_at(step, peak_lr, cfg, max_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            totals, grad_norm, skipped, data_time = train_step(model, optimizer, scaler, data, step, accum, micro,
                                                               cfg, dist_info, compute_loss)
            window_data += data_time
            if skipped:
                log.line(f"step {step + 1}: gradient norm {float(grad_norm)}, optimizer step skipped")
            elif not t.skip_nonfinite:
                # A finite loss can still give NaN gradients; either poisons the weights. Under fp16
                # the grad scaler owns non-finite gradients (it skips the step and lowers the
                # scale), but not a non-finite loss: the forward itself overflowed.
                finite = torch.isfinite(totals["loss"])
                if scaler is None:
                    finite &= torch.isfinite(grad_norm.to(device))
                bad = ~finite & (first_bad == never)
                first_bad = torch.where(bad, step + 1, first_bad)
            tokens_seen += tokens_per_step
            window_steps += 1
            bar.update(1)
            if profiler:
                profiler.step()
            if launcher is not None and os.getppid() != launcher:
                stop_flag["signal"] = LAUNCHER_GONE
            stop = torch.tensor([stop_flag["signal"]])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX, group=dist_info["control"])
            last = step == max_steps - 1
            if (step + 1) % t.log_every == 0 or last:
                check_finite()
                keys = sorted(totals)
                vec = torch.stack([totals[k] for k in keys]) / world
                dist.all_reduce(vec)  # every rank, every log step: it is a collective
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                elapsed = time.perf_counter() - window_start
                step_time = elapsed / window_steps
                mem = torch.tensor(memory_stats(device), device=device)
                dist.all_reduce(mem, op=dist.ReduceOp.MAX)
                rec = {"step": step + 1, **dict(zip(keys, vec.tolist())), "lr": lr, "grad_norm": float(grad_norm),
                       "tokens_per_s": tokens_per_step / step_time, "step_time_s": step_time,
                       "data_fraction": window_data / elapsed, "tokens_seen": tokens_seen,
                       "mem_alloc_gib": mem[0].item(),
                       "mem_reserved_gib": mem[1].item(), "mem_peak_gib": mem[2].item()}
                if peak and flops_tok:
                    rec["mfu"] = flops_tok * rec["tokens_per_s"] / world / peak
                log.metrics(rec)
                parts = " ".join(f"{k} {rec[k]:.4f}" for k in keys)
                log.line(f"step {step + 1:>6} | {parts} | lr {lr:.2e} | gnorm {rec['grad_norm']:.3f} | "
                         f"{rec['tokens_per_s']:,.0f} tok/s | {1000 * step_time:.0f} ms/step" +
                         (f" | mfu {100 * rec['mfu']:.1f}%" if "mfu" in rec else "") +
                         f" | mem {rec['mem_peak_gib']:.2f} GiB peak")
                window_start, window_steps, window_data = time.perf_counter(), 0, 0.0
            if (t.eval_every and (step + 1) % t.eval_every == 0) or last:
                t0 = time.perf_counter()
                val = evaluate(model, data, cfg, dist_info, micro, compute_loss)
                log.metrics({"step": step + 1, **{f"val_{k}": v for k, v in val.items()}})
                log.line(f"step {step + 1:>6} | validation " + " ".join(f"{k} {v:.4f}" for k, v in val.items()))
                window_start += time.perf_counter() - t0  # keep evaluation out of the throughput
            if (c.save_every and (step + 1) % c.save_every == 0) or (last and c.save_final) or stop.item():
                check_finite()  # never save a state that has seen a non-finite loss
                t0 = time.perf_counter()
                path = save_checkpoint(model, optimizer, scaler, cfg, run_dir, step + 1, tokens_seen, data,
                                       dist_info, consolidate=last)
                log.line(f"saved {path} in {time.perf_counter() - t0:.1f} s")
                window_start += time.perf_counter() - t0  # and saving
            if stop.item() and not last:
                write_stopped(run_dir, step + 1, dist_info)
                raise Preempted(f"{stop_reason(stop.item())} at step {step + 1}: checkpoint saved, "
                                f"exiting with code {EXIT_PREEMPTED}; run the same command with --out-dir "
                                f"{run_dir} to resume")
    finally:
        bar.close()
        if profiler:
            profiler.stop()
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)
    log.line("final validation: " + " ".join(f"{k} {v:.4f}" for k, v in val.items()))
    log.close()
    dist.barrier()
    if dist_info["owner"]:
        dist.destroy_process_group()
    return val


def run():
    """Command-line entry. Bad input: one line on stderr (rank 0), exit 2. A run that cannot go
    on: one line, exit 1. Stopped by SIGTERM/SIGUSR1 after saving: exit 3 (requeue me)."""
    code, message = 0, None
    try:
        main()
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
