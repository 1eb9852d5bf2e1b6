"""FSDP1's sharded checkpoint state with cpu_offload (what a GPU run's saves use, see
the Checkpointer's sharded options) against the state dicts left where they are: the same DTensor
shards, the same optimizer state, and a checkpoint written from them that loads back exactly.
And why only a sharding FSDP1 is offloaded: its state dict is a copy of the weights and AdamW
state (no tensor shares storage with the model's or the optimizer's); FSDP2's is the tensors
themselves, and FSDP1 under NO_SHARD hands out the AdamW moments themselves.
Run with torchrun --nproc_per_node=2 (gloo, CPU): prints OK on rank 0."""
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy, fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_fsdp  # noqa: E402


def build(seed, backend="fsdp", sharding=ShardingStrategy.FULL_SHARD):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Linear(10, 3))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if backend == "fsdp2":
        for layer in net:
            fully_shard(layer, mesh=mesh)
        model = fully_shard(net, mesh=mesh)
    else:
        model = FSDP(net, device_mesh=mesh, use_orig_params=True, device_id=torch.device("cpu"),
                     sharding_strategy=sharding,
                     auto_wrap_policy=lambda module, recurse, **_: recurse or isinstance(module, torch.nn.Linear))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 6)).square().mean().backward()
    optimizer.step()
    return model, optimizer


def local(x):
    return x.to_local() if isinstance(x, DTensor) else x


def flat(state, prefix=""):
    """{dotted key: tensor} of a nested state dict."""
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        elif torch.is_tensor(v):
            out[f"{prefix}{k}"] = local(v)
    return out


def storage(t):
    return t.untyped_storage().data_ptr()  # the allocation, whatever the view's offset


def storages(model, optimizer):
    """The allocations of this rank's parameters and AdamW moments."""
    live = {storage(local(p)) for p in model.parameters()}
    live |= {storage(local(v)) for st in optimizer.state.values() for k, v in st.items() if k != "step"}
    return live


def shared_with_training(model, optimizer):
    """How many non-empty tensors of the sharded state share storage with the training state."""
    state = flat(train_fsdp.sharded_state(model, optimizer))
    live = storages(model, optimizer)
    return sum(storage(t) in live for k, t in state.items() if t.numel() and not k.endswith(".step"))


def main():
    dist.init_process_group("gloo")
    copy_model, copy_opt = build(0)
    same_model, same_opt = build(0, "fsdp2")
    assert shared_with_training(copy_model, copy_opt) == 0
    assert shared_with_training(same_model, same_opt) == 12, shared_with_training(same_model, same_opt)
    unsharded_model, unsharded_opt = build(0, sharding=ShardingStrategy.NO_SHARD)
    assert shared_with_training(unsharded_model, unsharded_opt) == 8  # the moments, not the weights
    model, optimizer = build(0)
    plain = flat(train_fsdp.sharded_state(model, optimizer))
    offloaded = flat(train_fsdp.sharded_state(model, optimizer, StateDictOptions(cpu_offload=True)))
    assert plain.keys() == offloaded.keys() and len(plain) >= 10, sorted(plain)
    for k in plain:
        assert torch.equal(plain[k], offloaded[k]), k
    path = sys.argv[1]
    dcp.save(train_fsdp.sharded_state(model, optimizer, StateDictOptions(cpu_offload=True)), checkpoint_id=path)
    other, other_opt = build(1)
    state = train_fsdp.sharded_state(other, other_opt)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(other, state["model"])
    set_optimizer_state_dict(other, other_opt, state["optim"])
    loaded = flat(train_fsdp.sharded_state(other, other_opt))
    for k in plain:
        assert torch.equal(plain[k], loaded[k]), k
    if dist.get_rank() == 0:
        print(f"OK {len(plain)} tensors")
    dist.destroy_process_group()
    train_fsdp.leave(0)  # not the interpreter's teardown: gloo's threads can abort it (see leave())


if __name__ == "__main__":
    main()
