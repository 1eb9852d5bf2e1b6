"""FSDP2 (--strategy fsdp2) beside FSDP1, and the default accumulation mode (issue 15).

The equivalence of fsdp2 with one process (every sharding strategy, accumulation, activation
checkpointing, meta-init, tied embeddings, the Free Transformer) is in test_distributed.py,
its checkpoints across backends in test_checkpoint.py. Here: the accumulated gradient of every
strategy and mode against fp32 (tests/grad_precision.py), the order of activation
checkpointing, compile and sharding, and the settings fsdp2 refuses, resolves and names.
"""
import dataclasses
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
import script_runner  # noqa: E402

import model as model_lib  # noqa: E402
import train_fsdp  # noqa: E402
from test_distributed import clean_env, run_ranks  # noqa: E402

TOLERANCE = 0.005  # relative gradient error against fp32 that every strategy's default meets


def test_accumulated_gradient_against_fp32(tmp_path):
    """32 micro-batches per rank on 2 processes, bf16 parameters, fp32 reduction. FSDP1 under
    no_sync accumulates the unsharded gradients in bf16: about twice the error of syncing every
    micro-batch (0.75% vs 0.39% on torch 2.13). FSDP2's set_requires_gradient_sync(False)
    accumulates in reduce_dtype, DDP and one process in fp32: each meets the tolerance in both
    modes, and so does every strategy's default (auto: sync for FSDP1 and FSDP2, no_sync for DDP)."""
    out = tmp_path / "precision.json"
    for res in run_ranks(os.path.join("tests", "grad_precision.py"), [out, 32], 2):
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    result = json.loads(out.read_text())
    errors = result["errors"]
    assert result["resolved"] == {"fsdp": "sync", "fsdp2": "sync", "ddp": "no_sync"}
    assert errors["fsdp/no_sync"] > TOLERANCE, errors
    assert errors["fsdp/no_sync"] > 1.5 * errors["fsdp/sync"], errors
    assert all(e < TOLERANCE for k, e in errors.items() if k != "fsdp/no_sync"), errors
    # FSDP2's no_sync accumulates exactly as syncing every micro-batch does
    assert errors["fsdp2/no_sync"] == pytest.approx(errors["fsdp2/sync"], rel=1e-3)


# One process (gloo, in-memory store) builds and wraps the model as train_fsdp.main does, from
# the command line flags given to build(); the scripts below print what they found as JSON.
BUILD_PRELUDE = r"""
import dataclasses, json, sys
import torch, torch.distributed as dist
sys.path.insert(0, ".")
import model as model_lib, train_fsdp
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
def build(argv):
    cfg = train_fsdp.parse_config(argv)
    train_fsdp.check_config(cfg)
    topo = train_fsdp.setup_distributed(cfg)
    train_fsdp.strategy_of(cfg).resolve(cfg, topo)
    model_lib.resolve_model_config(cfg.model, 64)
    topo = dataclasses.replace(topo, mesh=train_fsdp.device_mesh(cfg, topo))
    model, wrap, ckpt = train_fsdp.build_model(cfg)
    return train_fsdp.wrap_model(model, wrap, ckpt, cfg, topo, model.init_module)
"""

WRAP_SCRIPT = BUILD_PRELUDE + r"""
import functools
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import checkpoint
model = build(sys.argv[1:])
compiled = torch._dynamo.eval_frame.OptimizedModule
def describe(m):
    inner = m._orig_mod if isinstance(m, compiled) else m
    return {"fsdp": isinstance(m, FSDPModule) or isinstance(inner, FSDPModule), "compiled": isinstance(m, compiled),
            "checkpointed": isinstance(inner.forward, functools.partial) and inner.forward.func is checkpoint}
print(json.dumps({"root": describe(model), "blocks": [describe(b) for b in model.blocks],
                  "latent": describe(model.latent)}))
"""


def run_build_script(script, argv):
    """Runs one of the scripts above with argv (`python -c`, forked by tests/script_runner.py); the JSON of its last
    line."""
    res = script_runner.run("-c", [script, *argv], ROOT, clean_env())
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_fsdp2_compiles_each_block_before_sharding_it():
    """--compile under fsdp2 (torchtitan's order): activation checkpointing, then torch.compile of each
    block, then fully_shard of the compiled block; the root is sharded, not compiled. (Built
    only: compilation itself happens at the first forward.)"""
    argv = ["--strategy", "fsdp2", "--auto-wrap", "module", "--compile", "--activation-checkpointing", "--ac-every",
            "2", "--arch", "free", "--latent-bits", "4", "--n-layer", "4", "--d-model", "32", "--n-head", "2"]
    built = run_build_script(WRAP_SCRIPT, argv)
    assert built["root"] == {"fsdp": True, "compiled": False, "checkpointed": False}
    assert built["blocks"] == [{"fsdp": True, "compiled": True, "checkpointed": i % 2 == 0} for i in range(4)]
    assert built["latent"] == {"fsdp": True, "compiled": False, "checkpointed": False}


@pytest.mark.parametrize("scope", ["model", "blocks"])
def test_fsdp2_compiles_a_model_of_one_unit_whole(scope):
    """fsdp2 with the root its only unit (--auto-wrap auto on a small model): no unit's hooks run
    between the blocks, so --compile compiles the sharded model whole (the hooks stay outside the
    graph, as under fsdp); --compile-scope blocks compiles each block in place instead."""
    argv = ["--strategy", "fsdp2", "--compile", "--compile-scope", scope, "--arch", "free", "--latent-bits", "4",
            "--n-layer", "4", "--d-model", "32", "--n-head", "2"]
    built = run_build_script(WRAP_SCRIPT, argv)
    whole = scope == "model"
    assert built["root"] == {"fsdp": True, "compiled": whole, "checkpointed": False}
    assert built["blocks"] == [{"fsdp": False, "compiled": not whole, "checkpointed": False}] * 4
    assert built["latent"] == {"fsdp": False, "compiled": False, "checkpointed": False}


IN_PLACE_SCRIPT = BUILD_PRELUDE + r"""
model = build(sys.argv[1:])
print(json.dumps({"wrapper compiled": isinstance(model, torch._dynamo.eval_frame.OptimizedModule),
                  "model's forward compiled": hasattr(model.module.forward, "_torchdynamo_orig_callable")}))
"""


def test_fsdp_compiles_the_model_in_place_inside_its_wrapper():
    """--compile under fsdp (FSDP1) compiles the model's forward in place, then wraps it: compiling the
    wrapper made dynamo trace FSDP1's own forward too (40 frames on CPU, 3 s of tracing a launch on a GPU)."""
    argv = ["--strategy", "fsdp", "--compile", "--arch", "baseline", "--n-layer", "2", "--d-model", "32",
            "--n-head", "2"]
    assert run_build_script(IN_PLACE_SCRIPT, argv) == {"wrapper compiled": False, "model's forward compiled": True}


UNITS_SCRIPT = BUILD_PRELUDE + r"""
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
model = build(sys.argv[1:])
print(json.dumps([n.replace("_fsdp_wrapped_module.", "") for n, m in model.named_modules()
                  if isinstance(m, (FSDPModule, FullyShardedDataParallel))]))
"""


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_float8_keeps_the_units_of_the_size_rule(strategy):
    """--float8 swaps the blocks' Linear layers for new ones before the units are chosen, so the size rule
    picks the new layers: the same units as without float8 (once they collapsed into the root's unit)."""
    pytest.importorskip("torchao", reason="pip install torchao (.ci/run does)")
    argv = ["--strategy", strategy, "--auto-wrap", "size", "--min-num-params", "2000", "--arch", "baseline",
            "--n-layer", "2", "--d-model", "32", "--n-head", "2"]
    plain = run_build_script(UNITS_SCRIPT, argv)
    assert len(plain) > 3 and "blocks.0.mlp.w1" in plain, plain  # Linear layers are units
    assert run_build_script(UNITS_SCRIPT, argv + ["--float8", "tensorwise"]) == plain


ROPE_SCRIPT = BUILD_PRELUDE + r"""
seen = {}
for strategy in ("fsdp", "fsdp2", "ddp", "none"):
    model = build(["--strategy", strategy, *sys.argv[1:]])
    inner = getattr(model, "module", model)  # DDP's module; FSDP1 and FSDP2 keep the attributes
    attns = {"first block": inner.blocks[0].attn, "last block": inner.blocks[-1].attn,
             "encoder": inner.latent.encoder.attn}
    for where, attn in attns.items():  # Attention(q_in, kv_in, cos, sin, ...): cos is args[2]
        attn.register_forward_pre_hook(lambda m, args, where=where: seen.__setitem__(f"{strategy} {where}",
                                                                                     str(args[2].dtype)))
    model(torch.randint(0, 64, (2, 16)))
print(json.dumps(seen))
"""


def test_rotary_tables_reach_attention_in_fp32_under_every_strategy():
    """bf16 parameters: the blocks and the encoder receive the rotary tables in fp32 (model.py
    keeps them so), under FSDP2 too, whose MixedPrecisionPolicy would cast every unit's floating
    inputs to param_dtype by default."""
    argv = ["--param-dtype", "bf16", "--arch", "free", "--latent-bits", "4", "--n-layer", "4", "--d-model", "32",
            "--n-head", "2", "--dataset", "random", "--tokenizer-vocab-size", "64", "--seq-len", "16"]
    seen = run_build_script(ROPE_SCRIPT, argv)
    assert len(seen) == 12 and set(seen.values()) == {"torch.float32"}, seen


def test_fsdp2_refuses_no_shard_pointing_to_ddp():
    cfg = train_fsdp.parse_config(["--strategy", "fsdp2", "--sharding-strategy", "NO_SHARD"])
    with pytest.raises(train_fsdp.BadInput, match="--strategy ddp") as e:
        train_fsdp.check_config(cfg)
    assert "NO_SHARD" in str(e.value) and "\n" not in str(e.value)


def topology(world=2):
    return train_fsdp.Topology(rank=1, world=world, local_world=world, device=torch.device("cpu"),
                               backend="gloo")  # rank 1: the strategy's resolve prints nothing


@pytest.mark.parametrize("argv,mode", [
    ([], "sync"), (["--strategy", "fsdp", "--cpu-offload"], "no_sync"), (["--strategy", "fsdp2"], "sync"),
    (["--strategy", "fsdp2", "--cpu-offload"], "sync"), (["--strategy", "ddp"], "no_sync"),
    (["--strategy", "none"], "no_sync"), (["--grad-accum-mode", "no_sync"], "no_sync"),
    (["--strategy", "fsdp2", "--grad-accum-mode", "no_sync"], "no_sync"),
])
def test_default_accumulation_mode_keeps_gradients_sharded(argv, mode):
    """auto: FSDP1 and FSDP2 reduce-scatter every micro-batch (sync), since no_sync would hold every
    gradient unsharded on every rank (FSDP1's, also in param_dtype), except FSDP1 with --cpu-offload,
    which allows no_sync only; DDP and one device hold the whole gradient anyway: no_sync, one
    reduction a step. An explicit mode is kept."""
    cfg = train_fsdp.parse_config(argv)
    assert cfg.train.grad_accum_mode == ("auto" if "--grad-accum-mode" not in argv else mode)
    train_fsdp.strategy_of(cfg).resolve(cfg, topology())
    assert cfg.train.grad_accum_mode == mode


def test_grad_accum_mode_help_states_the_cost_of_no_sync():
    """The help of --grad-accum-mode names what no_sync costs FSDP: unsharded gradients, FSDP1's in param_dtype."""
    field = next(f for f in train_fsdp.dataclasses.fields(train_fsdp.TrainConfig) if f.name == "grad_accum_mode")
    assert "unsharded" in field.metadata["help"] and "param_dtype" in field.metadata["help"]


def test_describe_fsdp2():
    cfg = train_fsdp.parse_config(["--strategy", "fsdp2", "--sharding-strategy", "SHARD_GRAD_OP"])
    headline, notes = train_fsdp.describe_strategy(cfg)
    assert headline.startswith("strategy fsdp2 SHARD_GRAD_OP (reshard_after_forward=False)") and notes == []
    headline, _ = train_fsdp.describe_strategy(train_fsdp.parse_config(["--strategy", "fsdp2"]))
    assert headline.startswith("strategy fsdp2 FULL_SHARD (reshard_after_forward=True except the root and last block)")
    headline, _ = train_fsdp.describe_strategy(train_fsdp.parse_config(["--strategy", "fsdp2", "--auto-wrap", "size"]))
    assert headline.startswith("strategy fsdp2 FULL_SHARD (reshard_after_forward=True except the root) wrap=size")
    headline, _ = train_fsdp.describe_strategy(train_fsdp.parse_config(["--strategy", "fsdp2"]), one=True)
    assert headline.startswith("strategy fsdp2 FULL_SHARD (reshard_after_forward=True except the root) wrap=auto")


@pytest.mark.parametrize("argv,backend,expected", [
    (["--strategy", "fsdp2", "--cpu-offload"], "nccl", "cuda:nccl,cpu:gloo"),
    (["--strategy", "fsdp2"], "nccl", "nccl"), (["--strategy", "fsdp", "--cpu-offload"], "nccl", "nccl"),
    (["--strategy", "fsdp2", "--cpu-offload"], "gloo", "gloo"),
])
def test_fsdp2_cpu_offload_adds_gloo_for_the_host_gradients(argv, backend, expected):
    """FSDP2 with --cpu-offload clips (and fp16 unscales) gradients that live on the host; the
    all-reduce of their norm needs a CPU backend in the default group besides NCCL. FSDP1 moves
    its norm to the GPU itself."""
    assert train_fsdp.group_backends(train_fsdp.parse_config(argv), backend) == expected


@pytest.mark.parametrize("sharding", ["FULL_SHARD", "HYBRID_SHARD"])
def test_fsdp2_on_one_process_keeps_parameters_gathered(sharding, capsys):
    """One process: FULL_SHARD / HYBRID_SHARD would reshard after forward only to gather the same
    parameters again in backward; fsdp2 takes SHARD_GRAD_OP there (said), as FSDP1 takes
    NO_SHARD. Two processes, --cpu-offload (resharding keeps the model in host memory) and FSDP1
    (its own rule) keep what was asked."""
    one = dataclasses.replace(topology(1), rank=0)
    cfg = train_fsdp.parse_config(["--strategy", "fsdp2", "--sharding-strategy", sharding])
    train_fsdp.strategy_of(cfg).resolve(cfg, one)
    assert cfg.fsdp.sharding_strategy == "SHARD_GRAD_OP"
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and sharding in out and "SHARD_GRAD_OP" in out
    for argv, world in ((["--strategy", "fsdp2"], 2), (["--strategy", "fsdp2", "--cpu-offload"], 1),
                        (["--strategy", "fsdp"], 1)):
        cfg = train_fsdp.parse_config([*argv, "--sharding-strategy", sharding])
        train_fsdp.strategy_of(cfg).resolve(cfg, topology(world))
        assert cfg.fsdp.sharding_strategy == sharding


@pytest.mark.parametrize("size,one", [("tiny", True), ("350m", False)])
def test_auto_wrap_makes_a_small_model_one_unit(size, one):
    """--auto-wrap auto (the default): under 100M parameters no unit but the root (per-block units
    cost host time and save little memory); from 100M on, the block classes (the module rule)."""
    cfg = train_fsdp.parse_config(["--size", size, "--arch", "baseline"])
    assert cfg.fsdp.auto_wrap == "auto"
    model_lib.resolve_model_config(cfg.model, 256)
    with torch.device("meta"):
        model, wrap, _ = train_fsdp.build_model(cfg)
    units = train_fsdp.units_of(model, train_fsdp.wrap_policy(model, wrap, cfg))
    blocks = [m for m in model.modules() if isinstance(m, tuple(wrap))]
    assert units == ([] if one else blocks) and blocks
    cfg.fsdp.auto_wrap = "module"
    assert train_fsdp.units_of(model, train_fsdp.wrap_policy(model, wrap, cfg)) == blocks



@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2", "ddp", "none"])
def test_compile_mode_auto_takes_cuda_graphs_under_100m_parameters(strategy):
    """--compile-mode auto (the default): CUDA graphs (reduce-overhead) under 100M parameters
    under every strategy, the default mode from 100M on; a mode that was set is kept."""
    cfg = train_fsdp.parse_config(["--strategy", strategy])
    assert cfg.train.compile_mode == "auto"
    assert train_fsdp.compile_mode(cfg, train_fsdp.ONE_UNIT_BELOW - 1) == "reduce-overhead"
    assert train_fsdp.compile_mode(cfg, train_fsdp.ONE_UNIT_BELOW) == "default"
    cfg = train_fsdp.parse_config(["--strategy", strategy, "--compile-mode", "default"])
    assert train_fsdp.compile_mode(cfg, 10) == "default"


@pytest.mark.parametrize("strategy", ["fsdp", "ddp", "none"])
def test_checkpointed_blocks_compiled_in_place_take_no_cuda_graphs(strategy):
    """Activation checkpointing around blocks compiled in place reruns their compiled forward in
    backward, which CUDA graph trees cannot record (the run died in its first backward on GPUs):
    --compile-mode auto takes the default mode there, and reduce-overhead asked for is refused."""
    argv = ["--strategy", strategy, "--compile", "--activation-checkpointing", "--compile-scope", "blocks"]
    assert train_fsdp.compile_mode(train_fsdp.parse_config(argv), 10) == "default"
    assert train_fsdp.compile_mode(train_fsdp.parse_config(argv[:-2]), 10) == "reduce-overhead"  # whole model
    fsdp2 = train_fsdp.parse_config(["--strategy", "fsdp2"] + argv[2:])  # compiles modules around the checkpoint
    assert train_fsdp.compile_mode(fsdp2, 10) == "reduce-overhead"
    with pytest.raises(train_fsdp.BadInput, match=r"--compile-mode reduce-overhead with --activation-checkpointing "
                                                  r"and --compile-scope blocks: CUDA graphs cannot record"):
        train_fsdp.check_config(train_fsdp.parse_config(argv + ["--compile-mode", "reduce-overhead"]))
