"""Top entries of a --profile Chrome trace (the run directory's trace_rank0.json): time
per FSDP annotation, CPU op and kernel name, summed over the profiled steps (nested ops count in
their parents too). Usage: python tools/trace_top.py RUN_DIR"""
import collections
import glob
import gzip
import json
import sys

for path in sorted(glob.glob(sys.argv[1] + "/trace_rank*.json"))[:1]:
    op = gzip.open if path.endswith(".gz") else open
    ev = json.load(op(path))["traceEvents"]
    for cat in ("user_annotation", "cpu_op", "kernel"):
        tot = collections.Counter()
        for e in ev:
            if e.get("cat") == cat and "dur" in e:
                tot[e["name"][:90]] += e["dur"]
        print(f"== {cat} (ms over 3 steps)")
        for name, d in tot.most_common(25 if cat != "kernel" else 8):
            print(f"{d / 1000:8.2f}  {name}")
        print(f"{sum(tot.values()) / 1000:8.2f}  total {cat}, {sum(e.get('cat') == cat for e in ev)} events")
