"""Muon for train_fsdp.py's --optimizer muon: on the hidden matrices, Nesterov momentum made
orthogonal by Newton-Schulz; AdamW on the rest, in one optimizer. Under FSDP2 each rank
orthogonalises whole matrices, a share of them. train_fsdp.py imports it only for --optimizer muon:
copy it beside the trainer to use that flag in your repo."""

import math

import torch
from torch.distributed.tensor import DTensor, Shard

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class Muon(torch.optim.AdamW):
    """AdamW, but a group with "muon" (the dtype of Newton-Schulz) takes Nesterov momentum,
    orthogonalised and scaled to AdamW's update RMS (0.2 sqrt(max(rows, cols)), torch's
    match_rms_adamw). One optimizer keeps the schedule, the scaler and checkpoints as they are;
    torch.optim.Muon takes 2-D tensors only and would orthogonalise shards."""

    @torch.no_grad()
    def step(self, closure=None):
        for g in (g for g in self.param_groups if g.get("muon")):
            params = [p for p in g["params"] if p.grad is not None]
            lr, decay = g["lr"] * g["lr_ratio"], g["weight_decay"]
            keys = [(p.shape, getattr(p, "placements", None)) for p in params]
            for key in dict.fromkeys(keys):  # a shape's matrices: one batch of kernels
                batch = [p for p, k in zip(params, keys) if k == key]
                updates = orthogonalised([self.nesterov(p) for p in batch], DTYPES[g["muon"]])
                for p, update in zip(batch, updates):
                    scale = 0.2 * math.sqrt(max(p.shape))  # AdamW's update RMS
                    p.mul_(1 - lr * decay).add_(update, alpha=-lr * scale)
                    p.grad = None  # AdamW's step skips it
        return super().step(closure)

    def nesterov(self, p):
        state = self.state[p]
        if not state:  # a "step" as AdamW's, whose load_state_dict reads every parameter's
            state.update(step=torch.tensor(0.0), momentum_buffer=torch.zeros_like(p))
        state["step"] += 1
        momentum = state["momentum_buffer"].lerp_(p.grad, 0.05)
        return p.grad.lerp(momentum, 0.95)  # Nesterov momentum, 0.95


def hidden_matrices(model, wrap_classes):
    """Names of the parameters Muon orthogonalises: the model's muon_filter(name, p) if any, else
    the 2-D weights in the FSDP unit classes (blocks). Embeddings and head: AdamW."""
    if hasattr(model, "muon_filter"):
        return {n for n, p in model.named_parameters() if model.muon_filter(n, p)}
    blocks = [(name, m) for name, m in model.named_modules() if isinstance(m, tuple(wrap_classes))]
    return {f"{name}.{n}" for name, m in blocks for n, p in m.named_parameters() if p.dim() == 2}


def orthogonalised(updates, dtype, steps=5):
    """Newton-Schulz (Muon's quintic) on matrices of one shape, towards the nearest
    semi-orthogonal ones, returned in `dtype`. Under fsdp2 the row shards are traded (Shard(1) of
    the stack to Shard(0), an all-to-all), so each rank orthogonalises 1/world of the matrices
    whole, once, and trades the results back into row shards."""
    u, x = updates[0], torch.stack(updates).to(dtype)  # traded in `dtype`: half fp32's bytes
    if isinstance(u, DTensor):
        by_matrix = [Shard(0) if isinstance(p, Shard) else p for p in x.placements]
        x = x.redistribute(placements=by_matrix)
    y = x.to_local() if isinstance(x, DTensor) else x
    tall = x.size(1) > x.size(2)
    y = (y.mT if tall else y) / (y.norm(dim=(1, 2), keepdim=True) + 1e-7)  # Gram of the short side
    for _ in range(steps):  # y = a y + (b G + c G^2) y, G = y y^T, scalings fused into products
        gram = y @ y.mT
        y = torch.baddbmm(y, torch.baddbmm(gram, gram, gram, beta=-4.7750, alpha=2.0315), y,
                          beta=3.4445)
    y = y.mT if tall else y
    if not isinstance(u, DTensor):
        return y
    y = DTensor.from_local(y, x.device_mesh, x.placements, shape=x.shape, stride=x.stride())
    by_row = [Shard(1) if isinstance(p, Shard) else p for p in x.placements]
    y = y.redistribute(placements=by_row).to_local()
    return [DTensor.from_local(o, u.device_mesh, u.placements, shape=u.shape, stride=u.stride())
            for o in y]
