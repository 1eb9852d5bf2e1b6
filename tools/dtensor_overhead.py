"""Host time of FSDP2's DTensor bookkeeping outside the hooks (issue 15's small-model lead):
clip_grad_norm_ and a foreach AdamW step over 51 small parameters, as DTensors on a one-process
CPU mesh against plain tensors. Usage: python tools/dtensor_overhead.py"""
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one process: no port
mesh = init_device_mesh("cpu", (1,))
torch.manual_seed(0)
shapes = [(64, 64)] * 36 + [(64,)] * 13 + [(256, 64)] * 2  # ~ a 6-block model's 51 tensors, tiny
def make(dt):
    ps = []
    for s in shapes:
        t = torch.randn(s)
        p = torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)]) if dt else t)
        p.grad = distribute_tensor(torch.randn(s), mesh, [Shard(0)]) if dt else torch.randn(s)
        ps.append(p)
    return ps
for dt in (False, True):
    ps = make(dt)
    opt = torch.optim.AdamW(ps, lr=1e-3, foreach=True)
    cases = (("clip_grad_norm_", lambda: torch.nn.utils.clip_grad_norm_(ps, 1.0)), ("AdamW foreach step", opt.step))
    for name, fn in cases:
        for _ in range(5):
            fn()
        t0, n = time.perf_counter(), 50
        for _ in range(n):
            fn()
        print(f"{'DTensor' if dt else 'plain  '} {name}: {1000 * (time.perf_counter() - t0) / n:.2f} ms")
dist.destroy_process_group()
