"""Document masking, kernel by kernel: forward + backward of one attention layer at the Llama-3.2-1B
shape (32 query heads, 8 key/value heads of 64) on rows that pack documents, timed on one GPU.

    python tools/attention_mask_bench.py [--batch 8] [--seq 2048] [--doc-mean 620]

Candidates: SDPA with a dense boolean mask (model.document_layout's on the CPU, GQA by enable_gqa
or by repeating the key/value heads), FlexAttention (compiled, with a block mask made once a
forward, as model.document_block_masks does: timed apart), and SDPA causal without document
masking (flash: the floor, not a candidate). Documents are drawn with lengths uniform in
[1, 2 * doc-mean]. Prints one line per candidate: ms per layer, its ratio to causal, and the
largest difference of its output from the dense mask's; then the ms of one block mask. Last, the
model's own check: a small Free Transformer in fp32 on packed rows, its logits and gradients on
the GPU (FlexAttention, eager and compiled) against the CPU's (the dense mask).
"""
import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model as model_lib  # noqa: E402


def packed_positions(batch, seq, mean, gen):
    rows = []
    for _ in range(batch):
        pos, n = [], 0
        while n < seq:
            k = int(torch.randint(1, 2 * mean, (1,), generator=gen))
            pos += list(range(min(k, seq - n)))
            n += k
        rows.append(pos[:seq])
    return torch.tensor(rows)


def timed(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1000


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--doc-mean", type=int, default=620)
    a = p.parse_args()
    dev, B, T, H, KV, D = "cuda", a.batch, a.seq, 32, 8, 64
    gen = torch.Generator().manual_seed(0)
    positions = packed_positions(B, T, a.doc_mean, gen).to(dev)
    docs = torch.cumsum(positions == 0, dim=1)
    same = (docs[:, :, None] == docs[:, None, :]).unsqueeze(1)
    dense = same & torch.ones(T, T, dtype=torch.bool, device=dev).tril()
    q = torch.randn(B, H, T, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, KV, T, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, KV, T, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(B, H, T, D, device=dev, dtype=torch.bfloat16)
    flex = torch.compile(flex_attention)

    def doc_causal(b, h, qi, ki):
        return (qi >= ki) & (docs[b, qi] == docs[b, ki])

    def run(name):
        if name == "sdpa dense mask, enable_gqa":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
        if name == "sdpa dense mask, repeated kv":
            return F.scaled_dot_product_attention(q, k.repeat_interleave(H // KV, 1),
                                                  v.repeat_interleave(H // KV, 1), attn_mask=dense)
        if name == "flex block mask":
            return flex(q, k, v, block_mask=block_mask, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def make_mask():
        return create_block_mask(doc_causal, B, None, T, T, device=dev, _compile=True)

    block_mask = make_mask()
    reference = run("sdpa dense mask, enable_gqa").float()
    names = ["sdpa causal, no document mask (floor)", "sdpa dense mask, enable_gqa",
             "sdpa dense mask, repeated kv", "flex block mask"]
    floor = None
    print(f"B={B} T={T} heads {H}/{KV}x{D} bf16, {int((positions == 0).sum())} documents, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name in names:
        torch.cuda.reset_peak_memory_stats()
        ms = timed(lambda: run(name).backward(grad))
        floor = floor or ms
        diff = (run(name).float() - reference).abs().max().item()
        peak = torch.cuda.max_memory_allocated() / 2**30
        print(f"{name:40s} {ms:7.2f} ms fwd+bwd  x{ms / floor:4.2f}  peak {peak:5.2f} GiB  "
              f"max |out - dense| {diff:.3g}")
    print(f"{'making the block mask (once a forward)':40s} {timed(make_mask):7.2f} ms")
    model_check(packed_positions(2, 512, 100, gen))


def model_check(positions):
    """model.py's document masking on the GPU (FlexAttention) against the CPU (dense SDPA mask)."""
    cfg = model_lib.resolve_model_config(model_lib.ModelConfig(arch="free", vocab_size=256,
                                                               n_kv_head=2, latent_bits=4))
    torch.manual_seed(0)
    x = torch.randint(0, 256, positions.shape)
    z = torch.randint(0, 16, positions.shape)
    results = {}
    for device, compiled in (("cpu", False), ("cuda", False), ("cuda", True)):
        torch.manual_seed(0)
        m = model_lib.build_model(cfg).to(device)
        run = torch.compile(m) if compiled else m
        logits, _ = run(x.to(device), z=z.to(device), positions=positions.to(device))
        logits.float().square().mean().backward()
        grads = torch.cat([p.grad.flatten().cpu() for p in m.parameters() if p.grad is not None])
        results[(device, compiled)] = logits.detach().cpu(), grads
    ref_logits, ref_grads = results[("cpu", False)]
    for (device, compiled), (logits, grads) in results.items():
        if device == "cuda":
            print(f"model, fp32, {'compiled' if compiled else 'eager'} FlexAttention against the CPU's "
                  f"dense mask: logits max diff {(logits - ref_logits).abs().max():.2e}, gradients "
                  f"max diff {(grads - ref_grads).abs().max():.2e} (largest {ref_grads.abs().max():.2e})")


if __name__ == "__main__":
    main()
