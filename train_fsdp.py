"""Train a decoder-only Transformer or a Free Transformer with FSDP, DDP or on one device.

One file, raw torch.distributed, read top to bottom: config, seams (model, loss, data), distributed
setup, strategies (FSDP1, FSDP2, DDP, one device: a section each), optimizer, step and evaluation,
then main(), which runs them in order; after it, the reference: checkpoints, run dir, logging, CLI.

    python train_fsdp.py                                  # one process (CPU or one GPU)
    torchrun --nproc_per_node=4 train_fsdp.py             # one node, 4 GPUs
    srun python train_fsdp.py                             # Slurm tasks, no torchrun

To train your own model, copy this file alone into your repo and call run() with your seams:

    train_fsdp.run(build_model=..., compute_loss=..., load_dataset=...,  # see "Seams" below
                   model_config=MyModelConfig, data_config=MyDataConfig)  # your dataclasses

Each field of those dataclasses becomes a flag of your script. docs/own-model.md has the details.
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
import tempfile
import threading
import time
import tomllib
import typing
import warnings
import zipfile
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
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
    FSDPModule,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardingStrategy,
    fully_shard,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.fsdp.wrap import (
    ModuleWrapPolicy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
)
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm

# =============================================================================================
# Configuration (docs/configuration.md): dataclasses whose fields are flags (--field-name), keys of
# their section's TOML table and preset entries; command line > config file > preset > default.


def opt(default, help, choices=None, valid=""):
    """A config field: its help, valid values or range (">= 1", "in [0, 1)") become the flag's."""
    return field(default=default, metadata={"help": help, "choices": choices, "valid": valid})


@dataclass
class FSDPConfig:
    sharding_strategy: str = opt("FULL_SHARD", "how parameters, gradients, optimizer state shard",
                                 ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD",
                                  "_HYBRID_SHARD_ZERO2"])
    hybrid_shard_size: int = opt(0, "processes per HYBRID_SHARD* group; 0 = per node", valid=">= 0")
    backward_prefetch: str = opt("BACKWARD_PRE", "when backward all-gathers the next unit",
                                 ["BACKWARD_PRE", "BACKWARD_POST", "NONE"])
    forward_prefetch: bool = opt(False, "issue the next unit's all-gather before this forward")
    limit_all_gathers: bool = opt(True, "rate-limit all-gathers: the CPU cannot run ahead")
    use_orig_params: bool = opt(True, "keep original parameters (per-parameter decay, compile)")
    cpu_offload: bool = opt(False, "keep sharded parameters and gradients on CPU")
    sync_module_states: bool = opt(False, "broadcast rank 0's weights to all ranks at wrap time")
    meta_init: bool = opt(False, "build the model on the meta device, materialise it by unit")
    auto_wrap: str = opt("auto", "FSDP units: auto (blocks from 100M parameters, else one), "
                         "module, lambda, size", ["auto", "module", "lambda", "size"])
    min_num_params: int = opt(1_000_000, "parameters per unit for --auto-wrap size", valid=">= 1")
    activation_checkpointing: bool = opt(False, "recompute blocks in backward (non-reentrant)")
    ac_every: int = opt(1, "checkpoint every k-th block (1 = all)", valid=">= 1")
    param_dtype: str = opt("bf16", "dtype parameters compute in", ["bf16", "fp16", "fp32"])
    weights_dtype: str = opt("fp32", "dtype of the weights, gradients and AdamW state (bf16: half "
                             "their memory, updates rounded)", ["fp32", "bf16"])
    reduce_dtype: str = opt("fp32", "dtype of gradient reduction", ["bf16", "fp16", "fp32"])
    buffer_dtype: str = opt("fp32", "dtype of buffers", ["bf16", "fp16", "fp32"])
    autocast: bool = opt(False, "fsdp, fsdp2: also run forward, loss under autocast(param_dtype)")
    float8: str = opt("", "the blocks' matmuls in float8 (torchao)", ["", "tensorwise", "rowwise"])


@dataclass
class TrainConfig:
    preset: str = opt("", "named setting bundle; individual flags override it",
                      ["", "single_node_fsdp", "multi_node_fsdp", "large_scale_fsdp", "ddp"])
    strategy: str = opt("fsdp", "fsdp (FSDP1), fsdp2 (fully_shard), ddp or none (one process)",
                        ["fsdp", "fsdp2", "ddp", "none"])
    seed: int = opt(1337, "seed for init, data order and sampling")
    global_batch: int = opt(64, "sequences per optimizer step, over all ranks", valid=">= 1")
    micro_batch: int = opt(0, "rows per rank per forward; 0 = global_batch / world", valid=">= 0")
    grad_accum_mode: str = opt("auto", "auto (fsdp, fsdp2: sync, as no_sync holds gradients "
                               "unsharded, fsdp's in param_dtype; ddp, none: no_sync), no_sync "
                               "(reduce once a step) or sync (every micro-batch)",
                               ["auto", "no_sync", "sync"])
    max_steps: int = opt(0, "optimizer steps; 0 = derived from --epochs", valid=">= 0")
    epochs: float = opt(1.0, "passes over the training set when --max-steps is 0", valid="> 0")
    lr: float = opt(1e-3, "peak learning rate", valid="> 0")
    min_lr_ratio: float = opt(0.1, "final learning rate over the peak", valid="in [0, 1]")
    warmup_steps: int = opt(50, "linear warmup steps", valid=">= 0")
    lr_schedule: str = opt("cosine", "cosine, or wsd (flat, then linear)", ["cosine", "wsd"])
    lr_decay_steps: int = opt(0, "cosine: the step the decay ends; wsd: the decay's length; "
                              "0 = from --max-steps", valid=">= 0")
    lr_scale_base_batch: int = opt(0, "if > 0, scale lr by global_batch / this", valid=">= 0")
    weight_decay: float = opt(0.1, "AdamW weight decay, on >= 2-D weights by default", valid=">= 0")
    beta1: float = opt(0.9, "AdamW beta1", valid="in [0, 1)")
    beta2: float = opt(0.95, "AdamW beta2", valid="in [0, 1)")
    optimizer: str = opt("adamw", "adamw, or muon: Muon on the hidden matrices, AdamW on the "
                         "rest (fsdp2, ddp, none)", ["adamw", "muon"])
    muon_lr: float = opt(0.0, "Muon's peak rate; 0 = twice --lr", valid=">= 0")
    grad_clip: float = opt(1.0, "max global gradient norm; 0 = no clipping", valid=">= 0")
    eval_every: int = opt(100, "validate every N steps and at the end; 0: at the end", valid=">= 0")
    eval_samples: int = opt(512, "validation sequences per evaluation", valid=">= 1")
    log_every: int = opt(10, "log metrics every N steps", valid=">= 1")
    skip_nonfinite: bool = opt(False, "skip an optimizer step whose gradient norm is NaN/inf")
    out_dir: str = opt("", "run directory; empty = runs/<model class>-<date-time>")
    overwrite: bool = opt(False, "start afresh in a run directory, deleting its checkpoints")
    compile: bool = opt(False, "torch.compile the model (see --compile-scope) and the loss")
    compile_scope: str = opt("model", "--compile's scope: model, or blocks", ["model", "blocks"])
    compile_mode: str = opt("auto", "auto (reduce-overhead under 100M parameters, else default)",
                            ["auto", "default", "reduce-overhead", "max-autotune-no-cudagraphs"])
    compile_cache: str = opt("", "where --compile keeps graphs and kernels; empty = "
                             "$TORCHINDUCTOR_CACHE_DIR, else .compile_cache beside the run dir")
    profile: bool = opt(False, "write a Chrome trace of steps 2-4 per rank into the run directory")
    debug: bool = opt(False, "distributed debug logging and the flight recorder")
    tensorboard: bool = opt(False, "also write metrics to RUN_DIR/tensorboard")
    wandb: str = opt("", "also log metrics to this W&B project (WANDB_MODE=offline works)")


@dataclass
class CheckpointConfig:
    checkpoint_type: str = opt("sharded", "sharded (DCP) or full (one file)", ["sharded", "full"])
    save_every: int = opt(0, "save every N steps; 0 = at the end (and on a signal)", valid=">= 0")
    save_final: bool = opt(True, "save a checkpoint at the end")
    keep_checkpoints: int = opt(3, "keep the newest K complete checkpoints", valid=">= 1")
    keep_best: bool = opt(False, "also keep the checkpoint of lowest validation loss")
    async_save: bool = opt(False, "write the --save-every checkpoints in the background")
    full_optimizer: bool = opt(True, "full checkpoints also hold the optimizer (to resume)")
    resume: str = opt("auto", "auto (the run directory's latest checkpoint), never, or a path")
    init_from: str = opt("", "start a new run from these weights (run dir, step dir, model.pt)")


def project_module(name):
    """This project's model.py or data.py, imported only where its seams are used (a foreign
    repo's model.py, without this project's ModelConfig, is not it)."""
    try:
        module = importlib.import_module(name)
        getattr(module, {"model": "ModelConfig", "data": "DataConfig"}[name])
        return module
    except (ImportError, AttributeError) as e:
        raise BadInput(f"this project's {name}.py cannot be imported here ({e}): in your own repo, "
                       "run your script that calls train_fsdp.run(...) with your seams (its --help "
                       "lists its flags)") from None


@dataclass
class NoSettings:
    """The [model] or [data] section of seams that bring no settings of their own."""


@dataclass
class Config:
    model: typing.Any = field(default_factory=lambda: project_module("model").ModelConfig())
    data: typing.Any = field(default_factory=lambda: project_module("data").DataConfig())
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


# Bundles named as in common FSDP guides. Each sets fields of the sections above.
FSDP_PREFETCH = {"backward_prefetch": "BACKWARD_PRE", "limit_all_gathers": True}
PRESETS = {
    "single_node_fsdp": {"train": {"strategy": "fsdp"},
                         "fsdp": {"sharding_strategy": "FULL_SHARD", **FSDP_PREFETCH,
                                  "activation_checkpointing": False}},
    "multi_node_fsdp": {"train": {"strategy": "fsdp"},
                        "fsdp": {"sharding_strategy": "HYBRID_SHARD", **FSDP_PREFETCH,
                                 "forward_prefetch": True}},
    "large_scale_fsdp": {"train": {"strategy": "fsdp"},
                         "fsdp": {"sharding_strategy": "FULL_SHARD", **FSDP_PREFETCH,
                                  "activation_checkpointing": True, "meta_init": True}},
    "ddp": {"train": {"strategy": "ddp"}},
}

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Dense bf16 peak per GPU (datasheet, no sparsity), for MFU.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "GH200": 989e12, "A100": 312e12, "L40S": 362e12}
EXIT_FAILED, EXIT_BAD_INPUT, EXIT_PREEMPTED = 1, 2, 3  # 3: stopped by a signal, checkpoint saved
# Below this many parameters a step is more host time than kernels (one_unit, compile_mode).
ONE_UNIT_BELOW = 100_000_000
USER_COMPILE_CACHE = os.environ.get("TORCHINDUCTOR_CACHE_DIR")  # before this process sets it
# A collective that waits longer fails. rank0_does keeps the others waiting for longer work.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)
IGNORE = -100  # y where a token is not a target (an instruction's prompt): cross_entropy ignores it


class BadInput(Exception):
    """A mistake in what the user asked for: reported in one line, exit code 2."""


class RunFailed(Exception):
    """The run cannot go on (non-finite loss, a save that failed): one line, exit code 1."""


class CorruptCheckpoint(RunFailed):
    """A checkpoint whose files cannot be read; --resume auto tries an older one."""


class Preempted(Exception):
    """SIGTERM/SIGUSR1 arrived: the checkpoint is saved, exit with EXIT_PREEMPTED."""


# =============================================================================================
# Seams: model, loss, data and their settings (dataclasses: cfg.model, cfg.data). These defaults
# train this project's model.py on its data.py; in your repo, pass yours to run() (own-model.md).


def build_model(cfg):
    """Returns (model, wrap_classes, checkpoint_classes): the module, the block classes FSDP
    makes into units, and the block classes activation checkpointing recomputes."""
    model_lib = project_module("model")
    if cfg.model.lora_rank and not cfg.checkpoint.init_from:
        raise BadInput("--lora-rank needs --init-from: the weights its adapters adapt")
    model = model_lib.build_model(cfg.model)
    return model, {model_lib.DecoderBlock, model_lib.LatentSampler}, {model_lib.DecoderBlock}


def compute_loss(model, x, y, cfg, positions=None):
    """(loss, detached scalars to log), means over y's targets; positions: of rows that pack
    documents. In evaluation, loss is what runs compare: CE, or the Free Transformer's CE + KL."""
    model_lib = project_module("model")
    logits, latent = model(x, positions=positions)
    lm_loss = model_lib.compiled_lm_loss() if cfg.train.compile else model_lib.lm_loss
    loss, parts = lm_loss(logits, y, latent, cfg.model.kappa)
    if latent is not None and not model.training:
        loss, comparable = model_lib.comparable_losses(model, x, y, parts, positions)
        parts.update(comparable)
    return loss, parts


class BatchSource(typing.Protocol):
    """What the trainer reads from the dataset load_dataset returns (data.Dataset is one). Rows
    are addressed, not iterated: a step's rows are the same at any world size and after a resume."""

    seq_len: int  # tokens per row: x, y are (rows, seq_len) int64, y x shifted by one or IGNORE
    vocab_size: int  # token ids are below it (a model config's resolve(data) may read it)
    n_val: int  # validation rows
    tokenizer_path: str  # saved with every checkpoint, for sampling; "" when there is none
    # Optional: digests, {source: digest} of what the rows are made of; a resume refuses changes.

    def train_batch(self, step: int, global_batch: int, start: int, count: int):
        """(x, y[, positions for compute_loss]): rows [start, start + count) of step `step`."""

    def val_batch(self, start: int, count: int):
        """(x, y): the fixed validation rows [start, start + count)."""

    def steps_per_epoch(self, global_batch: int) -> int:
        """Optimizer steps per pass over the training rows (for --epochs)."""


def load_dataset(cfg, rank) -> BatchSource:
    """Rank 0 builds the token cache on every core of its node; all ranks then open it read-only."""
    data_lib = project_module("data")
    rank0_does(lambda: data_lib.prepare_data(cfg.data), rank, what="building the token cache")
    try:
        return data_lib.open_dataset(cfg.data, cfg.train.seed)
    except data_lib.DataError as e:
        raise BadInput(str(e))


# =============================================================================================
# Distributed setup


@dataclass(frozen=True)
class Topology:
    """Where this process sits among the others; set up once, then only read."""

    rank: int
    world: int  # processes in all
    local_world: int  # processes on this node
    device: torch.device
    backend: str  # nccl or gloo
    owner: bool = True  # this process created the process group (a test driver may have)
    control: object = None  # control messages (stop flags, errors): gloo, never waiting on a GPU
    mesh: object = None  # the device mesh, where the strategy uses one (device_mesh)


def launch_env():
    """(rank, world, local rank, local world) from torchrun's variables, or from Slurm's when srun
    starts the tasks itself, else a single process. The GPU comes from the LOCAL rank."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
        return int(env["RANK"]), world, int(env.get("LOCAL_RANK", 0)), local_world
    # SLURM_STEP_NUM_TASKS is srun's; SLURM_NTASKS would also match a plain python in an allocation.
    if int(env.get("SLURM_STEP_NUM_TASKS", "1")) > 1:
        if "MASTER_ADDR" not in env:
            raise BadInput("srun without torchrun: set MASTER_ADDR (first host of the allocation) "
                           "and MASTER_PORT")
        env.setdefault("MASTER_PORT", "29500")
        world = int(env["SLURM_STEP_NUM_TASKS"])
        nodes = int(env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", "1")))
        return int(env["SLURM_PROCID"]), world, int(env["SLURM_LOCALID"]), world // nodes
    return 0, 1, 0, 1


def setup_distributed(cfg):
    """The process group, one per run, and this process's device."""
    rank, world, local_rank, local_world = launch_env()
    if cfg.train.debug:  # debugging.py: torch's and NCCL's debug logging, the flight recorder
        import_optional("debugging", "--debug").debug_env(cfg.train.out_dir or "runs", rank)
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise BadInput(f"local rank {local_rank} but only {torch.cuda.device_count()} GPUs "
                           "visible on this node; launch at most that many processes per node")
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    owner = not dist.is_initialized()  # a caller (a test driver) may have set up the group already
    if owner:  # FSDP and DDP need a group even for one process: then a HashStore (needs no port)
        dist.init_process_group(group_backends(cfg, backend), rank=rank, world_size=world,
                                store=dist.HashStore() if world == 1 else None,
                                timeout=COLLECTIVE_TIMEOUT,
                                device_id=device if backend == "nccl" and world > 1 else None)
    control = (dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT) if backend == "nccl"
               else dist.group.WORLD)
    return Topology(rank=rank, world=world, local_world=local_world, device=device,
                    backend=backend, owner=owner, control=control)


def group_backends(cfg, backend):
    """On GPUs, gloo too for a strategy that all-reduces CPU tensors (Strategy.host_grads)."""
    host_grads = strategy_of(cfg).host_grads and cfg.fsdp.cpu_offload
    return "cuda:nccl,cpu:gloo" if backend == "nccl" and host_grads else backend


# =============================================================================================
# Strategies: a Strategy names all that a --strategy decides. The next three sections fill one each
# (FSDP1, FSDP2, then DDP and one device), each opening with its wrapping; others ask the strategy.


@dataclass(frozen=True)
class Strategy:
    wrap: typing.Callable  # (model, policy, blocks, cfg, topo, init_fn) -> the model to train
    no_sync: typing.Callable  # (model) -> a context whose backward does not reduce gradients
    clip: typing.Callable  # (model, limit) -> the global gradient norm, clipped to limit
    scaler: type  # fp16's loss scaler: it sees an overflow in any rank's gradients
    resolve: typing.Callable  # (cfg, topo): the defaults it decides, changed ones said
    shards: bool = False  # FSDP: units on a device mesh, cast by a mixed-precision policy
    compiles_units: bool = False  # --compile compiles each block as a module, not in place
    host_grads: bool = False  # --cpu-offload leaves gradients on the host: CPU collectives
    copies_shards: bool = False  # a sharded state dict copies the shards (saved to the host)


STRATEGIES = {}  # --strategy -> its Strategy, set at the end of each strategy's section


def strategy_of(cfg):
    return STRATEGIES[cfg.train.strategy]


# =============================================================================================
# --strategy fsdp: FSDP1, FullyShardedDataParallel. Its auto-wrap policy (wrap_policy) makes units,
# each gathered only for its own forward and backward; MixedPrecision casts.


def wrap_fsdp1(model, policy, blocks, cfg, topo, init_fn):
    """Compile in place (dynamo would trace FSDP1's own forward: dozens of frames, each guarded
    every step), checkpoint, then wrap. --meta-init: param_init_fn materialises unit by unit."""
    f = cfg.fsdp
    compile_in_place(model, blocks, cfg, whole=True)
    checkpoint_blocks(blocks, f)
    precision = MixedPrecision(param_dtype=DTYPES[f.param_dtype],
                               reduce_dtype=DTYPES[f.reduce_dtype],
                               buffer_dtype=DTYPES[f.buffer_dtype])
    prefetch = None if f.backward_prefetch == "NONE" else BackwardPrefetch[f.backward_prefetch]
    return FSDP(model, auto_wrap_policy=policy,
                sharding_strategy=ShardingStrategy[f.sharding_strategy], mixed_precision=precision,
                backward_prefetch=prefetch, forward_prefetch=f.forward_prefetch,
                limit_all_gathers=f.limit_all_gathers, use_orig_params=f.use_orig_params,
                cpu_offload=CPUOffload(offload_params=f.cpu_offload),
                sync_module_states=f.sync_module_states,
                param_init_fn=meta_init_fn(model, init_fn, topo) if f.meta_init else None,
                device_id=topo.device,  # on CPU too: without it FSDP1 asks for an accelerator
                device_mesh=topo.mesh)


def wrap_policy(model, wrap_classes, cfg):
    """FSDP1's auto_wrap_policy, whose units FSDP2 shards too; None: the root is the one unit."""
    f, blocks = cfg.fsdp, tuple(wrap_classes)
    if one_unit(f, parameter_count(model)):
        return None
    if f.auto_wrap == "size":
        return functools.partial(size_policy, min_num_params=f.min_num_params,
                                 tied=modules_sharing_outside(model))
    if f.auto_wrap == "lambda":
        return functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, blocks))
    return ModuleWrapPolicy(wrap_classes)


def size_policy(module, recurse, nonwrapped_numel, min_num_params, tied):
    """torch's size_based_auto_wrap_policy, but never a module that shares a parameter with one
    outside it (a tied embedding): in a unit apart from its twin, FSDP frees what the twin reads."""
    large = size_based_auto_wrap_policy(module, recurse, nonwrapped_numel, min_num_params)
    return large and (recurse or module not in tied)


def modules_sharing_outside(model):
    holders = collections.defaultdict(set)  # parameter -> the modules that hold it directly
    for m in model.modules():
        for p in m.parameters(recurse=False):
            holders[p].add(m)
    return {m for m in model.modules() if any(holders[p] - {*m.modules()} for p in m.parameters())}


def resolve_fsdp1(cfg, topo):
    t, f = cfg.train, cfg.fsdp
    if t.grad_accum_mode == "auto":
        # sync: no_sync holds every gradient unsharded, and in param_dtype. --cpu-offload needs it.
        t.grad_accum_mode = "no_sync" if f.cpu_offload else "sync"
        if f.cpu_offload and f.param_dtype != f.reduce_dtype:
            say(topo, "--cpu-offload: accumulating with no_sync (FSDP1 offload allows no other), "
                f"in {f.param_dtype}")
    if t.compile and not f.use_orig_params:
        f.use_orig_params = True
        say(topo, "--compile: setting use_orig_params=True (FSDP1 + torch.compile requires it)")


STRATEGIES["fsdp"] = Strategy(
    wrap=wrap_fsdp1, resolve=resolve_fsdp1, no_sync=lambda model: model.no_sync(),
    # its own clip_grad_norm_ and scaler: torch.nn.utils' and amp's would see this rank's shard
    clip=lambda model, limit: model.clip_grad_norm_(limit), scaler=ShardedGradScaler,
    # Its sharded state dict copies shards on the GPU: to the host as made, or a save could OOM.
    shards=True, copies_shards=True)


# =============================================================================================
# --strategy fsdp2: FSDP2, fully_shard on each unit and then the root, in torchtitan's order.
# MixedPrecisionPolicy casts; set_requires_gradient_sync(False) is its no_sync.


def wrap_fsdp2(model, policy, blocks, cfg, topo, init_fn):
    """Activation checkpointing, compile, shard, then materialise a model built on the meta device:
    each rank allocates only its shards, and they hold what one process would have initialised."""
    units = units_of(model, policy)
    checkpoint_blocks(blocks, cfg.fsdp)
    compiled = compile_blocks(model, blocks, cfg)  # block -> the compiled module in its place
    last = compiled.get(blocks[-1], blocks[-1]) if blocks else None
    shard_fsdp2(model, [compiled.get(u, u) for u in units], last, cfg, topo)
    materialise_fsdp2(model, units, init_fn, cfg, topo)
    n = parameter_count(model)
    if cfg.train.compile and not compiles_blocks(cfg, n):
        model = torch.compile(model, mode=compile_mode(cfg, n))
    return model


def compile_blocks(model, blocks, cfg):
    """--compile of each block, as a module that takes the block's place (torchtitan's): the block's
    checkpoint runs inside the graph, and fully_shard hooks the compiled module."""
    n, compiled = parameter_count(model), {}
    if not (cfg.train.compile and compiles_blocks(cfg, n)):
        return compiled
    names = {b: name for name, b in model.named_modules()}
    for b in blocks:
        parent, _, child = names[b].rpartition(".")
        compiled[b] = torch.compile(b, mode=compile_mode(cfg, n))
        model.get_submodule(parent).register_module(child, compiled[b])
    return compiled


def shard_fsdp2(model, units, last, cfg, topo):
    """fully_shard on each unit, children first, then on the root, whose unit holds the rest. The
    last block and the root run first in backward: they stay gathered after forward."""
    f = cfg.fsdp
    reshard = fsdp2_reshards(f)
    pinned = topo.device.type == "cuda"  # pinned host memory needs a GPU
    offload = CPUOffloadPolicy(pin_memory=pinned) if f.cpu_offload else OffloadPolicy()
    # Only the root casts its floating inputs to param_dtype, as FSDP1 does: by default FSDP2 casts
    # every unit's, the fp32 rotary tables the blocks receive included.
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[f.param_dtype], cast_forward_inputs=False,
                              reduce_dtype=DTYPES[f.reduce_dtype])
    for unit in units:
        fully_shard(unit, mesh=topo.mesh, reshard_after_forward=reshard and unit is not last,
                    mp_policy=mp, offload_policy=offload)
    fully_shard(model, mesh=topo.mesh, reshard_after_forward=False, offload_policy=offload,
                mp_policy=dataclasses.replace(mp, cast_forward_inputs=True))
    if f.forward_prefetch:
        forward_prefetch_in_run_order(model, units)


@torch.no_grad()
def materialise_fsdp2(model, units, init_fn, cfg, topo):
    """--meta-init: to_empty allocates this rank's shards; each module is then initialised in
    FSDP1's order on full-size tensors, this rank keeping its shard: the weights one process has."""
    if not any(p.is_meta for p in model.parameters()):
        return
    model.to_empty(device="cpu" if cfg.fsdp.cpu_offload else topo.device)
    names = {m: name or type(model).__name__ for name, m in model.named_modules()}
    done = set()  # a shared parameter (tied embedding and head) is initialised by its first holder
    for m in init_order(model, units):
        own = {n: p for n, p in m._parameters.items() if isinstance(p, DTensor) and p not in done}
        done.update(own.values())
        full = {n: torch.empty(p.shape, dtype=p.dtype, device=p.to_local().device)
                for n, p in own.items()}
        plain = {n: t for n, t in itertools.chain(m._parameters.items(), m._buffers.items())
                 if t is not None and not isinstance(t, DTensor)}
        try:
            for n, t in full.items():
                m._parameters[n] = torch.nn.Parameter(t, requires_grad=own[n].requires_grad)
            init_tensors(m, names[m], {**plain, **full}, init_fn)
        finally:
            m._parameters.update(own)
        for n, p in own.items():
            shard = distribute_tensor(full[n], p.device_mesh, p.placements, src_data_rank=None)
            p.to_local().copy_(shard.to_local())


def fsdp2_reshards(f):
    """reshard_after_forward: FULL_SHARD and HYBRID_SHARD (ZeRO-2 keeps the gathered ones)."""
    return f.sharding_strategy in ("FULL_SHARD", "HYBRID_SHARD")


def forward_prefetch_in_run_order(root, units):
    """--forward-prefetch: each unit issues the next one's all-gather in forward, in the first
    forward's order (hooks record it, then go): the Free Transformer's sampler runs mid-stack."""
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


@contextlib.contextmanager
def fsdp2_no_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def clip_norm(model, limit):
    """torch's clip. Under FSDP2 the norm is a DTensor: its full value is the global norm."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), limit)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def resolve_fsdp2(cfg, topo):
    t, f = cfg.train, cfg.fsdp
    if topo.world == 1 and fsdp2_reshards(f) and not f.cpu_offload:
        say(topo, f"--strategy fsdp2 with 1 process: {f.sharding_strategy} would reshard only to "
            "gather again in backward; using SHARD_GRAD_OP")
        f.sharding_strategy = "SHARD_GRAD_OP"
    if t.grad_accum_mode == "auto":
        # sync, as torchtitan does: no_sync holds every gradient unsharded, in reduce_dtype (fp32:
        # 4 bytes a parameter on every rank); sync costs a reduce-scatter a micro-batch.
        t.grad_accum_mode = "sync"


STRATEGIES["fsdp2"] = Strategy(
    wrap=wrap_fsdp2, resolve=resolve_fsdp2, no_sync=fsdp2_no_sync,
    # torch's clip and amp's scaler see every shard: the gradients are DTensors
    clip=clip_norm, scaler=torch.amp.GradScaler, shards=True, compiles_units=True,
    # --cpu-offload: clipping all-reduces the norm of host gradients (gloo too, as torchtitan's)
    host_grads=True)


# =============================================================================================
# --strategy ddp and none: every process holds the whole model (DDP all-reduces the gradients;
# none is one process). torch.autocast casts; the weights stay in --weights-dtype.


def wrap_whole(model, policy, blocks, cfg, topo, init_fn, ddp=False):
    """The whole model on every process: compile, checkpoint, materialise in FSDP1's order, DDP."""
    n = parameter_count(model)
    compile_in_place(model, blocks, cfg, whole=False)
    checkpoint_blocks(blocks, cfg.fsdp)
    if cfg.fsdp.meta_init:
        materialise = meta_init_fn(model, init_fn, topo)
        for m in init_order(model, units_of(model, policy)):
            materialise(m)
    model = model.to(topo.device)
    if ddp:
        model = DDP(model, device_ids=[topo.device.index] if topo.device.type == "cuda" else None,
                    gradient_as_bucket_view=True)
    if cfg.train.compile and not compiles_blocks(cfg, n):
        model = torch.compile(model, mode=compile_mode(cfg, n))
    return model


def accumulate_with_no_sync(cfg, topo):
    """auto: no_sync, free here: DDP's gradient is the whole model's anyway, fp32 as the weights."""
    if cfg.train.grad_accum_mode == "auto":
        cfg.train.grad_accum_mode = "no_sync"


STRATEGIES["ddp"] = Strategy(
    wrap=functools.partial(wrap_whole, ddp=True), resolve=accumulate_with_no_sync,
    no_sync=lambda model: model.no_sync(), clip=clip_norm, scaler=torch.amp.GradScaler)

STRATEGIES["none"] = dataclasses.replace(  # DDP's, without DDP: one process, nothing to reduce
    STRATEGIES["ddp"], wrap=wrap_whole, no_sync=lambda model: contextlib.nullcontext())


# =============================================================================================
# What the strategies share: wrap_model (it hands the model over), units, compile, precision, mesh.


def wrap_model(model, wrap_classes, ckpt_classes, cfg, topo, init_fn=None):
    """The model wrapped by its strategy, with activation checkpointing and compile in its order.
    --meta-init: init_fn (its init_module) initialises in init_order, whatever the strategy."""
    f, blocks = cfg.fsdp, [m for m in model.modules() if isinstance(m, tuple(ckpt_classes))]
    for p in model.parameters():  # and so their gradients and AdamW's state; a frozen base as used
        base = cfg.checkpoint.init_from and not p.requires_grad  # see frozen_base
        p.data = p.data.to(DTYPES[f.param_dtype if base else f.weights_dtype])
    # float8 swaps in new Linear layers: before the units are chosen, which must be the new ones
    float8 = import_optional("float8", "--float8") if f.float8 else None  # float8.py
    if float8 and not float8.to_float8(blocks, f.float8):
        raise BadInput("--float8 needs Linear layers in the blocks with sides multiples of 16")
    policy = wrap_policy(model, wrap_classes, cfg)
    return strategy_of(cfg).wrap(model, policy, blocks, cfg, topo, init_fn)


def units_of(model, policy):
    """The modules FSDP1's auto-wrap makes units under `policy`, children first as it wraps them:
    FSDP2's units, and the order --meta-init materialises them in under every strategy."""
    units, taken = [], set()

    def visit(m):
        free = sum(p.numel() for p in m.parameters() if p not in taken)
        if policy(module=m, recurse=True, nonwrapped_numel=free):
            for child in m.children():
                visit(child)
        free = sum(p.numel() for p in m.parameters() if p not in taken)
        if m is not model and policy(module=m, recurse=False, nonwrapped_numel=free):
            units.append(m)
            taken.update(m.parameters())
    if policy:
        visit(model)
    return units


def parameter_count(model):
    return sum(p.numel() for p in model.parameters())


def local_parameter_count(model):
    """Parameters held by this rank (a DTensor's numel is its global size)."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())


def one_unit(f, n_params):
    """--auto-wrap auto on a small model: one unit (per-block units save memory, cost host time)."""
    return f.auto_wrap == "auto" and n_params < ONE_UNIT_BELOW


def checkpoint_blocks(blocks, f):
    """--activation-checkpointing, every --ac-every-th block, in place (the module names stay).
    Non-reentrant: the reentrant checkpoint fires FSDP's post-backward hooks twice."""
    if f.activation_checkpointing:
        for b in blocks[::f.ac_every]:
            b.forward = functools.partial(checkpoint, b.forward, use_reentrant=False)


def compile_in_place(model, blocks, cfg, whole):
    """--compile leaving the module tree as it is (the wrap rules find the block classes, the
    state-dict names stay). Before checkpoint_blocks: a recompute then runs the compiled forward."""
    n = parameter_count(model)
    if cfg.train.compile and compiles_blocks(cfg, n):
        for b in blocks:
            b.forward = torch.compile(b.forward, mode=compile_mode(cfg, n))
    elif cfg.train.compile and whole:
        model.forward = torch.compile(model.forward, mode=compile_mode(cfg, n))


def compiles_blocks(cfg, n_params):
    """--compile compiles each block under --compile-scope blocks, and whenever the blocks are
    units under a strategy that compiles units (a whole-model graph would break at their hooks)."""
    units = strategy_of(cfg).compiles_units and not one_unit(cfg.fsdp, n_params)
    return cfg.train.compile_scope == "blocks" or units


def compile_mode(cfg, n_params):
    """--compile-mode auto: CUDA graphs (reduce-overhead) for a small model, whose step is kernel
    launches more than kernels; default for a large one, where graphs gain nothing, hold memory."""
    if cfg.train.compile_mode != "auto":
        return cfg.train.compile_mode
    small = n_params < ONE_UNIT_BELOW
    return "reduce-overhead" if small and not recomputes_compiled_blocks(cfg) else "default"


def recomputes_compiled_blocks(cfg):
    """Checkpointed blocks compiled in place (compile_in_place under --compile-scope blocks) rerun
    their compiled forward in backward: CUDA graphs cannot record that."""
    blocks = cfg.train.compile and cfg.train.compile_scope == "blocks"
    return cfg.fsdp.activation_checkpointing and blocks and not strategy_of(cfg).compiles_units


def precision_context(cfg, device):
    """FSDP casts by its mixed-precision policy: the model computes in param_dtype. DDP and one
    device autocast instead (weights, residual stream fp32); --autocast adds autocast to FSDP."""
    return torch.autocast(device.type, DTYPES[cfg.fsdp.param_dtype], enabled=autocasts(cfg))


def autocasts(cfg):
    return cfg.fsdp.param_dtype != "fp32" and (not strategy_of(cfg).shards or cfg.fsdp.autocast)


@contextlib.contextmanager
def fsdp1_notices_silenced():
    """FSDP1 on one process shards nothing (NO_SHARD) and says so at the wrap and every state dict:
    hidden while main() runs, not in the rest of a program that imports the trainer."""
    with warnings.catch_warnings():
        for notice in ("FSDP is switching to use `NO_SHARD`", "When using ``NO_SHARD``"):
            warnings.filterwarnings("ignore", message=".*" + re.escape(notice))
        yield


def say(topo, line):
    if topo.rank == 0:
        print(line)


def device_mesh(cfg, topo):
    """FSDP's mesh (2-D for HYBRID_SHARD*): with it FSDP1's state dicts hold DTensors like FSDP2."""
    if not strategy_of(cfg).shards:
        return None
    if "HYBRID" in cfg.fsdp.sharding_strategy:
        shard = hybrid_shard_size(cfg, topo)
        return init_device_mesh(topo.device.type, (topo.world // shard, shard),
                                mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(topo.device.type, (topo.world,), mesh_dim_names=("shard",))


def hybrid_shard_size(cfg, topo):
    return cfg.fsdp.hybrid_shard_size or topo.local_world


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
    t = cfg.train
    micro = t.micro_batch or t.global_batch // topo.world
    return Plan(micro=micro, accum=t.global_batch // (micro * topo.world), seq_len=data.seq_len,
                tokens_per_step=t.global_batch * data.seq_len, max_steps=t.max_steps,
                peak_lr=peak_lr(t))


def peak_lr(t):
    return t.lr * (t.global_batch / t.lr_scale_base_batch if t.lr_scale_base_batch else 1.0)


def decayed_names(model):
    """Names weight decay applies to, taken before wrapping (FSDP1 shows shards as 1-D views)."""
    decays = getattr(model, "decay_filter", lambda name, p: p.dim() >= 2)
    return {n for n, p in model.named_parameters() if decays(n, p)}


def plain_named_parameters(model):
    """(name in the plain model, parameter) of a wrapped model: torch.compile's `_orig_mod.` and
    FSDP1's `_fsdp_wrapped_module.` dropped, and `module.` only where DDP put it there."""
    inner = getattr(model, "_orig_mod", model)
    inner = inner.module if isinstance(inner, DDP) else inner
    return [(re.sub(r"(_orig_mod|_fsdp_wrapped_module)\.", "", n), p)
            for n, p in inner.named_parameters()]


def build_optimizer(model, cfg, lr, device, about):
    """AdamW, decaying about["decay_names"]; Muon on the hidden matrices (about["hidden"]) under
    --optimizer muon. FSDP1's --no-use-orig-params makes a unit one FlatParameter: all decay."""
    t, decays, hidden = cfg.train, about["decay_names"], about["hidden"]
    named = [(n, p) for n, p in plain_named_parameters(model) if p.requires_grad]
    if any(n.endswith("_flat_param") for n, _ in named):
        groups = [{"params": [p for _, p in named], "weight_decay": t.weight_decay}]
    else:
        adam = [(n, p) for n, p in named if n not in hidden]
        groups = [{"params": [p for n, p in adam if n in decays], "weight_decay": t.weight_decay},
                  {"params": [p for n, p in adam if n not in decays], "weight_decay": 0.0}]
    # Fused AdamW needs the parameters on the GPU and rejects ShardedGradScaler's found_inf (fp16).
    fused = device.type == "cuda" and not cfg.fsdp.cpu_offload and cfg.fsdp.param_dtype != "fp16"
    kind = importlib.import_module("muon").Muon if hidden else torch.optim.AdamW  # muon.py
    optimizer = kind(groups, lr=lr, betas=(t.beta1, t.beta2), fused=fused)
    if hidden:  # --muon-lr 0: twice --lr, the better rate at 10M and 1b (BENCHMARKS.md, Muon)
        optimizer.add_param_group({"params": [p for n, p in named if n in hidden],
                                   "weight_decay": t.weight_decay, "muon": cfg.fsdp.param_dtype,
                                   "lr_ratio": t.muon_lr / t.lr if t.muon_lr else 2.0})
    return optimizer


def schedule_length(t, saved):
    """--lr-decay-steps when 0: the first launch's (`saved`: its train settings), so that a resume
    keeps the schedule; a new run takes it from --max-steps."""
    for steps in (t.lr_decay_steps, saved.get("lr_decay_steps"), saved.get("max_steps")):
        if steps:
            return steps
    return t.max_steps if t.lr_schedule == "cosine" else max(1, t.max_steps // 5)


def lr_at(step, peak, cfg, max_steps):
    """Step `step`'s rate (from 0): linear warmup, then cosine to min_lr_ratio * peak at step
    --lr-decay-steps, flat after; or wsd: the peak, then linear over the last --lr-decay-steps."""
    t, floor = cfg.train, cfg.train.min_lr_ratio
    if step < t.warmup_steps:
        return peak * (step + 1) / t.warmup_steps
    if t.lr_schedule == "wsd":
        decay = t.lr_decay_steps or max(1, max_steps // 5)
        return peak * (1 - (1 - floor) * min(1.0, max(0.0, (step + 1 - max_steps + decay) / decay)))
    decay_end = t.lr_decay_steps or max_steps
    progress = (step - t.warmup_steps) / max(1, decay_end - 1 - t.warmup_steps)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


# =============================================================================================
# Training step and evaluation


def micro_batches(data, step, cfg, plan, topo):
    """This rank's micro-batches of `step` on its device, and the seconds spent fetching them."""
    t0 = time.perf_counter()
    batches = []
    for m in range(plan.accum):
        start = (m * topo.world + topo.rank) * plan.micro
        rows = data.train_batch(step, cfg.train.global_batch, start, plan.micro)
        batches.append([t.to(topo.device, non_blocking=True) for t in rows])
    return batches, time.perf_counter() - t0


def train_step(model, optimizer, scaler, batches, cfg, loss_fn, strategy):
    """One optimizer step: the mean over all its targets (a micro-batch's mean counts by its share
    of the targets of every rank). Returns (mean losses, global norm, skipped?)."""
    totals, targets = {}, torch.stack([(y != IGNORE).sum() for _, y, *_ in batches]).float()
    of_step = targets.sum()
    dist.all_reduce(of_step)
    for m, (x, y, *positions) in enumerate(batches):
        share = of_step / (targets[m] * dist.get_world_size())  # without IGNORE, the accumulation
        new_graph_step(cfg)
        # Gradients are reduced after the last micro-batch, or after each under --grad-accum-mode
        # sync; no_sync must cover the forward too.
        reduce = m == len(batches) - 1 or cfg.train.grad_accum_mode == "sync"
        with contextlib.nullcontext() if reduce else strategy.no_sync(model):
            with precision_context(cfg, x.device):
                loss, parts = loss_fn(model, x, y, cfg, *positions)
            scaled = loss / share
            (scaler.scale(scaled) if scaler else scaled).backward()
        for k, v in {"loss": loss.detach(), **parts}.items():
            totals[k] = totals.get(k, 0.0) + v.float() / share
    if scaler:
        scaler.unscale_(optimizer)
    grad_norm = strategy.clip(model, cfg.train.grad_clip or math.inf)  # --grad-clip 0: no limit
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
    """Under CUDA graphs a new forward may reuse the last replay's outputs' memory, read by now."""
    if cfg.train.compile:
        torch.compiler.cudagraph_mark_step_begin()


@torch.no_grad()
def evaluate(model, data, cfg, topo, micro, loss_fn):
    """Mean loss over the fixed validation rows' targets, world-size independent. Every rank runs
    as many forwards (FSDP's are collectives): one with no rows left runs a dummy row weighted 0."""
    n = min(cfg.train.eval_samples, data.n_val)
    model.eval()
    sums = {"targets": 0}
    # Eager, even under --compile: eval() and no_grad fail the training graph's guards, and a second
    # compile at the first evaluation would cost more than all the run's evaluation forwards.
    with torch.compiler.set_stance("force_eager" if cfg.train.compile else "default"):
        for chunk in range(0, n, micro * topo.world):
            start = chunk + topo.rank * micro
            count = max(0, min(micro, n - start))
            x, y, *positions = [t.to(topo.device) for t in data.val_batch(start if count else 0,
                                                                           count or 1)]
            new_graph_step(cfg)
            with precision_context(cfg, topo.device):
                loss, parts = loss_fn(model, x, y, cfg, *positions)
            targets = (y != IGNORE).sum().float() if count else 0
            for k, v in {"loss": loss, **parts}.items():
                sums[k] = sums.get(k, 0.0) + v.float() * targets
            sums["targets"] += targets
    model.train()
    sums = all_reduce_scalars(sums, topo.device)
    return {k: v / sums["targets"] for k, v in sums.items() if k != "targets"}


def all_reduce_scalars(values, device, op=dist.ReduceOp.SUM):
    """{name: scalar tensor or number} reduced over all ranks in one collective, as floats."""
    keys = sorted(values)
    vec = torch.stack([torch.as_tensor(values[k], device=device) for k in keys])
    dist.all_reduce(vec, op=op)
    return dict(zip(keys, vec.tolist()))


class NonFinite:
    """The first step whose loss (or gradient norm, unless fp16's scaler owns it) is not finite:
    kept on the device (no sync a step), checked by a collective at log steps and before saves."""

    NEVER = 2 ** 62

    def __init__(self, device, log, cfg, scaler):
        self.first = torch.tensor(self.NEVER, device=device)
        self.log, self.skips, self.scaled = log, cfg.train.skip_nonfinite, scaler is not None

    def note(self, step, loss, grad_norm, skipped):
        if skipped:
            self.log.line(f"step {step}: gradient norm {float(grad_norm)}, optimizer step skipped")
        if skipped or self.skips:
            return
        finite = torch.isfinite(loss)
        if not self.scaled:
            finite &= torch.isfinite(grad_norm.to(loss.device))
        self.first = torch.where(~finite & (self.first == self.NEVER), step, self.first)

    def check(self):
        dist.all_reduce(self.first, op=dist.ReduceOp.MIN)  # in place: not NEVER raises below
        if self.first.item() != self.NEVER:
            raise RunFailed(f"the loss or its gradient became NaN/inf at step {self.first.item()}; "
                            "stopped without saving that state (the latest checkpoint is still the "
                            "last good one); lower --lr or pass --skip-nonfinite")


# =============================================================================================
# main: one run, in the order of the file


@fsdp1_notices_silenced()
def main(argv=None, build_model=None, compute_loss=None, load_dataset=None, model_config=None,
         data_config=None):
    """One run. The seams not given are this project's; model_config, data_config: your settings."""
    argv, clock = sys.argv[1:] if argv is None else argv, StartClock()
    if argv[:1] == ["--export"] and len(argv) == 2:  # --export RUN/checkpoints/step_N alone
        return import_optional("ckpt_export", "--export").export(argv[1], sys.modules[__name__])
    cfg, build_model, compute_loss, load_dataset = parse_with_seams(
        argv, build_model, compute_loss, load_dataset, model_config, data_config)
    topo = setup_distributed(cfg)
    check_world(cfg, topo)
    data = load_dataset(cfg, topo.rank)
    clock.lap("setup and data")
    strategy = resolve_config(cfg, topo, data)
    topo = dataclasses.replace(topo, mesh=device_mesh(cfg, topo))  # the resolved strategy's mesh
    plan = plan_run(cfg, topo, data)
    t = cfg.train

    torch.manual_seed(t.seed)  # the same seed on every rank: unwrapped replicas start identical
    with torch.device("meta") if cfg.fsdp.meta_init else contextlib.nullcontext():
        model, wrap_classes, ckpt_classes = build_model(cfg)
    name_run_dir(cfg, model)
    keep_compile_cache(cfg)
    check_init_from_shapes(cfg, model, topo)  # a bad path or shape fails before anything is written
    about = describe_model(model, cfg, plan, wrap_classes)  # the plain model's names and counts
    model = wrap_model(model, wrap_classes, ckpt_classes, cfg, topo, meta_init_module(model, cfg))
    clock.lap("model and wrapping")
    digests = run_digests(cfg, model, data, topo)  # what a resume must find unchanged
    resume, notes, lock = prepare_run_dir(cfg, topo.rank, digests)
    torch.manual_seed(t.seed + topo.rank)  # dropout and sampling differ per rank
    optimizer = build_optimizer(model, cfg, plan.peak_lr, topo.device, about)
    scaler = strategy.scaler(topo.device.type) if cfg.fsdp.param_dtype == "fp16" else None
    start_step, tokens_seen = restore_state(resume, model, optimizer, scaler, cfg, topo, notes)
    rank0_does(lambda: start_in(t.out_dir, start_step, cfg), topo.rank)  # a refusal changed nothing
    clock.lap("run directory and checkpoint")
    log = start_log(cfg, topo, plan, model, about, data.n_val, notes, start_step)

    checkpointer = Checkpointer(cfg, topo, log, data.tokenizer_path, digests, scaler)
    stopper, nonfinite = Stopper(topo, log), NonFinite(topo.device, log, cfg, scaler)
    meter, bar = Meter(topo, plan, about["flops"]), progress_bar(plan, start_step, topo)
    profiler = start_profiler(cfg, topo)  # None unless --profile
    val = {}  # the final validation: the last step's, or at once for a run already finished
    if start_step >= plan.max_steps:
        log.line(f"{t.out_dir} already finished at step {start_step} (max_steps {plan.max_steps}): "
                 "nothing to train; pass a larger --max-steps to continue it")
        val = evaluate(model, data, cfg, topo, plan.micro, compute_loss)
    model.train()
    try:
        for step in range(start_step, plan.max_steps):
            lr = lr_at(step, plan.peak_lr, cfg, plan.max_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batches, data_time = micro_batches(data, step, cfg, plan, topo)
            losses, grad_norm, skipped = train_step(model, optimizer, scaler, batches, cfg,
                                                    compute_loss, strategy)
            nonfinite.note(step + 1, losses["loss"], grad_norm, skipped)
            if step == start_step:  # --compile compiles the training step in its first call
                log.line(clock.lap("first step", sync=losses["loss"]) + compile_cache_note(cfg))
            tokens_seen += plan.tokens_per_step
            meter.add_step(data_time)
            bar.update(1)
            if profiler:
                profiler.step()
            stop = stopper.poll()  # a collective: every rank stops at the same step
            last = step + 1 == plan.max_steps
            if (step + 1) % t.log_every == 0 or last:
                nonfinite.check()
                log.step(meter.record(step + 1, losses, lr, grad_norm, tokens_seen), sorted(losses))
            checkpointer.publish_finished()  # a background save that every rank has written
            save = should_save(step + 1, cfg, last, stop)
            evaluated = should_evaluate(step + 1, cfg, last, save, stop)
            if evaluated:
                with meter.paused() as seconds:
                    val = evaluate(model, data, cfg, topo, plan.micro, compute_loss)
                log.validation(step + 1, val, tokens_seen, seconds)
            if save:
                nonfinite.check()  # never save a state that has seen a non-finite loss
                with meter.paused():
                    checkpointer.save(step + 1, tokens_seen, model, optimizer,
                                      val["loss"] if evaluated else None, last, stop)
            if stop != 0 and not last:
                stopper.leave(stop, step + 1, t.out_dir)  # raises Preempted once every rank saved
        checkpointer.publish_finished(wait=True)  # a --no-save-final run's last background save
    finally:
        checkpointer.close()
        bar.close()
        if log.trackers:
            log.trackers.close()
        if profiler:
            profiler.stop()
        stopper.close()
    log.line("final validation: " + " ".join(f"{k} {v:.4f}" for k, v in val.items()))
    log.close()
    stopper.poll()  # the last collective, a barrier: every rank fails when rank 0 could not log
    if lock:
        lock.close()  # the next run may take the directory (the kernel would drop it at exit)
    if topo.owner:
        dist.destroy_process_group()
    return val


def should_save(step, cfg, last, stop):
    c = cfg.checkpoint
    return stop != 0 or (c.save_every > 0 and step % c.save_every == 0) or (last and c.save_final)


def should_evaluate(step, cfg, last, save, stop):
    """Every --eval-every steps and at the end; with --keep-best also before each save, whose
    checkpoint it ranks by this loss (not a stop's save: time is short then)."""
    periodic = cfg.train.eval_every > 0 and step % cfg.train.eval_every == 0
    return last or periodic or (cfg.checkpoint.keep_best and save and stop == 0)


def run(argv=None, **seams):
    """The entry of `python train_fsdp.py` and of your script: main(argv, **seams), then exit 0
    finished, 1 failed, 2 bad input (one line on stderr), 3 saved on SIGTERM/SIGUSR1: requeue me."""
    code, message = 0, None
    try:
        main(argv, **seams)
    except (BadInput, RunFailed) as e:
        code, message = EXIT_BAD_INPUT if isinstance(e, BadInput) else EXIT_FAILED, f"error: {e}"
    except Preempted as e:
        code, message = EXIT_PREEMPTED, str(e)
    # Before the process group exists the ranks have not agreed on the error: each says its own
    # (under torchrun the first rank to exit has the others killed, rank 0 perhaps before it spoke).
    if message and (not dist.is_initialized() or dist.get_rank() == 0):
        sys.stderr.write(message + "\n")  # one write: under torchrun the ranks' lines share a pipe
    if dist.is_initialized():
        dist.destroy_process_group()
    leave(code)


def leave(code):
    """All is closed: exit without interpreter teardown. A gloo worker thread may still be freeing a
    finished collective's tensors; if it needs the GIL as Python finalises, a good run aborts."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# =============================================================================================
# Reference: rank 0's file work, and the errors every rank learns


def rank0_does(fn, rank, failure=None, what="its file work"):
    """Run fn (file work) on rank 0 alone, in a thread: no collective times out meanwhile. Every
    rank returns its result or raises failure(its error): BadInput, RunFailed for a RuntimeError."""
    box = [None, None]  # (error, a fault of the machine?), result

    def run_into_box():
        try:
            box[1] = fn()
        except Exception as e:  # anything (a full disk, not a checkpoint) must stop every rank
            box[0] = (error_line(e), isinstance(e, RuntimeError))
    if rank == 0:
        work = threading.Thread(target=run_into_box, daemon=True)
        work.start()
    for beat in itertools.count():
        if rank == 0:
            work.join(COLLECTIVE_TIMEOUT.total_seconds() / 10)
        message = [work.is_alive() if rank == 0 else None, *box]  # still working, error, result
        dist.broadcast_object_list(message, src=0)
        if not message[0]:
            break
        node_first = rank - launch_env()[2]
        if beat == 0 and rank == max(node_first, 1):  # the first waiting rank of a node says it
            print(f"rank {rank}: waiting for rank 0 ({what}), with no time limit", flush=True)
    if message[1]:
        text, fault = message[1]
        raise (failure or (RunFailed if fault else BadInput))(text)
    return message[2]


def any_rank_error(error, topo):
    """The first error (a string, or None) of any rank, on every rank."""
    errors = [None] * topo.world
    dist.all_gather_object(errors, error, group=topo.control)
    return next((e for e in errors if e), None)


def error_line(e):
    """One line for an exception: ours and a seam's ValueError as is, an OSError by its file."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}: {e.filename}"
    if isinstance(e, (BadInput, RunFailed, ValueError, RuntimeError)):
        return str(e)
    return f"{type(e).__name__}: {e}"


# =============================================================================================
# Reference: --meta-init. The model is built on the meta device; each module's tensors are allocated
# and initialised once wrapped, by reset_parameters() and the model's init_module, in init_order.


def init_order(model, units):
    """The modules in the order FSDP1 materialises a meta model: by unit, breadth-first in each."""
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


def meta_init_fn(model, init_fn, topo):
    """FSDP1, DDP and one device: a function allocating one module's meta tensors on its device and
    initialising them; a parameter modules share (a tied embedding) is allocated once, kept tied."""
    names = {m: name or type(model).__name__ for name, m in model.named_modules()}
    holders = collections.Counter(p for m in model.modules() for p in m.parameters(recurse=False))
    shared = {}  # meta parameter -> its allocation, until every holder has it

    def materialise(module):
        fresh = {}
        for n, p in module._parameters.items():
            if p is not None and p.is_meta:
                if p not in shared:
                    empty = torch.empty_like(p, device=topo.device)
                    shared[p] = fresh[n] = torch.nn.Parameter(empty, p.requires_grad)
                module._parameters[n] = shared[p]
                holders[p] -= 1
                if not holders[p]:
                    del shared[p]
        for n, b in module._buffers.items():
            if b is not None and b.is_meta:
                module._buffers[n] = fresh[n] = torch.empty_like(b, device=topo.device)
        init_tensors(module, names[module], fresh, init_fn)
    return materialise


@torch.no_grad()
def init_tensors(module, name, fresh, init_fn):
    """Initialise the newly allocated tensors `fresh` of `module` as building it would: its
    reset_parameters, then init_fn(module). They are NaN until then: one still NaN is refused."""
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
            raise BadInput(f"--meta-init: nothing initialises {name}.{n} "
                           f"({type(module).__name__}): give the model an init_module(module) that "
                           "covers it, or the module a reset_parameters()")


def meta_init_module(model, cfg):
    if cfg.fsdp.meta_init and not hasattr(model, "init_module"):
        raise BadInput(f"--meta-init: {type(model).__name__} has no init_module(module): whatever "
                       "its __init__ does to the weights would run on the meta device and be lost; "
                       "give it one (or init_module = None when its modules' reset_parameters() "
                       "are its whole initialisation), or drop --meta-init")
    return getattr(model, "init_module", None)


# =============================================================================================
# Reference: checkpoint files
#
# run_dir/checkpoints/step_0000100/   one complete checkpoint, made visible by an atomic rename
#   meta.json       step, tokens seen, type, world size, config, tokenizer, scaler, data, file sizes
#   dcp/            sharded: torch.distributed.checkpoint files (model + optimizer), any world size
#   model.pt        full: consolidated model (+ optimizer); also written at the end of a sharded run
#   rng_rank{r}.pt  every RNG state of rank r (torch CPU and CUDA, numpy, Python)
# run_dir/checkpoints/latest, best    the names of the newest and of the best complete checkpoint
#
# Ranks write checkpoints/.tmp-step_N, renamed by rank 0 once all have: a kill leaves latest as is.


class Checkpointer:
    """The saves of a run, on every rank (state dicts and DCP are collectives). --async-save writes
    the --save-every checkpoints in the background, one at a time; a stop's and the last are not."""

    def __init__(self, cfg, topo, log, tokenizer_path, digests, scaler):
        self.cfg, self.c, self.topo, self.log = cfg, cfg.checkpoint, topo, log
        self.tokenizer_path, self.digests, self.scaler = tokenizer_path, digests, scaler
        self.pending = None  # the background save under way: (path, meta, DCP's future, staged at)
        copies = strategy_of(cfg).copies_shards and cfg.fsdp.sharding_strategy != "NO_SHARD"
        gpus = topo.world > 1 and topo.device.type == "cuda"
        self.sharded = StateDictOptions(cpu_offload=copies and gpus, ignore_frozen_params=True)
        # Full: gathered by every rank; on GPUs torch keeps it, on the host, on rank 0 alone.
        self.full = StateDictOptions(full_state_dict=True, cpu_offload=topo.device.type != "cpu")
        if self.c.async_save and self.c.save_every:
            # Its collectives run in another thread: a group of their own. On a GPU the writer keeps
            # a pinned host copy of the state between saves: later ones stage faster.
            self.group = dist.new_group(backend="gloo")
            on_gpu = topo.device.type == "cuda"
            self.writer = dcp.FileSystemWriter(".", cache_staged_state_dict=on_gpu)

    def save(self, step, tokens_seen, model, optimizer, val_loss, last, stop):
        """Save step `step` (val_loss: its validation loss or None); the last adds model.pt."""
        self.publish_finished(wait=True)  # one at a time, in order
        meta = checkpoint_meta(self.cfg, step, tokens_seen, self.tokenizer_path, self.scaler,
                               self.topo.world, val_loss=val_loss, digests=self.digests)
        path = os.path.join(self.cfg.train.out_dir, "checkpoints", f"step_{step:07d}")
        tmp, t0, error = staging_path(path), time.perf_counter(), None
        background = self.c.async_save and not (last or stop)
        # Before any rank writes; start_in removed every .tmp- directory a killed save left.
        rank0_does(lambda: os.makedirs(tmp), self.topo.rank, save_failed(meta))
        try:
            if background:
                future = self.start_async_save(path, meta, model, optimizer)
                self.pending = (path, meta, future, time.perf_counter())
            else:
                whole = last and not frozen_base(self.cfg, model)  # else --export merges it in
                self.write(tmp, meta, model, optimizer, consolidate=whole)
            write_rng_state(tmp, self.topo.rank)
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            error = error_text(e, self.topo.rank, tmp)
        self.stop_if_failed(error, path, meta)
        if background:
            self.log.line(f"staged {path} in {time.perf_counter() - t0:.1f} s; writing it in the "
                          "background")
        else:
            self.publish(path, meta)
            self.log.line(f"saved {path} in {time.perf_counter() - t0:.1f} s")

    def start_async_save(self, path, meta, model, optimizer):
        """Stage this rank's shards to host memory and hand them to DCP's background writer, which
        returns once the copy is made: training may change the weights at once."""
        state = sharded_state(model, optimizer, self.sharded)
        future = dcp.async_save(state, checkpoint_id=os.path.join(staging_path(path), "dcp"),
                                storage_writer=self.writer, process_group=self.group)
        return getattr(future, "upload_completion", future)  # with async staging: the write's

    def write(self, tmp, meta, model, optimizer, consolidate=False):
        """This rank's part of a synchronous save in `tmp`; consolidate: model.pt beside shards."""
        if meta["type"] == "sharded":
            state = sharded_state(model, optimizer, self.sharded)
            dcp.save(state, checkpoint_id=os.path.join(tmp, "dcp"))
        if meta["type"] == "full" or consolidate:
            full = consolidated_payload(get_model_state_dict(model, options=self.full), meta)
            if meta["type"] == "full" and self.c.full_optimizer:
                full["optim"] = get_optimizer_state_dict(model, optimizer, options=self.full)
            if self.topo.rank == 0:
                torch.save(full, os.path.join(tmp, "model.pt"))
                fsync_path(os.path.join(tmp, "model.pt"))

    def publish_finished(self, wait=False):
        """At a step boundary, on every rank (a small all-reduce): publish the background save once
        every rank has written it; wait: first wait for this rank's write."""
        if self.pending is None:
            return
        (path, meta, future, staged), t0 = self.pending, time.perf_counter()
        if wait:
            future.exception()  # blocks until the write has ended, whatever its outcome
        e = future.exception() if future.done() else None
        error = error_text(e, self.topo.rank, staging_path(path)) if e is not None else None
        flags = torch.tensor([int(not future.done()), int(error is not None)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.topo.control)
        if flags[1].item():
            self.stop_if_failed(error, path, meta)
        if flags[0].item():
            return
        self.publish(path, meta)
        self.pending = None
        waited = f"; waited {time.perf_counter() - t0:.1f} s for its end" if wait else ""
        self.log.line(f"saved {path} in the background, {time.perf_counter() - staged:.1f} s after "
                      f"it was staged{waited}")

    def stop_if_failed(self, error, path, meta):
        """Any rank failed to write (`error`: this rank's): all raise, the staging dir deleted."""
        error = any_rank_error(error, self.topo)
        if error:
            if self.topo.rank == 0:
                shutil.rmtree(staging_path(path), ignore_errors=True)
            raise save_failed(meta)(error)

    def publish(self, path, meta):
        def publish():
            try:
                publish_checkpoint(path, meta, self.c.keep_checkpoints, self.c.keep_best)
            except OSError:
                shutil.rmtree(staging_path(path), ignore_errors=True)
                raise
        rank0_does(publish, self.topo.rank, save_failed(meta))

    def close(self):
        """After an error: let the write end before the process groups go; leave no staging dir."""
        if self.pending:
            self.pending[2].exception()
            if self.topo.rank == 0:
                shutil.rmtree(staging_path(self.pending[0]), ignore_errors=True)


def staging_path(path):
    """Where the checkpoint `path` is written before the rename that publishes it."""
    return os.path.join(os.path.dirname(path), ".tmp-" + os.path.basename(path))


def checkpoint_meta(cfg, step, tokens_seen, tokenizer, scaler, world, val_loss=None, digests=None):
    """meta.json but the file sizes; val_loss: this step's (--keep-best), digests: the data's."""
    return dict(step=step, tokens_seen=tokens_seen, type=cfg.checkpoint.checkpoint_type,
                world_size=world, config=dataclasses.asdict(cfg), tokenizer=tokenizer,
                scaler=scaler.state_dict() if scaler else None, val_loss=val_loss, data=digests)


def consolidated_payload(state, meta):
    """One file: torch.load(path, weights_only=True)["model"] loads into an unwrapped model."""
    return {"model": state, "config": meta["config"], "step": meta["step"],
            "tokens_seen": meta["tokens_seen"], "tokenizer": meta["tokenizer"]}


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
    """dcp/: the model and optimizer state dicts (under FSDP each rank its shards; collectives)."""
    return {"model": get_model_state_dict(model, options=options),
            "optim": get_optimizer_state_dict(model, optimizer, options=options)}


def write_rng_state(tmp, rank):
    """This rank's RNG states, as tensors and lists of numbers, which weights_only loading reads."""
    key, numpy_keys, *numpy_rest = np.random.get_state()
    version, python_keys, gauss_next = random.getstate()
    state = {"torch": torch.get_rng_state(), "numpy": [key, numpy_keys.tolist(), *numpy_rest],
             "python": [version, list(python_keys), gauss_next],
             "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}
    path = os.path.join(tmp, f"rng_rank{rank}.pt")
    torch.save(state, path)
    fsync_path(path)


def set_rng_state(state):
    torch.set_rng_state(state["torch"])
    key, numpy_keys, *numpy_rest = state["numpy"]
    np.random.set_state((key, np.asarray(numpy_keys, dtype=np.uint32), *numpy_rest))
    version, python_keys, gauss_next = state["python"]
    random.setstate((version, tuple(python_keys), gauss_next))
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def error_text(e, rank, path=None):
    """`rank R: Type: message`. DCP's CheckpointException only names failed ranks: the first's error
    is the cause. Out of space, torch.save says "unexpected pos": `path`'s full disk is named."""
    if isinstance(e, CheckpointException) and e.failures:
        rank, (e, _) = next(iter(e.failures.items()))
    text = f"rank {rank}: {type(e).__name__}: {e}".splitlines()[0]
    free = shutil.disk_usage(path).free if path and os.path.exists(path) else None
    if not isinstance(e, OSError) and free is not None and free < 2 ** 20:
        text += f" (its file system is full: {free:,} bytes free)"
    return text


def save_failed(meta):
    """The exception of a failed save, given its error line."""
    return lambda error: RunFailed(f"saving the checkpoint of step {meta['step']} failed "
                                   f"({error.splitlines()[0]}); the previous checkpoint is intact")


def publish_checkpoint(path, meta, keep, keep_best=False):
    """Rank 0, once all ranks wrote the staging directory; keeps the newest `keep`, and the best."""
    tmp, root, name = staging_path(path), os.path.dirname(path), os.path.basename(path)
    files = {os.path.relpath(os.path.join(d, f), tmp): os.path.getsize(os.path.join(d, f))
             for d, _, fs in os.walk(tmp) for f in fs}
    write_text_atomic(os.path.join(tmp, "meta.json"), json.dumps(dict(meta, files=files), indent=1))
    shutil.rmtree(path + ".old", ignore_errors=True)  # left by a save killed mid-swap
    if os.path.exists(path):  # the same step saved again (after a resume): swap, then delete
        os.replace(path, path + ".old")
    os.replace(tmp, path)
    fsync_path(root)
    write_text_atomic(os.path.join(root, "latest"), name + "\n")  # last: it names a complete one
    shutil.rmtree(path + ".old", ignore_errors=True)
    best = mark_best(root, keep_best)
    for old in complete_checkpoints(root)[keep:]:
        if old not in (name, best):
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)


def mark_best(root, keep_best):
    """checkpoints/best names the complete checkpoint of lowest val_loss (ties: the earlier step); a
    damaged one gives way, said. Removed without --keep-best or a candidate. Returns its name."""
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


def follow_marker(path):
    """The checkpoint directory that checkpoints/latest or best names; any other path as is."""
    if os.path.basename(path.rstrip("/")) in ("latest", "best") and os.path.isfile(path):
        with open(path) as fh:
            return os.path.join(os.path.dirname(path), fh.read().strip())
    return path


def complete_checkpoints(root):
    """Names of complete checkpoint directories, newest save first: by save time, not by step, so
    after a resume from an older checkpoint the new saves are the ones kept."""
    if not os.path.isdir(root):
        return []
    names = [n for n in os.listdir(root) if n.startswith("step_") and not n.endswith(".old")]
    metas = {n: os.path.join(root, n, "meta.json") for n in names}
    saved_at = {n: os.path.getmtime(m) if os.path.exists(m) else 0.0 for n, m in metas.items()}
    return sorted(names, key=lambda n: (saved_at[n], n), reverse=True)


def check_checkpoint(path):
    """The checkpoint's meta if every file it lists is there with its size, else RunFailed."""
    try:
        with open(os.path.join(path, "meta.json")) as fh:
            meta = json.load(fh)
        for rel, size in meta["files"].items():
            actual = os.path.getsize(os.path.join(path, rel))
            if actual != size:
                raise RunFailed(f"{rel} has {actual} bytes, {size} expected (truncated?)")
        return meta
    except (RunFailed, OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        what = e if isinstance(e, RunFailed) else f"{type(e).__name__}: {e}"
        raise RunFailed(f"checkpoint {path} is incomplete or corrupted: {what}")


def find_resume_checkpoint(run_dir, notes, skip=()):
    """(path, meta) of a run directory's latest complete checkpoint, falling back to older ones
    (noted) when it is damaged; (None, None) when there is none. skip: ones that failed to load."""
    root = os.path.join(run_dir, "checkpoints")
    names = complete_checkpoints(root)
    with contextlib.suppress(OSError), open(os.path.join(root, "latest")) as fh:
        latest = fh.read().strip()
        names = [latest] + [n for n in names if n != latest]
    for path in [os.path.join(root, n) for n in names if os.path.join(root, n) not in skip]:
        try:
            return path, check_checkpoint(path)
        except RunFailed as e:
            notes.append(f"{e}; trying an older checkpoint")
    return None, None


# Loading never runs code from a checkpoint, which may come from anyone (--init-from a colleague's
# run): the .pt files are read with weights_only=True, DCP's .metadata (a plain pickle) by
# RestrictedUnpickler, and a file that asks for anything else is refused before anything in it runs.

# The globals of DCP metadata, recorded from real checkpoints of every strategy: none can run code.
DCP_METADATA_GLOBALS = {("torch.distributed.checkpoint.metadata", name) for name in (
    "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
    "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath")} | {
    ("torch", name) for name, value in vars(torch).items() if isinstance(value, torch.dtype)}

# What an RNG file of releases before this layout holds besides tensors: numpy's array, rebuilt by
# its _reconstruct (named numpy._core... by numpy 2, numpy.core... by numpy 1).
NUMPY_ARRAY_GLOBALS = [np.ndarray, np.dtype, type(np.dtype(np.uint32))] + [
    (np.empty(0).__reduce__()[0], f"numpy.{c}.multiarray._reconstruct") for c in ("_core", "core")]


def refusal(path, name):
    return (f"refused to load {path}: it asks for {name}, which no checkpoint holds (a pickle that "
            "can run code); nothing in it was run")


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles only the globals `allowed` ((module, name) pairs); any other refuses the file."""

    def __init__(self, file, path, allowed):
        super().__init__(file)
        self.path, self.allowed = path, allowed

    def find_class(self, module, name):
        if (module, name) not in self.allowed:
            raise BadInput(refusal(self.path, f"{module}.{name}"))
        return super().find_class(module, name)


def load_weights_only(path, name=None, **kwargs):
    """torch.load(weights_only=True), but a file (or file object, named `name`) asking for another
    global is BadInput; no pickle at all raises as torch raised it. mmap: zip files only."""
    name = name or path
    if kwargs.get("mmap") and not zipfile.is_zipfile(path):
        kwargs.pop("mmap")
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
    """DCP's load planner, but a checkpoint's non-tensor entries (the optimizer's param_groups) must
    pass load_weights_only first: DCP's own planner unpickles them with weights_only=False."""

    def load_bytes(self, read_item, value):
        load_weights_only(value, name=f"the entry {read_item.dest_index.fqn} of a .distcp file")
        value.seek(0)
        super().load_bytes(read_item, value)


def read_dcp_metadata(dcp_dir):
    """DCP's .metadata through RestrictedUnpickler: dcp.load would unpickle it as it is."""
    path = os.path.join(dcp_dir, ".metadata")
    with open(path, "rb") as fh:
        return RestrictedUnpickler(fh, path, DCP_METADATA_GLOBALS).load()


def dcp_load(state, dcp_dir, partial=False):
    """dcp.load running no checkpoint code: a refusal on any rank is BadInput, not DCP's wrapper."""
    read_dcp_metadata(dcp_dir)
    try:
        dcp.load(state, checkpoint_id=dcp_dir,
                 planner=WeightsOnlyLoadPlanner(allow_partial_load=partial))
    except CheckpointException as e:
        refused = [exc for exc, _ in e.failures.values() if isinstance(exc, BadInput)]
        if refused:
            raise refused[0] from None
        raise


def load_checkpoint(path, model, optimizer, scaler, cfg, topo):
    """Restore model, optimizer, scaler and RNG states (DCP reshards to any world size or strategy).
    A failure on any rank raises on every rank: CorruptCheckpoint for bytes that do not load."""
    meta = check_checkpoint(path)
    error = None  # (message, the exception every rank raises) of this rank
    try:
        load_states(path, meta, model, optimizer, scaler, topo, cfg.train.seed)
    except (RunFailed, BadInput) as e:  # no optimizer state, or asks to run code: no fallback
        error = (str(e), type(e))
    except (torch.OutOfMemoryError, MemoryError) as e:  # the files may be fine: no fallback
        error = (f"loading {path} failed on rank {topo.rank}: {type(e).__name__}: {e}", RunFailed)
    except (Exception, CheckpointException) as e:
        error = (f"checkpoint {path} is incomplete or corrupted: rank {topo.rank}: "
                 f"{type(e).__name__}: {e}", CorruptCheckpoint)
    error = any_rank_error(error, topo)
    if error:
        raise error[1](error[0].splitlines()[0])
    return meta


def load_states(path, meta, model, optimizer, scaler, topo, seed):
    if meta["type"] == "sharded":  # tensors to load into, optimizer's too; frozen: --init-from's
        opts = StateDictOptions(ignore_frozen_params=True, strict=False)
        state = sharded_state(model, optimizer, opts)
        dcp_load(state, os.path.join(path, "dcp"))
    else:
        state = load_weights_only(os.path.join(path, "model.pt"), mmap=True)
        opts = StateDictOptions(full_state_dict=True)  # each rank takes its shards of the whole
        if "optim" not in state:
            raise RunFailed(f"{path} holds no optimizer state (saved with --no-full-optimizer); "
                            "start a new run from its weights with --init-from instead")
    set_model_state_dict(model, state["model"], options=opts)
    set_optimizer_state_dict(model, optimizer, state["optim"], options=opts)
    if scaler and meta["scaler"]:
        scaler.load_state_dict(meta["scaler"])
    if meta["world_size"] == topo.world:
        with torch.serialization.safe_globals(NUMPY_ARRAY_GLOBALS):  # older files: exact too
            set_rng_state(load_weights_only(os.path.join(path, f"rng_rank{topo.rank}.pt")))
    else:  # other ranks, other streams: seed them from the step so the run stays reproducible
        torch.manual_seed(seed + topo.rank + 1_000_003 * meta["step"])


def restore_state(resume, model, optimizer, scaler, cfg, topo, notes):
    """Resume from a checkpoint (under --resume auto a damaged one gives way to the next older,
    noted), or take the weights of --init-from, or neither. Returns (step, tokens seen)."""
    t0, failed, run_dir = time.perf_counter(), [], cfg.train.out_dir
    if frozen_base(cfg, model) or (cfg.checkpoint.init_from and not resume):
        init_weights_from(cfg.checkpoint.init_from, model)
        which = "the frozen ones" if resume else "fresh optimizer, step 0"
        notes.append(f"initialised the weights from {cfg.checkpoint.init_from} in "
                     f"{time.perf_counter() - t0:.1f} s ({which})")
    if not resume:
        return 0, 0
    while True:
        try:
            meta = load_checkpoint(resume, model, optimizer, scaler, cfg, topo)
            break
        except CorruptCheckpoint as e:
            if cfg.checkpoint.resume != "auto":
                raise
            failed.append(resume)
            resume, _ = rank0_does(lambda: find_resume_checkpoint(run_dir, [], failed), topo.rank)
            if resume is None:
                raise RunFailed(f"{e}; no older complete checkpoint in {run_dir}: start from its "
                                "weights with --init-from, or afresh with --overwrite (which "
                                "deletes its checkpoints)")
            notes.append(f"{e}; trying an older checkpoint")
    same_world = meta["world_size"] == topo.world
    reseeded = "" if same_world else "; RNG streams re-seeded for the new world size"
    notes.append(f"resumed from {resume} in {time.perf_counter() - t0:.1f} s (step {meta['step']}, "
                 f"saved by {meta['world_size']} processes{reseeded})")
    return meta["step"], meta["tokens_seen"]


def checkpoint_weights(path):
    """(kind, location) of the weights of a run dir, a step dir (or checkpoints/best or latest) or
    a model.pt, for --init-from. A checkpoint must pass the size check of a resume."""
    path = follow_marker(path)
    if os.path.isdir(path) and any(n.endswith(".safetensors") for n in os.listdir(path)):
        return "hf", path  # a downloaded model's directory (no checkpoint of ours has safetensors)
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


def check_init_from_shapes(cfg, model, topo):
    check_frozen(cfg, model)
    if cfg.checkpoint.init_from:  # beside frozen weights, what trains starts from its init (LoRA)
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()
                  if not (p.requires_grad and frozen_base(cfg, model))}
        rank0_does(lambda: check_init_from(cfg.checkpoint.init_from, shapes), topo.rank)


def check_init_from(path, shapes):
    """BadInput unless --init-from's checkpoint holds each parameter of `shapes` ({name: shape})."""
    kind, src = checkpoint_weights(path)
    if kind == "hf":
        theirs = import_optional("hf_checkpoint", "--init-from").shapes(src, shapes)
    elif kind == "full":
        theirs = {k: tuple(v.shape) for k, v in load_weights_only(src, mmap=True)["model"].items()}
    else:
        metadata = read_dcp_metadata(src).state_dict_metadata
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
    if kind == "hf":  # each rank reads only the slices it holds
        return import_optional("hf_checkpoint", "--init-from").load(where, model)
    if kind == "full":
        state = load_weights_only(where, mmap=True)
    else:  # what it holds: check_init_from let it lack only what trains beside frozen weights
        state = {"model": get_model_state_dict(model)}
        dcp_load(state, where, partial=True)
    # it may hold more keys (a full checkpoint's), or fewer (not LoRA's adapters)
    opts = StateDictOptions(full_state_dict=kind == "full", strict=False)
    set_model_state_dict(model, state["model"], options=opts)


def frozen_base(cfg, model):
    """Frozen weights from --init-from (LoRA's base): loaded from it at every start, stored as they
    compute, left out of checkpoints, which record the digest of its files instead."""
    return bool(cfg.checkpoint.init_from) and not all(p.requires_grad for p in model.parameters())


def check_frozen(cfg, model):
    if frozen_base(cfg, model):  # where a resume or --export reads them, from any directory
        cfg.checkpoint.init_from = os.path.abspath(cfg.checkpoint.init_from)
    needs = [(cfg.train.strategy != "fsdp", "--strategy fsdp2, ddp or none: FSDP1 flattens a "
              "unit into one tensor of one dtype, with a gradient for all of it"),
             (cfg.checkpoint.checkpoint_type == "sharded", "--checkpoint-type sharded: a full "
              "checkpoint is a whole model, and theirs hold only the parameters that train")]
    for ok, need in needs if frozen_base(cfg, model) else []:
        if not ok:
            raise BadInput(f"frozen weights from --init-from (LoRA's base) need {need}")


def run_digests(cfg, model, data, topo):
    """{source: digest} that a resume must find unchanged: the data's (BatchSource) and, where
    weights are frozen, that of the --init-from files that hold them (ckpt_export.py)."""
    if not frozen_base(cfg, model):
        return getattr(data, "digests", None)
    export = import_optional("ckpt_export", "a model with frozen parameters")
    path, this = cfg.checkpoint.init_from, sys.modules[__name__]
    digest = rank0_does(lambda: export.weights_digest(path, this), topo.rank)
    return {**(getattr(data, "digests", None) or {}), export.FROZEN: digest}


def require_checkpoint_dir(path, flag, valid):
    """(path, meta) of a checkpoint directory (latest and best followed), else BadInput."""
    path = follow_marker(path)
    if not os.path.exists(path):
        raise BadInput(f"{flag} {path}: no such directory; valid: {valid}")
    if os.path.isdir(os.path.join(path, "checkpoints")):
        found = complete_checkpoints(os.path.join(path, "checkpoints"))
        example = os.path.join(path, "checkpoints", found[0] if found else "step_N")
        raise BadInput(f"{flag} {path} is a run directory, not a checkpoint directory "
                       f"(no meta.json); give one of its checkpoints, e.g. {example}")
    if not os.path.isfile(os.path.join(path, "meta.json")):
        raise BadInput(f"{flag} {path}: not a checkpoint directory (no meta.json); valid: {valid}")
    return path, check_checkpoint(path)


# =============================================================================================
# Reference: run directory (config.json, metrics.jsonl, training_log.txt, run.lock, checkpoints/)

RUN_LOCK = "run.lock"  # locked by rank 0 while a run writes in the directory, naming its process
STOPPED_FILE = "stopped.json"  # after an exit with code 3; removed at the next start
# A resume may not change what the run computes: these training settings, and every field of the
# seams' sections not listed in their dataclass's RESUME_FREE. Other changes are allowed and said.
RESUME_FIXED = {"fsdp": set(), "checkpoint": set(), "train": {
    "seed", "global_batch", "lr", "min_lr_ratio", "warmup_steps", "lr_scale_base_batch",
    "weight_decay", "beta1", "beta2", "grad_clip", "optimizer", "muon_lr"}}


def name_run_dir(cfg, model):
    """--out-dir left empty: runs/<model class>-<date-time>, one name for all ranks."""
    if not cfg.train.out_dir:
        stamp = [datetime.datetime.now().strftime("%Y%m%d-%H%M%S")]
        dist.broadcast_object_list(stamp, src=0)
        cfg.train.out_dir = os.path.join("runs", f"{type(model).__name__.lower()}-{stamp[0]}")


def prepare_run_dir(cfg, rank, digests=None):
    """Rank 0 locks the run directory and decides where the run starts (choose_start); every rank
    learns it. Returns (checkpoint to resume or None, notes, rank 0's lock). A refused launch leaves
    the directory as it was: only the lock (and the flight recorder's directory) before start_in."""
    run_dir, held = cfg.train.out_dir, [None]

    def decide():
        new_dir, lock_path = not os.path.isdir(run_dir), os.path.join(run_dir, RUN_LOCK)
        new_lock = not os.path.exists(lock_path)
        os.makedirs(run_dir, exist_ok=True)
        try:
            held[0], notes = lock_run_dir(run_dir)  # held while deciding
            resume, more = choose_start(cfg, digests)
        except BaseException:
            if held[0]:
                held[0].close()
            if new_lock and os.path.exists(lock_path):
                os.remove(lock_path)
            if new_dir:
                os.rmdir(run_dir)
            raise
        if held[0]:
            held[0].truncate(0)
            held[0].write(f"host {socket.gethostname()} pid {os.getpid()}\n")
            held[0].flush()
        if flight_recorder_dumps():  # dumps need their directory before a resume's first collective
            os.makedirs(os.path.dirname(flight_recorder_dumps()), exist_ok=True)
        return resume, notes + more, cfg.train.lr_decay_steps
    resume, notes, cfg.train.lr_decay_steps = rank0_does(decide, rank)
    return resume, notes, held[0]


def lock_run_dir(run_dir):
    """flock RUN_DIR/run.lock: a second launch is refused, naming the holder. The kernel drops the
    lock however the run ends (killed too). Returns (the lock file or None without flock, notes)."""
    path = os.path.join(run_dir, RUN_LOCK)
    fh = open(path, "a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fh, []
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read().strip() or "another process"
        fh.close()
        raise BadInput(f"--out-dir {run_dir} is in use by {holder}: a run directory takes one run "
                       "at a time; wait for it to end or stop it, or choose another --out-dir")
    except OSError as e:  # e.g. Lustre mounted without flock
        fh.close()
        return None, [f"{path}: no lock ({e.strerror}); a second launch into {run_dir} would not "
                      "be refused"]


def choose_start(cfg, digests):
    """(checkpoint to resume or None, notes). A run directory holding a run is continued (--resume
    auto) if the config and data match, refused otherwise, started afresh with --overwrite."""
    run_dir, c = cfg.train.out_dir, cfg.checkpoint
    root, config_path = os.path.join(run_dir, "checkpoints"), os.path.join(run_dir, "config.json")
    resume, meta, old, notes = None, None, None, []
    # Checkpoints without a config.json (deleted by hand, say) are a run all the same.
    holds_run = (os.path.exists(config_path) or bool(complete_checkpoints(root))
                 or os.path.exists(os.path.join(root, "latest")))
    if c.resume not in ("auto", "never"):
        resume, meta = require_checkpoint_dir(c.resume.rstrip("/"), "--resume",
                                              "auto, never or a checkpoint directory")
        old = meta["config"]
    elif holds_run and cfg.train.overwrite:
        shutil.rmtree(root, ignore_errors=True)
        notes.append(f"--overwrite: starting {run_dir} afresh (its checkpoints were deleted)")
    elif holds_run and c.resume == "never":
        raise BadInput(f"--out-dir {run_dir} already holds a run; pass --resume auto to continue "
                       "it or --overwrite to start afresh")
    elif holds_run:
        resume, meta = find_resume_checkpoint(run_dir, notes)
        if resume is None and notes:  # none complete: training would replace them
            newest = notes[0].removesuffix("; trying an older checkpoint")
            raise BadInput(f"--out-dir {run_dir} holds a run but none of its checkpoints is "
                           f"complete (newest: {newest}); not training over it: start from other "
                           "weights with --init-from, or afresh with --overwrite (which deletes "
                           "its checkpoints)")
        old = meta["config"] if resume else read_saved_config(config_path, run_dir)
    cfg.train.lr_decay_steps = schedule_length(cfg.train, (old or {}).get("train", {}))
    if old is not None:
        notes += resume_changes(cfg, old, meta, digests, resume)
    return resume, notes


def read_saved_config(config_path, run_dir):
    try:
        with open(config_path) as fh:
            return json.load(fh)
    except ValueError:
        raise BadInput(f"--out-dir {run_dir} already holds a run whose config.json cannot be read; "
                       "choose another directory or pass --overwrite")


def resume_changes(cfg, old, meta, digests, resume):
    """A resume's notes; BadInput where the config (`old`) or data would silently change the run."""
    refused, allowed = [], []
    for section, sec in sections(cfg).items():
        fixed = RESUME_FIXED[section] if section in RESUME_FIXED else set(dataclasses.asdict(sec))
        saved = old.get(section, {})
        if hasattr(sec, "saved_fields"):  # a seam's: fills in the fields the old run predates
            saved = sec.saved_fields(saved)
        for key, value in dataclasses.asdict(sec).items():
            before = saved.get(key)
            if before != value:
                refuse = key in fixed and key not in getattr(sec, "RESUME_FREE", ())
                (refused if refuse else allowed).append(f"{section}.{key}: {before!r} -> {value!r}")
    changed = data_changes(meta.get("data") if meta else None, digests)
    kinds = (("another config", refused), ("other data", changed))
    other = " and ".join(kind for kind, lines in kinds if lines)
    if other:
        found = f"{other} ({'; '.join(refused + changed)})"
        if cfg.checkpoint.resume not in ("auto", "never"):  # --resume PATH: that checkpoint's run
            raise BadInput(f"--resume {cfg.checkpoint.resume} was saved with {found}; resuming "
                           "would silently change its run: resume it with its own settings, or "
                           "start a new run from its weights with --init-from")
        raise BadInput(f"--out-dir {cfg.train.out_dir} already holds a run with {found}; resuming "
                       "would silently change it: choose another directory or pass --overwrite")
    notes = [f"changed on resume: {line}" for line in allowed]
    if resume and any(line.startswith(("train.max_steps", "train.lr_")) for line in allowed):
        notes.append(f"changed on resume: {schedule_change(cfg, old['train'], meta['step'])}")
    return notes


def data_changes(old, new):
    """'data: SOURCE changed' (added, removed) between a checkpoint's digests and this run's."""
    if old is None or new is None:
        return []
    return ([f"data: {k} changed" for k in new if k in old and new[k] != old[k]] +
            [f"data: {k} added" for k in new if k not in old] +
            [f"data: {k} removed" for k in old if k not in new])


def schedule_change(cfg, before, start):
    """Rate changes of a resume at `start` with new --max-steps/schedule (`before`: old [train])."""
    t, peak = cfg.train, peak_lr(cfg.train)
    old_steps = before.get("max_steps") or t.max_steps
    old = dataclasses.replace(cfg, train=dataclasses.replace(
        t, lr_schedule=before.get("lr_schedule", "cosine"),
        lr_decay_steps=before.get("lr_decay_steps") or 0))
    planned = range(start, min(old_steps, t.max_steps))
    moved = [s for s in planned
             if not math.isclose(lr_at(s, peak, old, old_steps), lr_at(s, peak, cfg, t.max_steps))]
    if moved:
        s = moved[0]
        parts = [f"steps {s + 1}-{moved[-1] + 1} of the plan change rate (step {s + 1}: "
                 f"{lr_at(s, peak, old, old_steps):.2e} -> {lr_at(s, peak, cfg, t.max_steps):.2e})"]
    else:
        parts = [f"steps {start + 1}-{planned[-1] + 1} keep their planned rates"] if planned else []
    if t.max_steps > old_steps:
        parts.append(f"steps {old_steps + 1}-{t.max_steps} are added, at "
                     f"{lr_at(old_steps, peak, cfg, t.max_steps):.2e}"
                     f" to {lr_at(t.max_steps - 1, peak, cfg, t.max_steps):.2e}")
    return (f"learning rate ({t.lr_schedule}, lr_decay_steps {t.lr_decay_steps}): " +
            "; ".join(parts or ["unchanged"]))


def start_in(run_dir, step, cfg):
    """Rank 0, once the start is loaded: clear a stopped attempt's files, keep metrics to `step`."""
    root = os.path.join(run_dir, "checkpoints")
    stale = [STOPPED_FILE] if step else [STOPPED_FILE, "training_log.txt"]  # step 0: a new log
    for name in stale:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(run_dir, name))
    keep_metric_lines(os.path.join(run_dir, "metrics.jsonl"), step)
    for name in os.listdir(root) if os.path.isdir(root) else []:
        if name.startswith(".tmp-"):  # left by a save that was killed
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    config = json.dumps(dataclasses.asdict(cfg), indent=2)
    write_text_atomic(os.path.join(run_dir, "config.json"), config)


def keep_metric_lines(path, last_step):
    """Drop metric records after the step a run restarts from, so each step appears once."""
    keep = [line if line.endswith("\n") else line + "\n" for line, record in metric_records(path)
            if record.get("step", 0) <= last_step]
    write_text_atomic(path, "".join(keep))


def metric_records(path):
    """(line, record) per line of metrics.jsonl, if any; skips a line torn by a crash mid-write."""
    with contextlib.suppress(FileNotFoundError), open(path) as fh:
        for line in fh:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            yield line, record


def flight_recorder_dumps():
    """The flight recorder's dump path prefix when on (--debug or slurm_submit.sh), else None."""
    on = os.environ.get("TORCH_FR_BUFFER_SIZE", "0") not in ("", "0")
    return (os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or None) if on else None


# =============================================================================================
# Reference: logging. Rank 0 writes metrics.jsonl (one JSON object per event), training_log.txt
# (the same, readable) and the trackers asked for; the other ranks stay quiet.


class RunLog:
    """A write that fails on rank 0 (a full disk) is kept in `error`, not raised: rank 0 stopping
    alone would leave the others waiting in a collective. Stopper stops every rank on it."""

    def __init__(self, run_dir, rank):
        self.rank, self.trackers = rank, None
        self.error, self.jsonl, self.text = None, None, None
        if rank == 0:
            try:
                self.jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a")
                self.text = open(os.path.join(run_dir, "training_log.txt"), "a")
            except OSError as e:
                self.failed(e.filename, e)

    def write(self, fh, text):
        if self.error is None:
            try:
                fh.write(text)
                fh.flush()
            except OSError as e:
                self.failed(fh.name, e)

    def failed(self, what, e):
        if self.error is None:  # the first failure is the one to report
            self.error = (f"writing {what} failed on rank 0 ({type(e).__name__}: {e}); the latest "
                          "checkpoint is intact")

    def line(self, msg, file_too=True):
        if self.rank == 0:
            if file_too:
                self.write(self.text, msg + "\n")
            try:
                tqdm.write(msg)  # above the bar, in a terminal
            except OSError as e:  # stdout redirected to a full disk (a Slurm log)
                self.failed("stdout", e)

    def start_trackers(self, cfg, start_step):
        """Rank 0 opens the trackers asked for (trackers.py) once the start step is known."""
        if self.rank == 0 and (cfg.train.tensorboard or cfg.train.wandb):
            records = metric_records(os.path.join(cfg.train.out_dir, "metrics.jsonl"))
            self.trackers = importlib.import_module("trackers").Trackers(
                dataclasses.asdict(cfg), start_step, self.line, [r for _, r in records])

    def metrics(self, record):
        if self.rank == 0:
            self.write(self.jsonl, json.dumps(record) + "\n")
            if self.trackers:
                self.trackers.log(record)

    def step(self, rec, keys):
        """A training record (Meter.record) and its line; `keys`: the losses, in the order shown."""
        self.metrics(rec)
        parts = " ".join(f"{k} {rec[k]:.4f}" for k in keys)
        mfu = f" | mfu {100 * rec['mfu']:.1f}%" if "mfu" in rec else ""
        self.line(f"step {rec['step']:>6} | {parts} | lr {rec['lr']:.2e} | "
                  f"gnorm {rec['grad_norm']:.3f} | {rec['tokens_per_s']:,.0f} tok/s | "
                  f"{1000 * rec['step_time_s']:.1f} ms/step{mfu} | "
                  f"mem {rec['mem_peak_gib']:.2f} GiB peak")

    def validation(self, step, val, tokens_seen, seconds):
        self.metrics({"step": step, "tokens_seen": tokens_seen,
                      **{f"val_{k}": v for k, v in val.items()}})
        losses = " ".join(f"{k} {v:.4f}" for k, v in val.items())
        self.line(f"step {step:>6} | validation {losses} | {seconds[0]:.2f} s")

    def close(self):
        for fh in filter(None, (self.jsonl, self.text)):
            with contextlib.suppress(OSError):  # a failed write is in self.error already
                fh.close()


class Meter:
    """Throughput, MFU, memory over the steps since the last record (evaluation, saves kept out)."""

    def __init__(self, topo, plan, flops_per_token):
        self.topo, self.plan, self.flops_per_token = topo, plan, flops_per_token
        self.peak = peak_flops(topo.device)
        self.reset()

    def reset(self):
        self.start, self.steps, self.data_time = time.perf_counter(), 0, 0.0

    def add_step(self, data_time):
        self.steps += 1
        self.data_time += data_time

    @contextlib.contextmanager
    def paused(self):
        """Time kept out of the throughput; the list it yields holds it once the block has run."""
        t0, seconds = time.perf_counter(), []
        try:
            yield seconds
        finally:
            seconds.append(time.perf_counter() - t0)
            self.start += seconds[0]

    def record(self, step, totals, lr, grad_norm, tokens_seen):
        """`step`'s record: losses, throughput, memory (max over ranks); collectives, every rank."""
        world, device = self.topo.world, self.topo.device
        losses = all_reduce_scalars({k: v / world for k, v in totals.items()}, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - self.start
        step_time = elapsed / self.steps
        mem = all_reduce_scalars(memory_stats(device), device, op=dist.ReduceOp.MAX)
        rec = {"step": step, **losses, "lr": lr, "grad_norm": float(grad_norm),
               "tokens_per_s": self.plan.tokens_per_step / step_time, "step_time_s": step_time,
               "data_fraction": self.data_time / elapsed, "tokens_seen": tokens_seen, **mem}
        if self.peak and self.flops_per_token:
            rec["mfu"] = self.flops_per_token * rec["tokens_per_s"] / world / self.peak
        self.reset()
        return rec


class StartClock:
    """Start-up seconds per phase, said with the first step (mostly compile under --compile)."""

    def __init__(self):
        self.t, self.phases = time.perf_counter(), []

    def lap(self, phase, sync=None):
        """Ends `phase`, returns a line of all phases so far. sync: a device tensor to wait for."""
        if sync is not None:
            sync.item()
        now = time.perf_counter()
        self.phases.append(f"{phase} {now - self.t:.1f} s")
        self.t = now
        return "start-up: " + " | ".join(self.phases)


def keep_compile_cache(cfg):
    """--compile keeps graphs and kernels beside the run directory, not in /tmp, for the next run,
    a resume and a requeue. Checked first: a bad path is one line, not a traceback."""
    if cfg.train.compile:
        beside = os.path.join(os.path.dirname(os.path.abspath(cfg.train.out_dir)), ".compile_cache")
        cache = os.path.abspath(cfg.train.compile_cache or USER_COMPILE_CACHE or beside)
        try:
            os.makedirs(cache, exist_ok=True)
            tempfile.TemporaryFile(dir=cache).close()  # a read-only directory passes makedirs
        except OSError as e:
            raise BadInput(f"compile cache {cache}: {e.strerror}; give --compile-cache a directory "
                           "this process can create and write") from None
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache


def compile_cache_note(cfg):
    """How many compiled graphs came from the cache (rank 0's count)."""
    if not cfg.train.compile:
        return ""
    n = torch._dynamo.utils.counters["inductor"]
    return (f" | compile cache {os.environ['TORCHINDUCTOR_CACHE_DIR']}: "
            f"{n['fxgraph_cache_hit']} graphs reused, {n['fxgraph_cache_miss']} compiled")


def memory_stats(device):
    """GiB allocated, reserved and at peak; on CPU the process's peak resident set."""
    if device.type == "cuda":
        gib = 2 ** 30
        return {"mem_alloc_gib": torch.cuda.memory_allocated(device) / gib,
                "mem_reserved_gib": torch.cuda.memory_reserved(device) / gib,
                "mem_peak_gib": torch.cuda.max_memory_allocated(device) / gib}
    return {"mem_alloc_gib": 0.0, "mem_reserved_gib": 0.0,
            "mem_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20}


def peak_flops(device):
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def describe_model(model, cfg, plan, wrap_classes):
    """Before wrapping: the model's counts, flops per token, decay and Muon names, eval note."""
    total, hidden = parameter_count(model), set()
    flops = model.flops_per_token(plan.seq_len) if hasattr(model, "flops_per_token") else 6 * total
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if cfg.train.optimizer == "muon":  # muon.py's rule: the matrices it orthogonalises
        hidden = import_optional("muon", "--optimizer muon").hidden_matrices(model, wrap_classes)
    return {"total": total, "trainable": trainable, "flops": flops, "hidden": hidden,
            "decay_names": decayed_names(model), "note": getattr(model, "evaluation_note", "")}


def progress_bar(plan, start_step, topo):
    """A bar for a terminal: in a Slurm or redirected log its redraws would fill the file."""
    return tqdm(total=plan.max_steps, initial=start_step, dynamic_ncols=True, desc="train",
                disable=topo.rank != 0 or not sys.stderr.isatty())


def start_profiler(cfg, topo):
    if not cfg.train.profile:
        return None
    trace = os.path.join(cfg.train.out_dir, f"trace_rank{topo.rank}.json")
    profiler = torch.profiler.profile(
        schedule=torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(trace))
    profiler.start()
    return profiler


def start_log(cfg, topo, plan, model, about, n_val, notes, start_step):
    """The run's log: rank 0's start-up lines (config, strategy, sizes, saves), then trackers."""
    log = RunLog(cfg.train.out_dir, topo.rank)
    for note in notes:
        log.line(note)
    t, c, device, n = cfg.train, cfg.checkpoint, topo.device, about["total"]
    per_rank = [None] * topo.world
    dist.all_gather_object(per_rank, local_parameter_count(model))
    log.line(json.dumps(dataclasses.asdict(cfg), indent=1), file_too=False)
    headline, notes = describe_strategy(cfg, one=one_unit(cfg.fsdp, n))
    log.line(f"world {topo.world} | backend {topo.backend} | device {device} "
             f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else ''}".rstrip())
    log.line(headline)
    log.line(loss_precision(cfg))
    if strategy_of(cfg).shards:
        log.line(describe_units(model, cfg, n))
    if t.compile:
        log.line(f"compile: {'each block' if compiles_blocks(cfg, n) else 'the model'}, "
                 f"mode {compile_mode(cfg, n)}")
    log.line(f"parameters: total {n:,} | trainable {about['trainable']:,} | on rank 0 "
             f"{per_rank[0]:,} (fewest on a rank {min(per_rank):,}, most {max(per_rank):,})")
    log.line(f"batch: global {t.global_batch} = micro {plan.micro} x world {topo.world} x accum "
             f"{plan.accum} ({t.grad_accum_mode}) | seq {plan.seq_len} | "
             f"{plan.tokens_per_step:,} tokens/step | {plan.max_steps} steps")
    for note in notes + ([about["note"]] if about["note"] else []):
        log.line(note)
    if flight_recorder_dumps():
        log.line(f"flight recorder: the last {os.environ['TORCH_FR_BUFFER_SIZE']} collectives per "
                 f"rank, dumped on a collective timeout (NCCL) to {flight_recorder_dumps()}<rank>")
    rows = min(t.eval_samples, n_val)
    share = f"of {n_val:,} (--eval-samples {t.eval_samples})" if rows < n_val else "the whole split"
    log.line(f"evaluation: {f'every {t.eval_every} steps' if t.eval_every else 'at the end'}"
             f"{' and at each save (--keep-best)' if c.keep_best else ''} | {rows:,} validation "
             f"rows each, {share}")
    saves = f"every {c.save_every} steps" if c.save_every else "at the end"
    log.line(f"run directory: {t.out_dir} | checkpoints: {c.checkpoint_type}, {saves}"
             f"{' in the background (--async-save)' if c.save_every and c.async_save else ''}, "
             f"keep the newest {c.keep_checkpoints}{' and the best' if c.keep_best else ''}")
    log.start_trackers(cfg, start_step)
    return log


# What only FSDP reads (param_dtype and activation checkpointing serve DDP and one device too).
FSDP_ONLY = {"sharding_strategy", "hybrid_shard_size", "backward_prefetch", "forward_prefetch",
             "limit_all_gathers", "use_orig_params", "cpu_offload", "sync_module_states",
             "auto_wrap", "min_num_params", "reduce_dtype", "buffer_dtype", "autocast"}
# FSDP1 settings FSDP2 has no form for: said, not refused, when changed from the default.
FSDP2_IGNORED = {"backward_prefetch", "limit_all_gathers", "use_orig_params", "sync_module_states",
                 "buffer_dtype"}


def describe_strategy(cfg, one=False):
    """Start-up (headline, notes): strategy, dtypes, settings it ignores; one: one FSDP unit."""
    t, f, default = cfg.train, cfg.fsdp, FSDPConfig()
    off = {"fsdp": set(), "fsdp2": FSDP2_IGNORED}.get(t.strategy, FSDP_ONLY)
    ignored = [f"{flag_name(k)} {v}" for k, v in dataclasses.asdict(f).items()
               if k in off and v != getattr(default, k)]
    what = "FSDP1" if off is FSDP2_IGNORED else "FSDP"
    notes = [f"with --strategy {t.strategy} these {what} settings have no effect: "
             f"{', '.join(ignored)}"] if ignored else []
    dtypes = f"| dtypes param={f.param_dtype} reduce={f.reduce_dtype}"
    if t.strategy == "fsdp":
        if not f.use_orig_params and t.weight_decay > 0:
            notes.append("use_orig_params=False: FSDP flattens parameters, so weight decay "
                         "applies to all of them")
        return (f"strategy fsdp {f.sharding_strategy} wrap={f.auto_wrap} "
                f"prefetch={f.backward_prefetch} {dtypes} buffer={f.buffer_dtype}"), notes
    if t.strategy == "fsdp2":
        reshard = fsdp2_reshards(f)
        last = " and last block" if f.auto_wrap != "size" and not one else ""
        kept = f" except the root{last}" if reshard else ""
        return (f"strategy fsdp2 {f.sharding_strategy} (reshard_after_forward={reshard}{kept}) "
                f"wrap={f.auto_wrap}{' forward_prefetch' if f.forward_prefetch else ''}"
                f"{' cpu_offload' if f.cpu_offload else ''} {dtypes}"), notes
    return (f"strategy {t.strategy} | autocast {f.param_dtype} (reduce/buffer dtypes apply to "
            "FSDP only)"), notes


def describe_units(model, cfg, n_params):
    f, count = cfg.fsdp, sum(isinstance(m, (FSDP, FSDPModule)) for m in model.modules())
    if one_unit(f, n_params):
        return (f"FSDP units: 1, the whole model: --auto-wrap auto keeps a model below "
                f"{ONE_UNIT_BELOW:,} parameters whole (--auto-wrap module: a unit per block)")
    what = "each block" if f.auto_wrap != "size" else f"modules of >= {f.min_num_params:,} params"
    return f"FSDP units: {count}: the root, and {what} (--auto-wrap {f.auto_wrap})"


def loss_precision(cfg):
    """The start-up line on the precision compute_loss runs in (precision_context)."""
    dtype = cfg.fsdp.param_dtype
    if dtype == "fp32":
        return "loss: compute_loss runs in fp32"
    if not autocasts(cfg):
        return (f"loss: compute_loss gets the model's {dtype} outputs (FSDP computes in {dtype}, "
                "no autocast): a loss it does not compute in fp32 (this project's casts the "
                f"logits) is {dtype}; --autocast runs cross_entropy, softmax and norms in fp32")
    return (f"loss: compute_loss runs under autocast {dtype}: cross_entropy, softmax and norms "
            "in fp32")


# =============================================================================================
# Reference: stopping. Slurm sends SIGTERM or SIGUSR1 before preemption or the time limit.


class Stopper:
    """Signals only set a flag: every rank finishes its step, saves and exits together (code 3). So
    does a worker whose torchrun is gone: alone it would train on, unseen by a next launch."""

    LAUNCHER_GONE = 1000  # a stop reason beside the signal numbers, larger than any of them

    def __init__(self, topo, log):
        self.topo, self.log, self.reason = topo, log, 0
        # Not without torchrun: a `nohup python train_fsdp.py` outlives its shell on purpose.
        self.launcher = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGTERM, signal.SIGUSR1)}

    def handle(self, signum, frame):
        self.reason = signum

    def poll(self):
        """Any rank's stop reason (0: go on), on every rank; RunFailed if rank 0's log failed."""
        if self.launcher is not None and os.getppid() != self.launcher:
            self.reason = self.LAUNCHER_GONE
        flags = torch.tensor([self.reason, int(self.log.error is not None)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.topo.control)
        if flags[1].item():  # only rank 0 holds the text
            raise RunFailed(self.log.error or "rank 0 could not write the run's log")
        return flags[0].item()

    def leave(self, reason, step, run_dir):
        """After the stop's save: rank 0 writes stopped.json (for launchers that cannot see our exit
        code: torchrun turns 3 into 1), and every rank waits for it (rank0_does is a collective)."""
        text = json.dumps({"step": step}) + "\n"
        path = os.path.join(run_dir, STOPPED_FILE)
        rank0_does(lambda: write_text_atomic(path, text), self.topo.rank,
                   lambda e: RunFailed(f"the checkpoint of step {step} is saved, but "
                                       f"{STOPPED_FILE} could not be written ({e}): a launcher "
                                       "will take this stop for a failure"))
        what = ("launcher gone (torchrun exited and left its workers running)"
                if reason == self.LAUNCHER_GONE else f"signal {signal.Signals(reason).name}")
        raise Preempted(f"{what} at step {step}: checkpoint saved, exiting with code "
                        f"{EXIT_PREEMPTED}; run the same command with --out-dir {run_dir} to "
                        "resume")

    def close(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


# =============================================================================================
# Reference: the command line and TOML, the checks, and the resolution of the config


def parse_with_seams(argv, build_model, compute_loss, load_dataset, model_config, data_config):
    """The config and seams (given, else this project's), parsed and checked before any setup."""
    if bool(build_model) != bool(compute_loss) or (model_config and not build_model):
        raise BadInput("pass build_model, compute_loss (and model_config, if any) together: this "
                       "project's read what its own model returns and its settings")
    if data_config and not load_dataset:
        raise BadInput("data_config needs your load_dataset: this project's reads its own settings")
    for name, given in (("model_config", model_config), ("data_config", data_config)):
        if given is not None and not (isinstance(given, type) and dataclasses.is_dataclass(given)):
            raise BadInput(f"{name}={getattr(given, '__qualname__', given)!r} is not a dataclass: "
                           "pass the class of your settings, decorated with @dataclass, each field "
                           "an int, float, str or bool")
    this = sys.modules[__name__]
    made = {"model": model_config or (NoSettings if build_model else None),
            "data": data_config or (NoSettings if load_dataset else None)}
    cfg = parse_config(argv, Config(**{name: make() for name, make in made.items() if make}))
    if cfg.checkpoint.init_from and checkpoint_weights(cfg.checkpoint.init_from)[0] == "hf":
        import_optional("hf_checkpoint", "--init-from").configure(cfg, this)  # its config.json
    check_config(cfg)
    return (cfg, build_model or this.build_model, compute_loss or this.compute_loss,
            load_dataset or this.load_dataset)


def sections(cfg):
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def flag_name(name):
    return "--" + name.replace("_", "-")


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        if message.startswith("unrecognized arguments"):
            message += f" (python {os.path.basename(sys.argv[0])} --help lists the valid flags)"
        raise BadInput(message)


def field_type(section, f):
    """int, float, str or bool (a string under `from __future__ import annotations`)."""
    typ = {"int": int, "float": float, "str": str, "bool": bool}.get(f.type, f.type)
    if typ not in (int, float, str, bool):
        raise BadInput(f"{section}.{f.name}: type {f.type!r}; a setting is an int, float, "
                       "str or bool")
    return typ


def build_arg_parser(cfg=None):
    parser = OneLineParser(description="Train with FSDP / DDP / one device. Every setting is a "
                           "flag; --config FILE.toml sets the same fields by [section].",
                           allow_abbrev=False)
    parser.add_argument("--config", default="", help="TOML file with [model], [data], [fsdp], "
                        "[train], [checkpoint] tables")
    parser.add_argument("--export", metavar="CHECKPOINT_DIR", default=argparse.SUPPRESS,
                        help="write CHECKPOINT_DIR/model.pt from a sharded checkpoint, "
                             "then exit (given alone)")
    owner = {}  # flag -> the field that has it: a seam's setting may not reuse a trainer's flag
    for section, obj in sections(cfg or Config()).items():
        group = parser.add_argument_group(section)
        for f in dataclasses.fields(obj):
            flag, dest = flag_name(f.name), f"{section}.{f.name}"
            if flag in owner:
                raise BadInput(f"{owner[flag]} and {dest} would both be {flag}: rename one")
            owner[flag] = dest
            kw = dict(dest=dest, default=argparse.SUPPRESS, help=f.metadata.get("help", ""))
            if field_type(section, f) is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
            else:
                group.add_argument(flag, type=field_type(section, f),
                                   choices=f.metadata.get("choices"), **kw)
    return parser


def set_field(cfg, section, key, value, source):
    sec = sections(cfg).get(section)
    if sec is None:
        raise BadInput(f"{source}: unknown table [{section}]; "
                       f"valid tables: {', '.join(sections(cfg))}")
    fields = {f.name: f for f in dataclasses.fields(sec)}
    if key not in fields:
        raise BadInput(f"{source}: unknown key {section}.{key}; valid keys: {', '.join(fields)}")
    typ = field_type(section, fields[key])
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if type(value) is not typ:
        raise BadInput(f"{source}: {section}.{key} = {value!r} must be of type {typ.__name__}")
    choices = fields[key].metadata.get("choices")
    if choices and value not in choices:
        raise BadInput(f"{source}: {section}.{key} = {value!r}; "
                       f"valid values: {', '.join(map(repr, choices))}")
    setattr(sec, key, value)


def read_toml(config_path):
    if not os.path.isfile(config_path):
        raise BadInput(f"--config {config_path}: no such file")
    try:
        with open(config_path, "rb") as fh:
            file_values = tomllib.load(fh)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        utf8 = ", TOML files are UTF-8" if isinstance(e, UnicodeDecodeError) else ""
        raise BadInput(f"--config {config_path}: not valid TOML{utf8} ({e})")
    for section, table in file_values.items():
        if not isinstance(table, dict):
            raise BadInput(f"{config_path}: top-level key {section!r} must be a table like [train]")
    return file_values


def parse_config(argv, cfg=None):
    """The config of a command line: cfg (by default Config()) set from the bundles (--preset, and
    those a seam's settings name, like --size), then the file, then the flags."""
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
    bundles = {("train", "preset"): PRESETS}
    bundles.update({(section, key): named for section, sec in sections(cfg).items()
                    for key, named in getattr(sec, "PRESETS", {}).items()})
    layers = []
    for (section, key), named in bundles.items():
        # a bundle's name itself follows command line > file > default
        name = cli.get(section, {}).get(key, file_values.get(section, {}).get(key, ""))
        if name and name not in named:
            where = "the command line" if key in cli.get(section, {}) else config_path
            raise BadInput(f"{flag_name(key)} {name!r} (from {where}); "
                           f"valid values: {', '.join(named)}")
        if name:
            layers.append((named[name], f"{key} {name}"))
    for values, where in layers + [(file_values, config_path), (cli, "command line")]:
        for section, table in values.items():
            for key, value in table.items():
                set_field(cfg, section, key, value, where)
    return cfg


def check_config(cfg):
    """Every check the settings allow on their own, before anything is set up or written."""
    for sec in sections(cfg).values():
        for f in dataclasses.fields(sec):
            flag, value, rule = flag_name(f.name), getattr(sec, f.name), f.metadata.get("valid", "")
            if isinstance(value, float) and not math.isfinite(value):  # inf passes "> 0", nan fails
                raise BadInput(f"{flag} {value}: must be a finite number {rule}".rstrip())
            if rule and not in_range(value, rule):
                raise BadInput(f"{flag} {value}: must be {rule}")
    t, c = cfg.train, cfg.checkpoint
    if c.async_save and c.checkpoint_type != "sharded":
        raise BadInput("--async-save needs --checkpoint-type sharded (a full checkpoint is one "
                       "file that rank 0 writes with torch.save)")
    if t.compile_mode == "reduce-overhead" and recomputes_compiled_blocks(cfg):
        raise BadInput("--compile-mode reduce-overhead with --activation-checkpointing and "
                       "--compile-scope blocks: CUDA graphs cannot record a block's recompute; use "
                       "--compile-mode default or --compile-scope model")
    if t.lr_schedule == "cosine" and t.lr_decay_steps and t.lr_decay_steps <= t.warmup_steps:
        raise BadInput(f"--lr-decay-steps {t.lr_decay_steps}: the cosine decay must end after the "
                       f"warmup (--warmup-steps {t.warmup_steps}); give a larger step, or 0 for "
                       "--max-steps")
    seam_hooks(cfg, "check")
    check_strategy(cfg)
    # This project's files and optional packages, imported only when asked for; every rank checks.
    for flag, wanted, modules in (
            ("--tensorboard", t.tensorboard, ["trackers", "torch.utils.tensorboard"]),
            ("--wandb", t.wandb, ["trackers", "wandb"]),
            ("--optimizer muon", t.optimizer == "muon", ["muon"]),
            ("--float8", cfg.fsdp.float8, ["float8", "torchao"]),
            ("--debug", t.debug, ["debugging"])):
        for module in modules if wanted else []:
            import_optional(module, flag)


COMPANIONS = ("trackers", "muon", "float8", "debugging", "ckpt_export", "hf_checkpoint")


def import_optional(module, flag):
    """A companion file or an optional package, imported for `flag` only. A module missing however
    deep the import that needs it, or a companion that is not this project's, is one line."""
    try:
        found = importlib.import_module(module)
    except ModuleNotFoundError as e:
        missing = (e.name or module).split(".")[0]
        what = f"the {missing} package, which is not installed: pip install {missing}"
        if missing == module and module in COMPANIONS:
            what = f"{module}.py beside train_fsdp.py (copy it from this project)"
        raise BadInput(f"{flag} needs {what}") from None
    except ImportError as e:  # there, but it does not import: a broken or mismatched install
        raise BadInput(f"{flag}: importing {module} failed ({e})") from None
    where = os.path.abspath(getattr(found, "__file__", None) or module)  # None: a namespace package
    beside = os.path.dirname(os.path.abspath(__file__))
    if module in COMPANIONS and os.path.dirname(where) != beside:
        raise BadInput(f"{flag} needs this project's {module}.py beside train_fsdp.py, not {where} "
                       "(another package of that name): copy it from this project")
    return found


def in_range(value, valid):
    """Whether value satisfies a rule such as ">= 1", "> 0", "in [0, 1]" or "in [0, 1)"."""
    op, bound = valid.split(" ", 1)
    if op in (">=", ">"):
        return value >= float(bound) if op == ">=" else value > float(bound)
    low, high = (float(b) for b in bound[1:-1].split(", "))
    return low <= value and (value <= high if bound.endswith("]") else value < high)


def seam_hooks(cfg, name, *args):
    """Call each section's hook `name` (check, resolve), if any; its ValueError is bad input."""
    for sec in sections(cfg).values():
        if hasattr(sec, name):
            try:
                getattr(sec, name)(*args)
            except ValueError as e:
                raise BadInput(str(e)) from None


def check_strategy(cfg, topo=None):
    """What each strategy accepts: with the settings alone, then again with the world and device."""
    t, f = cfg.train, cfg.fsdp
    cpu = topo and topo.device.type == "cpu"
    hybrid = topo and strategy_of(cfg).shards and "HYBRID" in f.sharding_strategy
    if hybrid and topo.world % hybrid_shard_size(cfg, topo):
        raise BadInput(f"--hybrid-shard-size {hybrid_shard_size(cfg, topo)} must divide the world "
                       f"size {topo.world}")
    if t.strategy == "fsdp2" and f.sharding_strategy == "NO_SHARD":
        raise BadInput("--sharding-strategy NO_SHARD has no FSDP2 form (it is replication): use "
                       "--strategy ddp")
    if t.strategy == "fsdp":
        if f.cpu_offload and t.grad_accum_mode == "sync":
            raise BadInput("--grad-accum-mode sync with --cpu-offload: FSDP overwrites instead of "
                           "accumulating offloaded gradients outside no_sync; use "
                           "--grad-accum-mode no_sync")
        if cpu and f.cpu_offload:
            raise BadInput("--cpu-offload needs a GPU: without one the parameters already live on "
                           "the CPU (and FSDP's pinned-memory offload cannot run)")
        if cpu and f.sync_module_states:
            raise BadInput("--sync-module-states needs a GPU: FSDP1 broadcasts only GPU tensors; "
                           "on CPU every rank already builds the same weights from --seed")
        if t.optimizer == "muon":
            raise BadInput("--optimizer muon orthogonalises whole matrices, which FSDP1 holds as "
                           "flat shards: use --strategy fsdp2 (or ddp, none)")
    if t.strategy == "none":
        if f.reduce_dtype == "fp16" and f.param_dtype != "fp16":
            raise BadInput("--reduce-dtype fp16 without --param-dtype fp16 has no meaning here")
        if topo and topo.world > 1:
            raise BadInput(f"--strategy none with {topo.world} processes would train {topo.world} "
                           "unsynchronised copies; use --strategy fsdp or ddp, or launch one "
                           "process")


def check_world(cfg, topo):
    """The checks that need the world size and the device: global batch = micro x world x accum."""
    batch, world = cfg.train.global_batch, topo.world
    check_strategy(cfg, topo)
    if batch < world:
        raise BadInput(f"--global-batch {batch} is smaller than the world size {world}; "
                       "every process needs at least one sequence per step")
    micro = cfg.train.micro_batch or batch // world
    if batch % (micro * world):
        raise BadInput(f"--global-batch {batch} is not divisible by micro-batch {micro} x world "
                       f"size {world}; choose a global batch that is a multiple of {micro * world}")


def resolve_config(cfg, topo, data):
    """What the settings leave open, filled in once the world and data are known; then only read."""
    t, f = cfg.train, cfg.fsdp
    # 1-process HYBRID_SHARD* shard groups go to DDP: FSDP1 would skip the replicas' all-reduce.
    replicas = "HYBRID" in f.sharding_strategy and hybrid_shard_size(cfg, topo) == 1
    if strategy_of(cfg).shards and replicas and topo.world > 1:
        say(topo, f"{f.sharding_strategy} with 1 process per shard group is pure replication: "
            "using DDP (--strategy ddp) across all processes")
        t.strategy = "ddp"
    strategy_of(cfg).resolve(cfg, topo)
    t.max_steps = t.max_steps or math.ceil(t.epochs * data.steps_per_epoch(t.global_batch))
    if t.lr_schedule == "wsd" and t.lr_decay_steps + t.warmup_steps > t.max_steps:
        raise BadInput(f"--lr-decay-steps {t.lr_decay_steps}: the wsd decay and --warmup-steps "
                       f"{t.warmup_steps} do not fit in the run's {t.max_steps} steps")
    seam_hooks(cfg, "resolve", data)
    return strategy_of(cfg)


if __name__ == "__main__":
    run()
