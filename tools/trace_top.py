"""Where a profiled step's time goes, from a --profile Chrome trace (the run directory's
trace_rank0.json, steps 2-4). Per step: wall time (the ProfilerStep annotation), GPU busy time
(the union of kernel and memcpy intervals, so overlapping streams count once) and the share of
the wall the GPU was idle (host-bound when large). Then kernel time by kind (GEMM, attention,
collective, optimizer, Triton-generated, other) and the top FSDP annotations, CPU ops and kernels,
summed over the profiled steps (nested ops count in their parents too).
Usage: python tools/trace_top.py RUN_DIR [TOP]"""
import collections
import glob
import gzip
import json
import sys

KINDS = [("collective", ("nccl", "allgather", "reducescatter", "allreduce")),
         ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
         ("gemm", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas", "matmul")),
         ("optimizer", ("adam", "foreach", "multi_tensor")),
         ("triton (inductor)", ("triton_",))]


def kind(name):
    low = name.lower()
    return next((k for k, words in KINDS if any(w in low for w in words)), "other")


def busy(intervals):
    """Total length of the union of (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def main():
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 15
    path = sorted(glob.glob(sys.argv[1] + "/trace_rank*.json*"))[0]
    ev = json.load((gzip.open if path.endswith(".gz") else open)(path))["traceEvents"]
    gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    steps = [e for e in ev if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#")]
    print(f"== {path}")
    for s in sorted(steps, key=lambda e: e["ts"]):
        lo, hi = s["ts"], s["ts"] + s["dur"]
        inside = [(max(lo, e["ts"]), min(hi, e["ts"] + e["dur"])) for e in gpu
                  if e["ts"] < hi and e["ts"] + e["dur"] > lo]
        b = busy(inside)
        print(f"{s['name']}: wall {s['dur'] / 1000:8.2f} ms | GPU busy {b / 1000:8.2f} ms | "
              f"idle {100 * (1 - b / s['dur']):5.1f} % | {len(inside)} kernels")
    by_kind = collections.Counter()
    for e in gpu:
        by_kind[kind(e["name"])] += e["dur"]
    total = sum(by_kind.values())
    print("== kernel time by kind (ms over the profiled steps)")
    for k, d in by_kind.most_common():
        print(f"{d / 1000:9.2f}  {100 * d / total:5.1f} %  {k}")
    for cat in ("user_annotation", "cpu_op", "kernel"):
        tot = collections.Counter()
        for e in ev:
            if e.get("cat") == cat and "dur" in e:
                tot[e["name"][:100]] += e["dur"]
        print(f"== {cat} (ms over the profiled steps)")
        for name, d in tot.most_common(top):
            print(f"{d / 1000:9.2f}  {name}")


if __name__ == "__main__":
    main()
