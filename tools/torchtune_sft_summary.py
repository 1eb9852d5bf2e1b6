"""One-line summary of a torchtune run's metrics (TimedDiskLogger lines of tools/torchtune_sft_components.py):

    python3 tools/torchtune_sft_summary.py METRICS_TXT --batch B --seq S [--warmup 5] [--log RECIPE_LOG]

Lines look like `Step 7 | loss:11.7 lr:2e-05 tokens_per_second_per_gpu:51234.5 peak_memory_active:...
peak_memory_alloc:... peak_memory_reserved:... step_time_s:0.31`. Over the steps after --warmup:
median of torchtune's tokens_per_second_per_gpu (labelled tokens only: prompt and pad positions excluded),
median step time, positions/s = B*S / median step time (every position of the packed rows, pads included),
and, when the recipe's log has the jsonl_sft_dataset packing line, non-pad tokens/s = positions/s * the
packs' fill. Peak memory: the largest per-step peak (torchtune resets CUDA's peak counters at each log) of
allocated, reserved and active, GiB (2**30 bytes).
"""
import argparse
import re
import statistics


def parse(path):
    steps = []
    for line in open(path):
        m = re.match(r"Step (\d+) \| (.*)", line.strip())
        if not m:
            continue
        fields = dict(kv.split(":", 1) for kv in m.group(2).split())
        steps.append((int(m.group(1)), {k: float(v) for k, v in fields.items()}))
    return steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("metrics")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--log", default="")
    ap.add_argument("--name", default="torchtune")
    args = ap.parse_args()
    steps = parse(args.metrics)
    used = [f for s, f in steps if s > args.warmup] or [f for _, f in steps]
    if not used:
        print(f"{args.name}: no steps logged in {args.metrics}")
        return
    tps = statistics.median(f["tokens_per_second_per_gpu"] for f in used)
    dt = statistics.median(f["step_time_s"] for f in used)
    pos = args.batch * args.seq / dt
    fill = None
    if args.log:
        for line in open(args.log, errors="replace"):
            m = re.search(r"non-pad fraction ([0-9.]+)", line)
            if m:
                fill = float(m.group(1))
    peak = {k: max((f.get(k, 0.0) for _, f in steps), default=0.0)
            for k in ("peak_memory_alloc", "peak_memory_reserved", "peak_memory_active")}
    extra = f" non_pad_tokens_per_s={pos * fill:.0f} (fill {fill:.3f})" if fill is not None else ""
    print(f"{args.name}: steps={len(steps)} median_over_steps>{args.warmup}: "
          f"labelled_tokens_per_s={tps:.0f} step_time_s={dt:.4f} positions_per_s={pos:.0f}{extra} "
          f"batch={args.batch} seq={args.seq} final_loss={steps[-1][1].get('loss', float('nan')):.4f} "
          f"peak_alloc_gib={peak['peak_memory_alloc']:.2f} peak_reserved_gib={peak['peak_memory_reserved']:.2f} "
          f"peak_active_gib={peak['peak_memory_active']:.2f}")


if __name__ == "__main__":
    main()
