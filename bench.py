"""Benchmark harness: the real training step of train_fsdp.py over a matrix of settings.

    python bench.py --suite NAME [--only TEXT] [--memory-cap-gib N] [--timeout-s S]
    make bench SUITE=multi

Suites, one function each below with what it compares: single, small, multi, knobs, tune, free,
text, capacity, sweep, 8b and offload (the last three with --memory-cap-gib, to ask whether a
run fits a smaller card).

Every entry is a torchrun launch of train_fsdp.py on `--dataset random` (uniform tokens, so
loading costs nothing), with a metrics line every step. The first steps (allocator warm-up,
compilation) are dropped and the median of the rest is reported: step time, tokens/s per GPU,
MFU against the card's bf16 dense peak and against a measured bf16 GEMM rate, peak allocated and
reserved memory per GPU (max over ranks) and the share of the step spent fetching batches.
Results go to OUT/bench_SUITE.json and OUT/bench_SUITE.md.

--memory-cap-gib N caps every process's CUDA caching allocator at N GiB
(torch.cuda.set_per_process_memory_fraction), so a larger card answers whether a run fits a
smaller one: a run over the cap fails with out-of-memory.

The text suite reads bench_data/corpus.txt: if absent it is built from the Python standard
library's .py files, and the trainer trains its BPE tokenizer on it once.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import sysconfig
import time

import torch

import train_fsdp

WARMUP = 4
BASE = ["--dataset", "random", "--tokenizer-vocab-size", "32000", "--seq-len", "2048", "--log-every", "1",
        "--eval-every", "0", "--eval-samples", "8", "--no-save-final", "--warmup-steps", "2", "--lr", "3e-4",
        "--overwrite"]
ONE_B = ["--size", "1b", "--arch", "baseline", "--meta-init", "--no-tie-embeddings"]
CORPUS = os.path.join("bench_data", "corpus.txt")
CORPUS_BYTES = 12 << 20


FSDP2 = ["--strategy", "fsdp2"]
# A small model (6 x 384 with a 256-token vocabulary), sequence 256, compiled, micro-batch 16 per
# GPU: a step short enough that FSDP's fixed costs per unit show.
SMALL = ["--arch", "baseline", "--n-layer", "6", "--d-model", "384", "--n-head", "6", "--seq-len", "256",
         "--tokenizer-vocab-size", "256", "--compile"]
# The whole model as one FSDP unit (the size rule with a threshold above the model's size): one
# gather and one reduce-scatter a step instead of one per block.
ONE_UNIT = ["--auto-wrap", "size", "--min-num-params", "100000000"]
SHARD_GRAD_OP = ["--sharding-strategy", "SHARD_GRAD_OP"]
HYBRID_2X2 = ["--sharding-strategy", "HYBRID_SHARD", "--hybrid-shard-size", "2"]


def width_4096(n_layer):
    """The 8b preset's width (4096, 32 heads, 8 KV heads, SwiGLU 14336) at another depth."""
    return ["--size", "8b", "--arch", "baseline", "--n-layer", str(n_layer)]


def batch(micro, n_gpu):
    """--micro-batch micro on each of n_gpu processes, no gradient accumulation."""
    return ["--micro-batch", str(micro), "--global-batch", str(micro * n_gpu)]


# Each suite: ngpu -> [(entry name, processes, extra flags, steps[, warmup]), ...]

def single(ngpu):
    """One GPU: the 1b baseline and Free Transformer, eager and compiled."""
    one = ONE_B + batch(8, 1)
    return [("1b baseline eager", 1, one, 12),
            ("1b free eager", 1, one + ["--arch", "free"], 12),
            ("1b baseline compile", 1, one + ["--compile"], 14),
            ("1b baseline compile fsdp2", 1, one + ["--compile"] + FSDP2, 14),
            ("1b free compile", 1, one + ["--arch", "free", "--compile"], 14),
            ("1b free compile fsdp2", 1, one + ["--arch", "free", "--compile"] + FSDP2, 14)]


def small(ngpu):
    """The same small step under each strategy: FSDP's per-unit overhead against one device and DDP."""
    one, many = SMALL + batch(16, 1), SMALL + batch(16, ngpu)
    return [("small none 1 GPU", 1, one + ["--strategy", "none"], 40, 10),
            ("small fsdp 1 GPU", 1, one, 40, 10),
            ("small fsdp2 1 GPU", 1, one + FSDP2, 40, 10),
            ("small fsdp one unit 1 GPU", 1, one + ONE_UNIT, 40, 10),
            ("small fsdp2 one unit 1 GPU", 1, one + FSDP2 + ONE_UNIT, 40, 10),
            ("small ddp", ngpu, many + ["--strategy", "ddp"], 40, 10),
            ("small fsdp", ngpu, many, 40, 10),
            ("small fsdp2", ngpu, many + FSDP2, 40, 10),
            ("small fsdp one unit", ngpu, many + ONE_UNIT, 40, 10),
            ("small fsdp2 one unit", ngpu, many + FSDP2 + ONE_UNIT, 40, 10),
            ("small fsdp2 SHARD_GRAD_OP", ngpu, many + FSDP2 + SHARD_GRAD_OP, 40, 10)]


def multi(ngpu):
    """All GPUs of the node: sharding strategies, prefetch, activation checkpointing, accumulation."""
    each = ONE_B + batch(8, ngpu)
    accum = ONE_B + ["--micro-batch", "4", "--global-batch", str(8 * ngpu)]
    return [("1 GPU FULL_SHARD", 1, ONE_B + batch(8, 1), 10),
            ("FULL_SHARD", ngpu, each, 10),
            ("SHARD_GRAD_OP", ngpu, each + SHARD_GRAD_OP, 10),
            ("NO_SHARD", ngpu, each + ["--sharding-strategy", "NO_SHARD"], 10),
            ("HYBRID_SHARD 2x2", ngpu, each + HYBRID_2X2, 10),
            ("DDP", ngpu, [a for a in each if a != "--meta-init"] + ["--strategy", "ddp"], 10),
            ("BACKWARD_POST", ngpu, each + ["--backward-prefetch", "BACKWARD_POST"], 10),
            ("prefetch NONE", ngpu, each + ["--backward-prefetch", "NONE"], 10),
            ("AC every block", ngpu, each + ["--activation-checkpointing"], 10),
            ("AC every 2nd block", ngpu, each + ["--activation-checkpointing", "--ac-every", "2"], 10),
            ("accum 2 no_sync", ngpu, accum + ["--grad-accum-mode", "no_sync"], 10),
            ("accum 2 sync", ngpu, accum + ["--grad-accum-mode", "sync"], 10),
            ("fsdp2 FULL_SHARD", ngpu, each + FSDP2, 10),
            ("fsdp2 SHARD_GRAD_OP", ngpu, each + FSDP2 + SHARD_GRAD_OP, 10),
            ("fsdp2 HYBRID_SHARD 2x2", ngpu, each + FSDP2 + HYBRID_2X2, 10),
            ("fsdp2 accum 2 no_sync", ngpu, accum + FSDP2, 10)]


def tune(ngpu):
    """One GPU: the compiled 1b at micro-batch 8, 12 and 16, under fsdp and fsdp2."""
    def micro(n):
        return ONE_B + batch(n, 1) + ["--compile"]
    # On one process fsdp2 runs FULL_SHARD as SHARD_GRAD_OP (the trainer resolves it so): the
    # SHARD_GRAD_OP entries repeat the plain fsdp2 ones there, a second reading.
    return [("1b baseline compile", 1, micro(8), 14),
            ("1b baseline compile micro 12", 1, micro(12), 14),
            ("1b baseline compile micro 16", 1, micro(16), 14),
            ("1b free compile", 1, micro(8) + ["--arch", "free"], 14),
            ("1b baseline compile fsdp2", 1, micro(8) + FSDP2, 14),
            ("1b baseline compile fsdp2 SHARD_GRAD_OP", 1, micro(8) + FSDP2 + SHARD_GRAD_OP, 14),
            ("1b baseline compile micro 12 fsdp2", 1, micro(12) + FSDP2, 14),
            ("1b baseline compile micro 16 fsdp2", 1, micro(16) + FSDP2, 14),
            ("1b baseline compile micro 12 fsdp2 SHARD_GRAD_OP", 1, micro(12) + FSDP2 + SHARD_GRAD_OP, 14),
            ("1b baseline compile micro 12 fsdp2 one unit", 1, micro(12) + FSDP2 + ONE_UNIT, 14),
            ("1b free compile fsdp2", 1, micro(8) + ["--arch", "free"] + FSDP2, 14)]


def knobs(ngpu):
    """FSDP's optional knobs: forward prefetch, limit_all_gathers off, CPU offload."""
    each = ONE_B + batch(8, ngpu)
    return [("forward_prefetch", ngpu, each + ["--forward-prefetch"], 10),
            ("no limit_all_gathers", ngpu, each + ["--no-limit-all-gathers"], 10),
            ("CPU offload", ngpu, each + ["--cpu-offload"], 7),
            ("fsdp2 forward_prefetch", ngpu, each + FSDP2 + ["--forward-prefetch"], 10),
            ("fsdp2 CPU offload", ngpu, each + FSDP2 + ["--cpu-offload"], 7)]


def free(ngpu):
    """One GPU: the Free Transformer against the baseline at 1b (16 layers) and 1.5b (24)."""
    one = batch(8, 1) + ["--compile"]
    big = ["--size", "1.5b", "--arch", "baseline", "--meta-init", "--no-tie-embeddings"]
    return [("1b baseline compile", 1, ONE_B + one, 14),
            ("1b free compile", 1, ONE_B + one + ["--arch", "free"], 14),
            ("1.5b baseline compile", 1, big + one, 14),
            ("1.5b free compile", 1, big + one + ["--arch", "free"], 14)]


def text(ngpu):
    """One GPU: the data loader's share of the step on packed text against random tokens."""
    one = ONE_B + batch(8, 1) + ["--compile"]
    corpus = ["--dataset", CORPUS, "--tokenizer-vocab-size", "32000", "--cache-dir", "bench_data/cache"]
    return [("1b compile, random tokens", 1, one, 14),
            ("1b compile, packed text", 1, one + corpus, 14)]


def capacity(ngpu):
    """1.5b and 8b: FULL_SHARD with activation checkpointing against DDP."""
    runs = []
    for size in ("1.5b", "8b"):
        model = ["--size", size, "--arch", "baseline"] + batch(2, ngpu)
        runs.append((f"{size} FULL_SHARD+AC", ngpu, model + ["--meta-init", "--activation-checkpointing"], 7))
        runs.append((f"{size} DDP", ngpu, model + ["--strategy", "ddp"], 7))
    free_8b = ["--size", "8b", "--arch", "free", "--meta-init", "--activation-checkpointing"] + batch(2, ngpu)
    return runs + [("8b free FULL_SHARD+AC", ngpu, free_8b, 7),
                   ("8b free FULL_SHARD+AC fsdp2", ngpu, free_8b + FSDP2, 7)]


def sweep(ngpu):
    """Width 4096 at growing depth, activation checkpointing for both, so the difference is the
    sharding alone: the deepest model DDP fits against the deepest FULL_SHARD fits."""
    each = batch(2, ngpu) + ["--activation-checkpointing"]
    return ([(f"DDP+AC {n} layers", ngpu, width_4096(n) + each + ["--strategy", "ddp"], 6) for n in (16, 18, 20)]
            + [(f"FULL_SHARD+AC {n} layers", ngpu, width_4096(n) + each + ["--meta-init"], 6) for n in (76, 80, 84)]
            + [(f"fsdp2 FULL_SHARD+AC {n} layers", ngpu, width_4096(n) + each + ["--meta-init"] + FSDP2, 6)
               for n in (76, 80, 84)])


def eight_b(ngpu):
    """The 8b shapes, compiled, for MFU under fsdp and fsdp2."""
    model = ["--size", "8b", "--meta-init", "--compile"] + batch(2, ngpu)
    micro4 = ["--arch", "free"] + batch(4, ngpu) + ["--activation-checkpointing", "--ac-every", "2"]
    return [("8b baseline compile", ngpu, model + ["--arch", "baseline"], 10),
            ("8b free compile", ngpu, model + ["--arch", "free"], 10),
            ("8b free compile micro 4 AC every 2nd", ngpu, model + micro4, 10),
            ("8b baseline compile fsdp2", ngpu, model + ["--arch", "baseline"] + FSDP2, 10),
            ("8b free compile fsdp2", ngpu, model + ["--arch", "free"] + FSDP2, 10),
            ("8b free compile micro 4 AC every 2nd fsdp2", ngpu, model + micro4 + FSDP2, 10)]


def offload(ngpu):
    """Past the GPU-only limit of the sweep: parameters, gradients and AdamW state on the host.
    The optimizer then runs on the CPU and a step is slow: 4 steps, the median of the last 2."""
    flags = batch(2, ngpu) + ["--activation-checkpointing", "--meta-init", "--cpu-offload"]
    return [("CPU offload+AC 96 layers", ngpu, width_4096(96) + flags, 4, 2)]


SUITES = {"single": single, "small": small, "multi": multi, "knobs": knobs, "tune": tune, "free": free,
          "text": text, "capacity": capacity, "sweep": sweep, "8b": eight_b, "offload": offload}


def suite(name, ngpu):
    """(entry name, processes, extra flags, steps[, warmup]) for each run of a suite."""
    if name not in SUITES:
        raise SystemExit(f"--suite {name}: valid suites are {', '.join(SUITES)}")
    return SUITES[name](ngpu)


def gemm_tflops():
    """Measured bf16 rate of an 8192^3 matrix product (TFLOP/s), the practical ceiling."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    return 20 * 2 * 8192 ** 3 / (time.perf_counter() - t0) / 1e12


def build_corpus():
    """bench_data/corpus.txt: the standard library's .py files in sorted order, up to CORPUS_BYTES."""
    if os.path.exists(CORPUS):
        return
    os.makedirs(os.path.dirname(CORPUS), exist_ok=True)
    stdlib, size = sysconfig.get_paths()["stdlib"], 0
    with open(CORPUS + ".tmp", "w") as out:
        for root, dirs, files in sorted(os.walk(stdlib)):
            dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "test", "__pycache__"))
            for f in sorted(files):
                if f.endswith(".py") and size < CORPUS_BYTES:
                    with open(os.path.join(root, f), errors="replace") as fh:
                        size += out.write(fh.read())
    os.replace(CORPUS + ".tmp", CORPUS)


def run_entry(entry, args, peak_tflops, gemm):
    """One suite entry (name, processes, flags, steps[, warmup]) under the command line's --out,
    --memory-cap-gib and --timeout-s; returns its row of the table."""
    name, nproc, flags, steps, *rest = entry
    warmup, timeout_s = rest[0] if rest else WARMUP, args.timeout_s
    run_dir = os.path.join(args.out, name.replace(" ", "_").replace("+", "_").replace(",", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "bench.py", "--train", *BASE, *flags, "--max-steps", str(steps), "--out-dir", run_dir]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "BENCH_MEMORY_CAP_GIB": str(args.memory_cap_gib)})
    try:
        output, _ = proc.communicate(timeout=timeout_s or None)
    except subprocess.TimeoutExpired:
        # SIGTERM to torchrun, which stops its workers (they run in sessions of their own, so
        # killing torchrun's group alone leaves them training on the GPUs); SIGKILL if it hangs.
        proc.terminate()
        try:
            output = proc.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            try:
                output = proc.communicate(timeout=10)[0]
            except subprocess.TimeoutExpired:  # a worker outlived torchrun and holds the pipe
                output = "bench.py: output lost, a worker outlived torchrun"
        output += f"\nbench.py: stopped after --timeout-s {timeout_s}\n"
    row = {"name": name, "gpus": nproc, "flags": " ".join(flags), "wall_s": round(time.perf_counter() - t0, 1)}
    with open(run_dir + ".log", "w") as fh:
        fh.write(output)
    if proc.returncode != 0:
        tail = output.strip().splitlines()
        oom = any("out of memory" in line.lower() for line in tail)
        return {**row, "error": "OOM" if oom else (tail[-1][:200] if tail else f"exit {proc.returncode}")}
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        recs = [r for r in map(json.loads, fh) if "loss" in r][warmup:]
    # The trainer's own per-step figures (its flop count and its table of card peaks).
    step = statistics.median(r["step_time_s"] for r in recs)
    mfu = statistics.median(r["mfu"] for r in recs)
    return {**row, "step_ms": round(1000 * step, 1),
            "tokens_per_s_per_gpu": round(statistics.median(r["tokens_per_s"] for r in recs) / nproc),
            "mfu": round(mfu, 4), "mfu_of_gemm": round(mfu * peak_tflops / gemm, 4),
            "peak_alloc_gib": round(max(r["mem_peak_gib"] for r in recs), 2),
            "reserved_gib": round(max(r["mem_reserved_gib"] for r in recs), 2),
            "data_fraction": round(statistics.median(r["data_fraction"] for r in recs), 5),
            "loss_last": round(recs[-1]["loss"], 4)}


def markdown(rows, header):
    lines = [header, "", "| run | GPUs | step ms | tokens/s/GPU | MFU (peak) | MFU (GEMM) | peak alloc GiB | "
             "reserved GiB | data % |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | {r['gpus']} | {r['error']} | | | | | | |")
        else:
            lines.append(f"| {r['name']} | {r['gpus']} | {r['step_ms']} | {r['tokens_per_s_per_gpu']:,} | "
                         f"{100 * r['mfu']:.1f}% | {100 * r['mfu_of_gemm']:.1f}% | {r['peak_alloc_gib']} | "
                         f"{r['reserved_gib']} | {100 * r['data_fraction']:.2f} |")
    return "\n".join(lines)


def build_arg_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--suite", default="single", help=f"one of {', '.join(SUITES)}")
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"), help="where results and logs go")
    p.add_argument("--only", default="", help="run only entries whose name contains this")
    p.add_argument("--memory-cap-gib", type=float, default=0, help="limit each process to this much GPU memory "
                   "(a smaller card's usable memory); 0 = the whole card")
    p.add_argument("--timeout-s", type=float, default=0, help="stop an entry that runs longer than this "
                   "(torchrun and its workers; recorded as an error); 0 = no limit")
    return p


def main():
    args = build_arg_parser().parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.py measures GPUs; no CUDA device here")
    os.makedirs(args.out, exist_ok=True)
    ngpu = torch.cuda.device_count()
    card = torch.cuda.get_device_name(0)
    gemm = gemm_tflops()
    peak = train_fsdp.peak_flops(torch.device("cuda", 0))
    if peak is None:
        raise SystemExit(f"no bf16 peak known for {card}: add it to train_fsdp.PEAK_BF16_FLOPS")
    header = (f"{args.suite} suite, {ngpu} x {card}, torch {torch.__version__}, measured bf16 GEMM "
              f"{gemm:.0f} TFLOP/s, {time.strftime('%Y-%m-%d')}, sequence 2048, vocabulary 32000"
              + (f", memory capped at {args.memory_cap_gib:g} GiB per GPU" if args.memory_cap_gib else ""))
    if args.suite == "text":
        build_corpus()
    print(header, flush=True)
    rows = []
    for entry in suite(args.suite, ngpu):
        if args.only and args.only not in entry[0]:
            continue
        rows.append(run_entry(entry, args, peak / 1e12, gemm))
        print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(args.out, f"bench_{args.suite}.json"), "w") as fh:
        json.dump({"header": header, "rows": rows}, fh, indent=1)
    table = markdown(rows, header)
    with open(os.path.join(args.out, f"bench_{args.suite}.md"), "w") as fh:
        fh.write(table + "\n")
    print(table)


def train_under_cap():
    """`bench.py --train ARGS`: one torchrun worker, the trainer itself, with the allocator capped."""
    cap = float(os.environ.get("BENCH_MEMORY_CAP_GIB") or 0)
    if cap:
        device = int(os.environ.get("LOCAL_RANK", 0))
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap * 2 ** 30 / total), device)
    sys.argv = ["train_fsdp.py"] + sys.argv[2:]
    train_fsdp.run()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--train"]:
        train_under_cap()
    else:
        main()
