"""Report runs: their metrics.jsonl overlaid in one figure, a sweep's table, and the synthetic
demonstration sent to a run's TensorBoard / W&B.

    python runs_report.py runs/free-fsdp-A runs/baseline-fsdp-B -o compare.png   # or .pdf, .svg
    python runs_report.py runs/kappa-* --table        # Markdown table of runs that ran sample.py --demo
    make plot RUNS="runs/kappa-*" PLOT=kappa.png

Panels: training loss (solid) and validation loss (dashed, dots) against step and against tokens
seen, learning rate, gradient norm, tokens/s (MFU where every run reports it), and for the Free
Transformer the CE, the KL and r_rms_ratio (KL and r_rms_ratio falling to 0: posterior collapse).
Runs are overlaid, one colour each, named by their directory. The figure needs matplotlib.
"""

import argparse
import json
import math
import os
import sys

WIDTH, HEIGHT, DPI = 16, 8, 80  # inches and dots per inch: a 1280 x 640 PNG


def fail(message, code=2):
    """One `error:` line and the exit code: 2 for bad input, 1 for a write that failed."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # argparse's default prints the whole usage first
        fail(f"{message} (python runs_report.py --help lists the flags)")


def read_records(path):
    """The records of a metrics.jsonl. A killed run can leave its last line cut mid-write: that
    line is skipped, said on one line; any other line that is not a JSON record is bad input."""
    try:
        with open(path, "rb") as fh:
            text = fh.read().decode("utf-8")
    except UnicodeDecodeError:
        fail(f"{path}: not a metrics.jsonl (not UTF-8 text)")
    if "\0" in text:
        fail(f"{path}: not a metrics.jsonl (binary data)")
    lines = [(i, line) for i, line in enumerate(text.split("\n"), 1) if line.strip()]
    records = []
    for i, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i == lines[-1][0]:
                print(f"{path}: skipped line {i}, cut mid-write (the run was stopped while logging)", file=sys.stderr)
                break
            fail(f"{path}: line {i} is not JSON; not a metrics.jsonl")
        if not isinstance(record, dict) or not isinstance(record.get("step"), (int, float)):
            fail(f"{path}: line {i} is not a metrics record (no step); not a metrics.jsonl")
        records.append(record)
    return records


def read_run(run_dir):
    """(training records, validation records) of a run directory, each sorted by step."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        fail(f"{run_dir}: no metrics.jsonl; give run directories (runs/NAME)")
    records = read_records(path)
    train = sorted((r for r in records if "loss" in r), key=lambda r: r["step"])
    val = sorted((r for r in records if "val_loss" in r), key=lambda r: r["step"])
    # Validation records of runs older than their tokens_seen field: tokens per step is constant.
    per_step = train[0]["tokens_seen"] / train[0]["step"] if train else 0
    for r in val:
        r.setdefault("tokens_seen", r["step"] * per_step)
    return train, val


def plot(runs, out):
    """runs: {label: (train, val)}; writes the figure `out` (its extension picks the format)."""
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
    png = os.path.splitext(out)[1].lower() in ("", ".png")
    fig.savefig(out, **({"pil_kwargs": {"optimize": True}} if png else {}))
    plt.close(fig)


def figure_formats():
    """The file extensions matplotlib writes (png, pdf, svg, ...), without the dot."""
    from matplotlib.figure import Figure
    return set(Figure().canvas.get_supported_filetypes())


def noise_cell(stats):
    """same_noise_share as a table cell (demo.json files written before it existed lack it)."""
    return f"{100 * stats['same_noise_share']:.1f} %" if "same_noise_share" in stats else "–"


def read_json(path, what):
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError) as e:
        fail(f"{path}: cannot read {what} ({type(e).__name__}: {e})")


def summarize(run_dirs):
    """A Markdown table of runs (e.g. a kappa sweep): kappa, final validation CE and KL, demo."""
    rows = ["| run | kappa (bits) | val CE | val KL (nats/token) | same start fixed Z | same start fresh Z | "
            "same '!' fixed Z | same '!' fresh Z |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for run in run_dirs:
        kappa = read_json(os.path.join(run, "config.json"), "the run's config")["model"]["kappa"]
        finals = [r for r in read_records(os.path.join(run, "metrics.jsonl")) if "val_ce" in r]
        if not finals:
            fail(f"{run}: no validation CE in metrics.jsonl")
        val = finals[-1]
        demo = read_json(os.path.join(run, "demo.json"), f"the demonstration (python sample.py --ckpt {run} --demo)")
        rows.append(f"| {os.path.basename(run.rstrip('/'))} | {kappa / math.log(2):g} | {val['val_ce']:.4f} | "
                    f"{val.get('val_kl', 0.0):.4f} | {100 * demo['fixed_z']['same_start_share']:.1f} % | "
                    f"{100 * demo['fresh_z']['same_start_share']:.1f} % | {noise_cell(demo['fixed_z'])} | "
                    f"{noise_cell(demo['fresh_z'])} |")
    return "\n".join(rows)


def demo_to_trackers(run_dir, train, step, summary, figure):
    """sample.py --demo's results into the TensorBoard / W&B run of a run that used them (its
    config's `train` section): the shares as scalars and, with matplotlib, the figure. A tracker
    that fails is said on one line; demo.json is written already."""
    scalars = {f"demo/{name}/{k}": v for name in ("fixed_z", "fresh_z") for k, v in summary[name].items()}
    if train.get("tensorboard"):
        try:
            from torch.utils.tensorboard import SummaryWriter
            with SummaryWriter(os.path.join(run_dir, "tensorboard")) as writer:
                for key, value in scalars.items():
                    writer.add_scalar(key, value, step)
                if figure:
                    writer.add_figure("demo/block_starts", figure, step, close=False)
            print(f"logged the demonstration to TensorBoard ({run_dir}/tensorboard, step {step})")
        except Exception as e:
            print(f"TensorBoard failed ({type(e).__name__}: {e}); the demonstration is in demo.json")
    if train.get("wandb"):
        try:
            import wandb
            state_path = os.path.join(run_dir, "wandb_run.json")  # the trainer's: the run's id, its last step
            with open(state_path) as fh:
                state = json.load(fh)
            run = wandb.init(project=train["wandb"], id=state["id"], resume="allow", dir=run_dir,
                             settings=wandb.Settings(console="off"))
            # W&B takes no step below its last one: the step after the training's last.
            run.log({**scalars, **({"demo/block_starts": wandb.Image(figure)} if figure else {})},
                    step=state["step"] + 1)
            run.finish()
            with open(state_path, "w") as fh:
                json.dump({"id": state["id"], "step": state["step"] + 1}, fh)
            print(f"logged the demonstration to W&B run {state['id']} (step {state['step'] + 1})")
        except Exception as e:
            print(f"W&B failed ({type(e).__name__}: {e}); the demonstration is in demo.json")


def write_figure(run_dirs, out):
    """Check everything first (matplotlib, the format, every run), then create OUT's directory and write it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        fail("runs_report.py needs the matplotlib package, which is not installed: pip install matplotlib")
    ext = os.path.splitext(out)[1].lower().lstrip(".")
    if ext and ext not in figure_formats():
        fail(f"-o {out}: matplotlib writes no .{ext}; use .png, .pdf or .svg")
    runs = {}
    for run in run_dirs:
        label = os.path.basename(os.path.normpath(run))
        runs[label if label not in runs else os.path.normpath(run)] = read_run(run)
    if not any(train for train, _ in runs.values()):
        fail(f"no training records in {', '.join(run_dirs)}")
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        plot(runs, out)
    except OSError as e:
        fail(f"-o {out}: cannot write it ({e.strerror or e})", code=1)
    print(f"wrote {out}")


def main(argv=None):
    p = OneLineParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories (each holds metrics.jsonl)")
    p.add_argument("-o", "--out", default="runs.png", help="the figure to write: .png, .pdf or .svg")
    p.add_argument("--table", action="store_true", help="print a Markdown table of the runs (each ran sample.py "
                   "--demo) instead of the figure")
    args = p.parse_args(argv)
    if args.table:
        print(summarize(args.runs))
    else:
        write_figure(args.runs, args.out)


if __name__ == "__main__":
    main()
