"""Launch-to-first-step time and steady step time of whole training commands (tools/speed_gpu.sh runs it).

    python tools/startup_bench.py [--skip N] OUT.json NAME=COMMAND [NAME=COMMAND ...]

Each COMMAND (a shell line) runs to its end, one after another, with its output read line by
line. Start-up is the wall time from the launch to the end of the first training step: to the
first line that reports steps (train_fsdp.py's `step N |`, nanoGPT's `iter N:`), less the median
step time for each step of that line's log window after the first. Where the start-up goes: the
output lines before the first step, each with its time since launch, are kept in OUT.json
("timeline"), and those that came a second or more after the previous line are printed.
The step time is the median of the per-step times the command logs after its first N steps (20):
train_fsdp.py's `N ms/step` (the mean over its log window) or nanoGPT's `time N ms`, and the
median of train_fsdp.py's logged MFU over the same steps. Prints a table and writes OUT.json.
"""
import json
import re
import statistics
import subprocess
import sys
import time

STEP = re.compile(r"^step\s+(\d+) \|.*\| ([\d.]+) ms/step(?:.*mfu ([\d.]+)%)?|^iter (\d+): .*time ([\d.]+)ms")


def measure(command, skip):
    t0, first, first_step, times, timeline, mfus = time.perf_counter(), None, 0, [], [], []
    proc = subprocess.Popen(command, shell=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail = []
    for line in proc.stdout:
        tail = (tail + [line])[-20:]
        if first is None:
            timeline.append((round(time.perf_counter() - t0, 2), line.rstrip()[:160]))
        m = STEP.search(line)
        if m:
            step, ms = (int(m[1]) - 1, float(m[2])) if m[1] else (int(m[4]), float(m[5]))
            if first is None:
                first, first_step = time.perf_counter() - t0, step
            if step > skip:
                times.append(ms)
                if m[3]:
                    mfus.append(float(m[3]))
    code = proc.wait()
    median = statistics.median(times) if times else None
    if first is not None and median:
        first -= first_step * median / 1000  # the steps logged with the first (a log window) are not start-up
    return {"rc": code, "startup_s": first, "step_ms": median, "mfu_pct": statistics.median(mfus) if mfus else None,
            "steps_timed": len(times), "wall_s": time.perf_counter() - t0, "tail": "".join(tail[-5:]) if code else "",
            "timeline": timeline}


def main():
    args, skip = sys.argv[1:], 20
    if args[0] == "--skip":
        skip, args = int(args[1]), args[2:]
    out, results = args[0], {}
    for spec in args[1:]:
        name, command = spec.split("=", 1)
        results[name] = {"command": command, **measure(command, skip)}
        r = results[name]
        print(f"{name:40s} rc {r['rc']} start {r['startup_s'] or float('nan'):6.1f} s  step "
              f"{r['step_ms'] or float('nan'):7.2f} ms  ({r['steps_timed']} logged)  wall {r['wall_s']:.0f} s"
              + (f"  mfu {r['mfu_pct']:.1f}%" if r["mfu_pct"] else ""),
              flush=True)
        if r["rc"]:
            print(r["tail"], flush=True)
        before = 0.0
        for t, line in r["timeline"]:  # the slow gaps of the start-up
            if t - before >= 1.0:
                print(f"    {t:6.1f} s (+{t - before:4.1f}) {line}", flush=True)
            before = t
        with open(out, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
