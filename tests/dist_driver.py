"""Runs several short trainings inside one process group (torchrun) or one process.

Usage: [torchrun --nproc_per_node=N] python tests/dist_driver.py RUNS.json
RUNS.json maps a run name to a list of train_fsdp.py arguments; each run writes its own
--out-dir. Starting torch once per process for many runs keeps the test suite fast.

With RECORD_COMMS=1 in the environment, every rank also writes OUT_DIR/comms_rank{r}.json: per
optimizer step, the gradient reductions it issued (FSDP's reduce-scatters and all-reduces, with
their dtypes; DDP's bucket all-reduces, counted by a comm hook that runs torch's averaging
allreduce_hook), the parameter all-gathers and the matrix FLOPs of Muon's Newton-Schulz
("newton_schulz_flops"). The wrappers only count: the tensors and the collectives are the same.
It also writes OUT_DIR/wrap_rank{r}.json at the end of the run: the FSDP units (name in the
unwrapped model, class of the sharded module), the tensor types of the model's state dict, FSDP2's
forward-prefetch pairs and the policies of its units.
"""
import collections
import functools
import json
import os
import re
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import muon  # noqa: E402
import train_fsdp  # noqa: E402

# The collectives FSDP1 and FSDP2 reduce gradients and gather parameters with
# (reduce_scatter_single and all_gather_single are torch 2.13's names).
COUNTED = ("reduce_scatter_single", "reduce_scatter_tensor", "reduce_scatter", "all_reduce", "all_gather_single",
           "all_gather_into_tensor")


class CommRecorder:
    """Counts collectives per optimizer step: {op: n} and {op: sorted dtypes}, one record per
    call of train_fsdp.train_step."""

    def __init__(self):
        self.current = collections.Counter()
        self.dtypes = collections.defaultdict(set)
        self.steps = []
        self.model = None

    def note(self, op, tensor):
        self.current[op] += 1
        if torch.is_tensor(tensor):
            self.dtypes[op].add(str(tensor.dtype).removeprefix("torch."))

    def install(self):
        for op in COUNTED:
            original = getattr(dist, op, None)
            if original is None:
                continue

            def counting(*args, _op=op, _original=original, **kwargs):
                # the input of a reduce-scatter is its second argument; all_reduce's its first
                tensor = args[1] if _op.startswith("reduce_scatter") and len(args) > 1 else (args[0] if args else None)
                self.note(_op, kwargs.get("input", tensor))
                return _original(*args, **kwargs)
            setattr(dist, op, functools.wraps(original)(counting))

        wrap_model, train_step, orthogonalised = train_fsdp.wrap_model, train_fsdp.train_step, muon.orthogonalised

        def counting_orthogonalised(*args, **kwargs):
            with FlopCounterMode(display=False) as flops:
                out = orthogonalised(*args, **kwargs)
            self.current["newton_schulz_flops"] += flops.get_total_flops()
            return out
        muon.orthogonalised = counting_orthogonalised

        def recording_wrap_model(*args, **kwargs):
            model = wrap_model(*args, **kwargs)
            self.model = model
            ddp = getattr(model, "_orig_mod", model)
            if isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
                from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

                def hook(state, bucket):
                    self.note("ddp_bucket_all_reduce", bucket.buffer())
                    return allreduce_hook(state, bucket)
                ddp.register_comm_hook(None, hook)
            return model

        def recording_train_step(*args, **kwargs):
            self.current.clear()
            self.dtypes.clear()
            out = train_step(*args, **kwargs)
            self.steps.append({"counts": dict(self.current),
                               "dtypes": {op: sorted(d) for op, d in self.dtypes.items()}})
            return out
        train_fsdp.wrap_model, train_fsdp.train_step = recording_wrap_model, recording_train_step

    def dump(self, argv, rank):
        out_dir = argv[argv.index("--out-dir") + 1]
        with open(os.path.join(out_dir, f"comms_rank{rank}.json"), "w") as fh:
            json.dump(self.steps, fh)
        with open(os.path.join(out_dir, f"wrap_rank{rank}.json"), "w") as fh:
            json.dump(wrap_record(self.model), fh)
        self.steps, self.model = [], None


def wrap_record(model):
    """FSDP units as [name, class of the sharded module], the types of the state dict's tensors,
    FSDP2's forward-prefetch pairs [unit, the unit it prefetches], the policies of its units
    [name, offload policy class, param_dtype, reduce_dtype], the names of the float8 Linear layers and the
    parameters' dtypes as stored."""
    model = getattr(model, "_orig_mod", model)
    model = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    names = {m: re.sub(r"(_orig_mod|_fsdp_wrapped_module)\.?", "", n).rstrip(".") for n, m in model.named_modules()}
    units, prefetch, policies = [], [], []
    for m, name in names.items():
        if isinstance(m, FSDP):
            units.append([name, type(m.module).__name__])
        elif isinstance(m, FSDPModule):
            units.append([name, type(m).__bases__[1].__name__])  # FSDP2 makes class FSDP<X>(FSDPModule, X)
    by_state = {m._get_fsdp_state(): name for m, name in names.items() if isinstance(m, FSDPModule)}
    for m, name in names.items():
        if isinstance(m, FSDPModule):
            prefetch += [[name, by_state[s]] for s in m._get_fsdp_state()._states_to_forward_prefetch]
            policies += [[name, type(g.offload_policy).__name__, str(g.mp_policy.param_dtype),
                          str(g.mp_policy.reduce_dtype)] for g in m._get_fsdp_state()._fsdp_param_groups]
    types = sorted({type(v).__name__ for v in get_model_state_dict(model).values()})
    float8 = [name for m, name in names.items() if type(m).__name__ == "Float8Linear"]
    dtypes = {name: str(p.dtype) for name, p in model.named_parameters()}  # the shards' (FSDP2), as stored
    return {"units": units, "state_dict": types, "forward_prefetch": prefetch, "fsdp2_policies": policies,
            "float8": float8, "dtypes": {re.sub(r"(_orig_mod|_fsdp_wrapped_module)\.", "", n): d for n, d in dtypes.items()}}


if __name__ == "__main__":
    with open(sys.argv[1]) as fh:
        runs = json.load(fh)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    recorder = None
    if os.environ.get("RECORD_COMMS") == "1":
        recorder = CommRecorder()
        recorder.install()
    for name, argv in runs.items():
        train_fsdp.main(argv)
        if recorder:
            recorder.dump(argv, int(os.environ.get("RANK", "0")))
    if dist.is_initialized():
        dist.destroy_process_group()
    train_fsdp.leave(0)  # see leave(): avoids a gloo teardown race at interpreter exit
