"""Draw one or more runs' metrics.jsonl into one PNG (needs matplotlib: pip install matplotlib).

    python plot_runs.py runs/free-fsdp-A runs/baseline-fsdp-B -o compare.png
    make plot RUNS="runs/kappa-*" OUT=kappa.png

Panels: training loss (solid) and validation loss (dashed, dots) against step and against tokens
seen, learning rate, gradient norm, tokens/s (MFU where every run reports it), and for the Free
Transformer the CE, the KL and r_rms_ratio (KL and r_rms_ratio falling to 0: posterior collapse).
Runs are overlaid, one colour each, named by their directory.
"""

import argparse
import json
import os
import sys

WIDTH, HEIGHT, DPI = 16, 8, 80  # inches and dots per inch: a 1280 x 640 PNG


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # argparse's default prints the whole usage first
        fail(f"{message} (python plot_runs.py --help lists the flags)")


def read_run(run_dir):
    """(training records, validation records) of a run directory, each sorted by step."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        fail(f"{run_dir}: no metrics.jsonl; give run directories (runs/NAME)")
    with open(path) as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    train = sorted((r for r in records if "loss" in r), key=lambda r: r["step"])
    val = sorted((r for r in records if "val_loss" in r), key=lambda r: r["step"])
    # Validation records of runs older than their tokens_seen field: tokens per step is constant.
    per_step = train[0]["tokens_seen"] / train[0]["step"] if train else 0
    for r in val:
        r.setdefault("tokens_seen", r["step"] * per_step)
    return train, val


def plot(runs, out):
    """runs: {label: (train, val)}; writes the PNG `out`."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    throughput = "mfu" if all(any("mfu" in r for r in train) for train, _ in runs.values()) else "tokens_per_s"
    panels = [("loss", "step", "loss (solid: training, dashed: validation)"),
              ("loss", "tokens_seen", "loss against tokens seen"),
              ("lr", "step", "learning rate"), ("grad_norm", "step", "gradient norm (before clipping)"),
              (throughput, "step", "MFU" if throughput == "mfu" else "tokens/s"),
              ("ce", "step", "cross-entropy"), ("kl", "step", "KL, nats/token (Free Transformer)"),
              ("r_rms_ratio", "step", "r_rms_ratio (Free Transformer)")]
    fig, axes = plt.subplots(2, 4, figsize=(WIDTH, HEIGHT), dpi=DPI)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, x, title) in zip(axes.flat, panels):
        drawn = False
        for i, (label, (train, val)) in enumerate(runs.items()):
            colour = colours[i % len(colours)]
            points = [(r[x], r[key]) for r in train if key in r]
            if points:
                ax.plot(*zip(*points), color=colour, lw=1.2, label=label)
                drawn = True
            points = [(r[x], r[f"val_{key}"]) for r in val if f"val_{key}" in r]
            if points:
                ax.plot(*zip(*points), color=colour, ls="--", marker="o", ms=3, lw=1)
                drawn = True
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("tokens seen" if x == "tokens_seen" else "step", fontsize=9)
        ax.grid(alpha=0.3)
        if key in ("loss", "ce", "grad_norm"):  # the tail of a loss curve is what differs between runs
            ax.set_yscale("log")
        if not drawn:
            ax.text(0.5, 0.5, f"no {key} in these runs", ha="center", va="center", transform=ax.transAxes)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    # no bbox_inches="tight": the PNG is always WIDTH x HEIGHT x DPI
    fig.savefig(out, pil_kwargs={"optimize": True})
    plt.close(fig)


def main(argv=None):
    p = OneLineParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories (each holds metrics.jsonl)")
    p.add_argument("-o", "--out", default="runs.png", help="the PNG to write")
    args = p.parse_args(argv)
    try:
        import matplotlib  # noqa: F401  (checked before anything is read or written)
    except ImportError:
        fail("plot_runs.py needs the matplotlib package, which is not installed: pip install matplotlib")
    runs = {}
    for run in args.runs:
        label = os.path.basename(os.path.normpath(run))
        runs[label if label not in runs else os.path.normpath(run)] = read_run(run)
    if not any(train for train, _ in runs.values()):
        fail(f"no training records in {', '.join(args.runs)}")
    plot(runs, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
