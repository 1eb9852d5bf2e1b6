"""The gradient one optimizer step accumulates, against an fp32 reference, for every strategy and
--grad-accum-mode (tests/test_fsdp2.py runs it; FSDP1's no_sync accumulates in param_dtype).

Usage: torchrun --nproc_per_node=2 tests/grad_precision.py OUT.json MICRO_BATCHES

The model is two linear layers (a GELU between them; each layer an FSDP unit) on a regression
of random data: its bf16 forward and backward are accurate enough for the accumulation's
rounding to show. Every rank accumulates MICRO_BATCHES micro-batches in bf16 (reduce dtype
fp32) through the trainer's own train_step, wrap_model, the strategy's no_sync and precision_context;
the optimizer only reads the full gradient. `none` runs the whole global batch in each process.
The reference is the gradient of the same mean loss by the unwrapped model in fp32, in one pass.
Rank 0 writes {"strategy/mode": ||g - g_fp32|| / ||g_fp32||} and what each strategy's default
mode (auto) became.
"""
import dataclasses
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_fsdp  # noqa: E402

ARGS = ["--param-dtype", "bf16", "--reduce-dtype", "fp32", "--grad-clip", "0"]
CASES = [("none", "no_sync"), ("ddp", "no_sync"), ("ddp", "sync"), ("fsdp", "no_sync"), ("fsdp", "sync"),
         ("fsdp2", "no_sync"), ("fsdp2", "sync")]
WIDTH, HIDDEN, ROWS = 64, 256, 4  # ROWS per micro-batch


def build_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, WIDTH))


def mse(model, x, y, cfg):
    loss = (model(x).float() - y).pow(2).mean()
    return loss, {}


class GradientReader:
    """Stands in for the optimizer: step() keeps the full gradient of every parameter by name."""

    def __init__(self, model, strategy):
        self.model, self.strategy, self.param_groups, self.grads = model, strategy, [], None

    def step(self):
        if self.strategy == "fsdp":  # FSDP1 holds each rank's shard of a flattened gradient
            with FSDP.summon_full_params(self.model, with_grads=True):
                self.grads = {n: p.grad.float().clone() for n, p in train_fsdp.plain_named_parameters(self.model)}
            return
        self.grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).float().clone()
                      for n, p in train_fsdp.plain_named_parameters(self.model)}

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)


def relative_error(grads, ref):
    assert grads.keys() == ref.keys(), (sorted(grads), sorted(ref))
    diff = sum((grads[k] - ref[k]).pow(2).sum() for k in ref)
    return (diff / sum(ref[k].pow(2).sum() for k in ref)).sqrt().item()


def main():
    out_path, n_micro = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(world * n_micro * ROWS, WIDTH, generator=gen)
    y = torch.randn(world * n_micro * ROWS, WIDTH, generator=gen)

    ref_model = build_model()  # fp32, one pass over the whole global batch
    mse(ref_model, x, y, None)[0].backward()
    ref = {n: p.grad.clone() for n, p in ref_model.named_parameters()}

    errors, resolved = {}, {}
    for strategy, mode in CASES + [(s, "auto") for s in ("fsdp", "fsdp2", "ddp")]:
        cfg = train_fsdp.parse_config(ARGS + ["--strategy", strategy, "--grad-accum-mode", mode])
        train_fsdp.check_config(cfg)
        topo = train_fsdp.setup_distributed(cfg)
        if strategy == "none":
            topo = dataclasses.replace(topo, rank=0, world=1)
        train_fsdp.strategy_of(cfg).resolve(cfg, topo)
        if mode == "auto":
            resolved[strategy] = cfg.train.grad_accum_mode
            continue
        topo = dataclasses.replace(topo, mesh=train_fsdp.device_mesh(cfg, topo))
        model = train_fsdp.wrap_model(build_model(), {torch.nn.Linear}, set(), cfg, topo)
        reader = GradientReader(model, strategy)
        mine = range(topo.rank, len(x) // ROWS, topo.world)  # micro-batch m of rank r: rows of chunk m*world+r
        batches = [(x[i * ROWS:(i + 1) * ROWS], y[i * ROWS:(i + 1) * ROWS]) for i in mine]
        train_fsdp.train_step(model, reader, None, batches, cfg, mse, train_fsdp.strategy_of(cfg))
        errors[f"{strategy}/{mode}"] = relative_error(reader.grads, ref)
    if rank == 0:
        with open(out_path, "w") as fh:
            json.dump({"errors": errors, "resolved": resolved}, fh, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    train_fsdp.leave(0)


if __name__ == "__main__":
    main()
