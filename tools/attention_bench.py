"""Exact causal attention at the 1b shape: forward + backward time and TFLOP/s of
SDPA's default choice, its built-in flash kernel and, when a provider package is importable,
the FA4 / FA3 kernels of PyTorch's flash-attention registry; each checked against fp32 math.
Usage: python tools/attention_bench.py [fa4 | fa3 ...]"""
import contextlib
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

B, H, KV, T, D = 12, 32, 8, 2048, 64  # the 1b model at micro-batch 12, sequence 2048
FLOPS = 3.5 * 4 * B * H * T * T * D / 2  # forward 4BHT^2D, halved by the causal mask; backward 2.5x


def attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def chosen(backend):
    """SDPA restricted to `backend`, or left to its own choice (None)."""
    return sdpa_kernel(backend) if backend else contextlib.nullcontext()


def inputs(b, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(b, h, T, D, device="cuda", dtype=dtype, generator=g).requires_grad_()
            for h in (H, KV, KV)]


def error(backend):
    """max over output and input gradients of |x - ref| / |ref| against fp32 math (batch 1)."""
    q, k, v = inputs(1, torch.bfloat16, 1)
    dout = torch.randn(1, H, T, D, device="cuda", dtype=torch.bfloat16)
    with chosen(backend):
        out = attention(q, k, v)
    got = [out, *torch.autograd.grad(out, (q, k, v), dout)]
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        ref = attention(q32, k32, v32)
    want = [ref, *torch.autograd.grad(ref, (q32, k32, v32), dout.float())]
    return max(((a.float() - b).norm() / b.norm()).item() for a, b in zip(got, want))


def time_ms(backend, reps=20):
    q, k, v = inputs(B, torch.bfloat16, 2)
    dout = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
    times = []
    for i in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with chosen(backend):
            out = attention(q, k, v)
        torch.autograd.grad(out, (q, k, v), dout)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def report(name, backend):
    try:
        err, ms = error(backend), time_ms(backend)
        print(f"{name:28s} {ms:7.2f} ms fwd+bwd  {FLOPS / ms / 1e9:6.0f} TFLOP/s  rel. error {err:.1e}", flush=True)
    except Exception as e:  # a kernel that refuses this shape says why, the others still run
        print(f"{name:28s} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)


def main():
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}; B {B} H {H} KV {KV} T {T} D {D} bf16 causal")
    report("SDPA default choice", None)
    report("cuDNN", SDPBackend.CUDNN_ATTENTION)
    report("flash (built in)", SDPBackend.FLASH_ATTENTION)
    for impl in sys.argv[1:]:
        try:
            torch.nn.attention.activate_flash_attention_impl(impl.upper())
        except Exception as e:
            print(f"{impl}: not activated: {type(e).__name__}: {str(e)[:300]}")
            continue
        report(f"flash ({impl.upper()})", SDPBackend.FLASH_ATTENTION)


if __name__ == "__main__":
    main()
