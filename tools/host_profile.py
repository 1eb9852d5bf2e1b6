"""Where a host-bound step's CPU time goes: cProfile of one rank of a train_fsdp.py run
over steps FROM..TO-1 only (compilation and warm-up left out), then the per-step milliseconds of
the whole loop and of the optimizer step, and the functions that cost the most in their own time.
FROM 0 profiles from the launch (imports included) to the start of step TO instead, and lists the
functions by cumulative time: where the start-up goes. cProfile itself slows Python-heavy code,
so compare strategies with each other, not with an unprofiled step time.
    torchrun ... tools/host_profile.py [--steps FROM:TO] [--rank R] [--top N] -- train_fsdp.py ARGS
Prints on rank R (0) only."""
import cProfile
import io
import os
import pstats
import sys

# Under Python 3.12 on the GPU machine, functions that dynamo's frame hook runs (train_step, the
# forward) were missing from the stats; these were not.
PARTS = [("optimizer.step", "optimizer.py", "wrapper"), ("zero_grad", "optimizer.py", "zero_grad")]


def main():
    i = sys.argv.index("--")
    opts, rest = sys.argv[1:i], sys.argv[i + 1:]
    first, last = map(int, (opts[opts.index("--steps") + 1] if "--steps" in opts else "100:250").split(":"))
    rank = int(opts[opts.index("--rank") + 1]) if "--rank" in opts else 0
    top = int(opts[opts.index("--top") + 1]) if "--top" in opts else 25
    sys.argv = rest
    sys.path.insert(0, os.path.dirname(os.path.abspath(rest[0])))
    profiler, calls = cProfile.Profile(), [0]
    if first == 0:
        profiler.enable()
    import train_fsdp
    fetch, leave = train_fsdp.micro_batches, train_fsdp.leave

    def micro_batches(*a, **k):  # called at the start of every step: call s + 1 begins step s
        calls[0] += 1
        if calls[0] == first + 1 and first > 0:
            profiler.enable()
        elif calls[0] == last + 1:
            profiler.disable()
        return fetch(*a, **k)

    def report(code):
        profiler.disable()
        if int(os.environ.get("RANK", "0")) == rank and calls[0] > last:
            steps = last - first
            stats = pstats.Stats(profiler, stream=io.StringIO())
            if first == 0:
                print(f"host_profile: rank {rank}, launch to the start of step {last} (0-based): "
                      f"{stats.total_tt:.1f} s")
            else:
                print(f"host_profile: rank {rank}, steps {first}-{last - 1} ({steps}), ms per step under cProfile")
                for name, file, func in PARTS:
                    ms = sum(v[3] for k, v in stats.stats.items() if k[0].endswith(file) and k[2] == func)
                    print(f"  {name:<26} {1000 * ms / steps:8.2f}")
                print(f"  {'whole loop':<26} {1000 * stats.total_tt / steps:8.2f}")
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("cumulative" if first == 0 else "tottime").print_stats(top)
            print("\n".join(line[:160] for line in out.getvalue().splitlines() if line.strip())[-12000:])
        leave(code)

    train_fsdp.micro_batches, train_fsdp.leave = micro_batches, report
    train_fsdp.run()


if __name__ == "__main__":
    main()
