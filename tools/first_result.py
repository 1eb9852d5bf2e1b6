"""Launch to a validation loss: the time a whole training command takes to reach validation marks.

    python tools/first_result.py OUT.json NAME=COMMAND [NAME=COMMAND ...]

Each COMMAND (a shell line) runs to its end, one after another, its output read line by line and
stamped with the seconds since its launch. Read from train_fsdp.py's lines (`step N | validation
... loss X | S s`, `start-up: ...`, `N ms/step`) or nanoGPT's (`step N: train loss X, val loss Y`,
`iter N: ... time Tms`): when step 10 was logged, when the validation loss first reached 1.50 and
1.47 (seconds and step), the best validation loss, the median step time after step 100, and for
train_fsdp.py the start-up line and each evaluation's own seconds. Prints a table, writes OUT.json.
"""
import json
import re
import statistics
import subprocess
import sys
import time

OURS_VAL = re.compile(r"^step\s+(\d+) \| validation .*?\bloss ([\d.]+) \| ([\d.]+) s")
NG_VAL = re.compile(r"^step (\d+): train loss [\d.]+, val loss ([\d.]+)")
STEP = re.compile(r"^step\s+(\d+) \|.*\| ([\d.]+) ms/step|^iter (\d+): .*time ([\d.]+)ms")
MARKS = (1.50, 1.47)


def measure(command):
    t0, r = time.perf_counter(), {"vals": [], "eval_s": [], "step_ms": [], "step10_s": None, "startup": ""}
    proc = subprocess.Popen(command, shell=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail = []
    for line in proc.stdout:
        now, tail = round(time.perf_counter() - t0, 2), (tail + [line])[-20:]
        if line.startswith("start-up:"):
            r["startup"] = line.strip()
        m = OURS_VAL.search(line) or NG_VAL.search(line)
        if m:
            r["vals"].append((int(m[1]), float(m[2]), now))
            if m.re is OURS_VAL:
                r["eval_s"].append(float(m[3]))
            continue
        m = STEP.search(line)
        if m:
            step, ms = (int(m[1]), float(m[2])) if m[1] else (int(m[3]), float(m[4]))
            if r["step10_s"] is None and step >= 10:
                r["step10_s"] = now
            if step > 100:
                r["step_ms"].append(ms)
    r["rc"], r["wall_s"] = proc.wait(), round(time.perf_counter() - t0, 2)
    r["tail"] = "".join(tail[-5:]) if r["rc"] else ""
    for mark in MARKS:
        hit = next(((step, s) for step, v, s in r["vals"] if v <= mark), (None, None))
        r[f"val<={mark}"] = {"step": hit[0], "s": hit[1]}
    r["best_val"] = min((v for _, v, _ in r["vals"]), default=None)
    r["step_ms"] = statistics.median(r["step_ms"]) if r["step_ms"] else None
    return r


def main():
    out, results = sys.argv[1], {}
    for spec in sys.argv[2:]:
        name, command = spec.split("=", 1)
        r = results[name] = {"command": command, **measure(command)}
        marks = " ".join(f"<={m}: {r[f'val<={m}']['s']} s (step {r[f'val<={m}']['step']})" for m in MARKS)
        evals = f" evals {r['eval_s'][:3]} s" if r["eval_s"] else ""
        print(f"{name:28s} rc {r['rc']} step {r['step_ms']} ms | step 10 at {r['step10_s']} s | {marks} | "
              f"best {r['best_val']} | wall {r['wall_s']} s{evals}\n    {r['startup']}{r['tail']}", flush=True)
        with open(out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
