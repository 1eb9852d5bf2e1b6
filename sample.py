"""Sample from a saved checkpoint on one CPU or GPU, without FSDP.

    python sample.py --ckpt runs/RUN                       # 8 samples, decoded with the run's tokenizer
    python sample.py --ckpt runs/RUN --prompt "K>" --fixed-z
    python sample.py --ckpt runs/RUN --demo                # the synthetic-task demonstration

--demo (built-in synthetic task only) generates batches with Z fixed across the batch and
with fresh Z, and measures how often the 8-letter block starts at the same position within a
batch and how often it is well formed. A Free Transformer that uses Z clusters the block under
fixed Z and spreads it under fresh Z; the baseline shows no difference. The result is printed
and saved as demo.json and demo_samples.txt in the run directory.
"""

import argparse
import collections
import importlib
import json
import math
import os
import sys

import torch

import data as data_lib
import model as model_lib
import runs_report
import train_fsdp


def find_checkpoint(path):
    """The consolidated model.pt of a run directory (its latest checkpoint), of a checkpoint
    directory (or RUN/checkpoints/best or latest, which name one), or the file itself."""
    if os.path.isdir(os.path.join(path, "checkpoints")):
        latest = os.path.join(path, "checkpoints", "latest")
        if not os.path.isfile(latest):
            raise FileNotFoundError(f"{path} holds no checkpoints/latest; is it a run directory?")
        with open(latest) as fh:
            path = os.path.join(path, "checkpoints", fh.read().strip())
    if os.path.basename(path) in ("best", "latest") and os.path.isfile(path):  # a marker: the name of a checkpoint
        with open(path) as fh:
            path = os.path.join(os.path.dirname(path), fh.read().strip())
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "model.pt")):
            raise FileNotFoundError(f"{path} is a sharded checkpoint without a consolidated model.pt; write one "
                                    f"with: python train_fsdp.py --export {path}")
        path = os.path.join(path, "model.pt")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--ckpt {path}: no such file, checkpoint or run directory")
    return path


def load_model(path, device):
    """An unwrapped model from a consolidated checkpoint, in eval mode, plus the checkpoint."""
    path = find_checkpoint(path)
    try:
        ckpt = train_fsdp.load_weights_only(path)  # tensors and plain values only, as every load of the trainer
    except train_fsdp.BadInput as e:  # a pickle that would run code: refused before anything in it ran
        fail(str(e))
    except Exception as e:  # truncated, say (RuntimeError, OSError, ...): torch's own message is a traceback deep
        fail(f"--ckpt {path} cannot be read ({type(e).__name__}: {str(e).splitlines()[0]}): the checkpoint is "
             "damaged; export it again, or sample another")
    model = model_lib.build_model(model_lib.ModelConfig(**model_lib.saved_fields(ckpt["config"]["model"])))
    model.load_state_dict(ckpt["model"])
    return model.to(device).eval(), ckpt


def block_start(body, letter):
    """(start of the letter block or None, well formed?) for the 64 generated characters.
    Well formed: only the prompt's letter, all its copies inside one window of 8 that holds
    nothing but the letter and '!' (the task's noise), and the rest '_' or '!'."""
    where = [i for i, c in enumerate(body) if c == letter]
    if len(body) != data_lib.SYNTH_BODY or not where or set(body) - {letter, "_", "!"}:
        return (where[0] if where else None), False
    lo, hi = where[0], where[-1]
    fits = hi - lo < data_lib.SYNTH_BLOCK and any(
        all(c in (letter, "!") for c in body[s:s + data_lib.SYNTH_BLOCK])
        for s in range(max(0, hi - data_lib.SYNTH_BLOCK + 1), min(lo, data_lib.SYNTH_BODY - data_lib.SYNTH_BLOCK) + 1))
    return lo, fits


def batch_stats(texts, letter):
    """Share of the batch at its most common block start, share well formed, and the starts."""
    parsed = [block_start(t[2:], letter) for t in texts]  # after the prompt "<letter>>"
    starts = [s for s, _ in parsed if s is not None]
    mode_share = collections.Counter(starts).most_common(1)[0][1] / len(texts) if starts else 0.0
    return mode_share, sum(ok for _, ok in parsed) / len(texts), starts


def same_noise_share(texts):
    """The share of the other samples that write a '!' (the task's noise) where a sample does, averaged
    over its '!': about the noise rate when each draws its noise, 1 when a shared Z carries it. None
    when the batch writes no '!'."""
    counts = collections.Counter(i for t in texts for i, c in enumerate(t[2:]) if c == "!")
    total = sum(counts.values())
    if not total or len(texts) < 2:
        return None
    return sum(c * (c - 1) for c in counts.values()) / ((len(texts) - 1) * total)


def entropy(values):
    """Entropy in nats of the empirical distribution of values."""
    counts, n = collections.Counter(values).values(), len(values)
    return -sum(c / n * math.log(c / n) for c in counts) if n else 0.0


def synthetic_demo(model, device, seed, n_batches=8, batch=32):
    """Fixed Z (one prior draw shared by the batch, prompt included) against fresh Z (a draw per
    sample): same block start, well formed, same '!'. The start entropy under fresh Z shows how skewed
    the model's own starts are: fresh Z, not uniform starts, is the reference for fixed Z."""
    gen = torch.Generator(device=device).manual_seed(seed)
    n_codes = 2 ** model.cfg.latent_bits if model.cfg.arch == "free" else 1
    total = 3 + data_lib.SYNTH_BODY
    result, noise = {"fixed_z": [], "fresh_z": []}, {"fixed_z": [], "fresh_z": []}
    samples = []
    for b in range(n_batches):
        letter = data_lib.SYNTH_CHARS[4 + (7 * b) % 26]
        prompt = torch.tensor([data_lib.encode(None, "\n" + letter + ">")] * batch, device=device)
        shared = torch.randint(0, n_codes, (1, total), device=device, generator=gen).expand(batch, total)
        for name, z in (("fixed_z", shared), ("fresh_z", None)):
            out, _ = model.generate(prompt, data_lib.SYNTH_BODY, temperature=1.0, z=z, prompt_z="prior",
                                    generator=gen)
            texts = [data_lib.decode(None, row[1:].tolist()) for row in out]  # drop the leading newline
            result[name].append(batch_stats(texts, letter))
            share = same_noise_share(texts)
            if share is not None:
                noise[name].append(share)
            samples += [f"[{name} batch {b}] {t}" for t in texts[:8]]
    summary = {name: {"same_start_share": sum(m for m, _, _ in v) / len(v),
                      "well_formed_share": sum(w for _, w, _ in v) / len(v),
                      "start_entropy": entropy([s for _, _, starts in v for s in starts]),
                      "same_noise_share": sum(noise[name]) / len(noise[name]) if noise[name] else 0.0}
               for name, v in result.items()}
    summary.update(arch=model.cfg.arch, batches=n_batches, batch_size=batch, seed=seed,
                   uniform_start_entropy=math.log(data_lib.SYNTH_BODY - data_lib.SYNTH_BLOCK + 1),
                   block_starts={name: [starts for _, _, starts in v] for name, v in result.items()})
    return summary, samples


def block_start_figure(summary):
    """The demonstration's block starts under fixed Z and fresh Z, as two heat maps: a row per
    batch, a column per start position, the share of the batch starting there. A model that puts
    the position in Z shows one bright cell per row under fixed Z and spread rows under fresh Z."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.2), dpi=100, sharey=True, layout="constrained")
    for ax, name in zip(axes, ("fixed_z", "fresh_z")):
        grid = torch.zeros(summary["batches"], data_lib.SYNTH_BODY)
        for b, starts in enumerate(summary["block_starts"][name]):
            for start in starts:
                grid[b, start] += 1 / summary["batch_size"]
        image = ax.imshow(grid.numpy(), aspect="auto", vmin=0, vmax=1, interpolation="nearest", cmap="viridis")
        ax.set_title(f"{name.replace('_z', ' Z')}: {100 * summary[name]['same_start_share']:.0f}% of a batch at "
                     "its most common start", fontsize=10)
        ax.set_xlabel("position of the block's first letter")
    axes[0].set_ylabel("batch")
    fig.colorbar(image, ax=axes, label="share of the batch")
    fig.suptitle(f"{summary['arch']}: where the letter block starts, {summary['batch_size']} samples a batch",
                 fontsize=11)
    return fig


def unknown_characters(sp, text):
    """Characters of `text` that a SentencePiece model without byte fallback (a char tokenizer)
    encodes as <unk>: said, since the model then reads something other than what was typed."""
    if sp is None or sp.unk_id() < 0:
        return []
    return sorted(c for c in set(text) if sp.unk_id() in sp.encode(c))


def installed(package):
    """Whether an optional package imports (it is imported only when a flag asks for it)."""
    try:
        importlib.import_module(package)
        return True
    except ImportError:
        return False


def fail(message):
    """Bad input, as the trainer reports it: one `error:` line naming it, exit code 2, nothing written."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # argparse's default prints the whole usage first
        fail(f"{message} (python sample.py --help lists the flags)")


def check_args(args):
    """Numbers outside their range and an unknown device, before anything is loaded or written."""
    rules = [("--num-samples", args.num_samples, args.num_samples >= 1, ">= 1"),
             ("--max-new-tokens", args.max_new_tokens, args.max_new_tokens >= 0, ">= 0"),
             ("--temperature", args.temperature, math.isfinite(args.temperature) and args.temperature >= 0,
              "a finite number >= 0 (0 = greedy)"),
             ("--top-k", args.top_k, args.top_k >= 0, ">= 0 (0 = all tokens)")]
    for flag, value, ok, valid in rules:
        if not ok:
            fail(f"{flag} {value}: must be {valid}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        fail(f"--device {args.device}: not a device; use cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        fail(f"--device {args.device}: no CUDA device here; use --device cpu")


def build_arg_parser():
    p = OneLineParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", help="run directory (its latest checkpoint), RUN/checkpoints/best (the lowest "
                   "validation loss), a checkpoint directory or a model.pt")
    p.add_argument("--prompt", default="", help="text to continue; default: a newline (synthetic: '\\nK>')")
    p.add_argument("--num-samples", type=int, default=8, help="samples in the batch")
    p.add_argument("--max-new-tokens", type=int, default=0, help="tokens to generate; 0 = 64 synthetic, 200 text")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = all")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling generator (reproducible samples)")
    p.add_argument("--prompt-z", default="prior", choices=["encoder", "prior"],
                   help="Free Transformer: the prompt's Z from the uniform prior (as for generated tokens) or the "
                   "encoder run on the prompt alone (it was trained on whole rows)")
    p.add_argument("--chat", action="store_true", help="--prompt is a user's message, or a JSON list of "
                   "{\"role\", \"content\"} messages: rendered with the run's chat template (as --instruct "
                   "renders them); each sample is the reply, up to its end of turn")
    p.add_argument("--fixed-z", action="store_true", help="Free Transformer: one Z draw shared by all samples")
    p.add_argument("--demo", action="store_true", help="synthetic task: fixed-Z vs fresh-Z block statistics")
    p.add_argument("--figure", action="store_true", help="with --demo: also save demo_block_starts.png, the "
                   "block starts under fixed vs fresh Z (needs matplotlib)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p


def main(argv=None):
    args = build_arg_parser().parse_args(argv)
    check_args(args)
    if not args.ckpt:
        fail("--ckpt is required: a run directory, a checkpoint directory or a model.pt")
    if args.figure and not args.demo:
        fail("--figure draws the demonstration: give it with --demo")
    if args.figure and not installed("matplotlib"):
        fail("--figure needs the matplotlib package, which is not installed: pip install matplotlib")
    device = torch.device(args.device)
    try:
        model, ckpt = load_model(args.ckpt, device)
        sp = data_lib.load_tokenizer(ckpt["tokenizer"])
        bos = [] if sp is None else data_lib.document_marks(sp, ckpt["tokenizer"])[0]  # Llama's, Mistral's
        if sp is None and ckpt["config"]["data"]["dataset"] not in ("synthetic", "random"):
            fail(f"the run's data ({ckpt['config']['data']['dataset']}) came without a tokenizer, so its ids have "
                 "no text: train with --tokenizer MODEL (the SentencePiece model that wrote them) to sample")
    except (FileNotFoundError, data_lib.DataError) as e:
        fail(e)
    if args.chat and sp is None:
        fail("--chat renders a chat with the run's tokenizer; this run has none (synthetic data)")
    try:
        ids, stop = chat_ids(args.prompt, ckpt["tokenizer"]) if args.chat else (
            bos + data_lib.encode(sp, args.prompt or ("\nK>" if sp is None else "\n")), ())
    except data_lib.DataError as e:  # the synthetic vocabulary has 30 characters; a bad chat
        fail(f"--prompt {args.prompt!r}: {e}")
    unknown = unknown_characters(sp, args.prompt)
    if unknown:
        print(f"note: --prompt characters {unknown} are not in the run's tokenizer; the model reads each as <unk>",
              file=sys.stderr)
    if args.demo:
        return demo(args, model, ckpt, device)
    print_samples(args, model, sp, ids, len(ids) if args.chat else len(bos), device, stop)
    return None


def chat_ids(prompt, tokenizer):
    """(ids, end-of-turn ids) of --chat's prompt: a JSON list of messages, or one user message."""
    try:
        messages = json.loads(prompt)
    except json.JSONDecodeError:
        messages = None
    if not isinstance(messages, list):
        messages = [{"role": "user", "content": prompt}]
    return data_lib.chat_prompt(tokenizer, messages)


def print_samples(args, model, sp, ids, skip, device, stop=()):
    """Print --num-samples continuations of the prompt's ids, which start as a training document
    does (a downloaded model's BOS, if its family adds one), from id `skip` on; with --fixed-z all
    share one Z draw. A chat's samples are its replies, each cut at its first `stop` id."""
    prompt = torch.tensor([ids] * args.num_samples, device=device)
    new = args.max_new_tokens or (data_lib.SYNTH_BODY if sp is None else 200)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    z = None
    if args.fixed_z and model.cfg.arch == "free":
        total = len(ids) + new
        z = torch.randint(0, 2 ** model.cfg.latent_bits, (1, total), device=device,
                          generator=gen).expand(args.num_samples, total)
    out, _ = model.generate(prompt, new, args.temperature, args.top_k, z=z, prompt_z=args.prompt_z, generator=gen,
                            stop=stop)
    for row in out.tolist():
        row = row[skip:]
        if stop:
            row = row[:min([row.index(t) for t in stop if t in row], default=len(row))]
        print(repr(data_lib.decode(sp, row)))


def demo_dirs(ckpt_arg):
    """(run directory, whether the checkpoint sits in one): the demonstration's files go to the run
    directory, else beside the checkpoint file."""
    step_dir = os.path.dirname(os.path.abspath(find_checkpoint(ckpt_arg)))
    in_run = os.path.basename(os.path.dirname(step_dir)) == "checkpoints"
    return (os.path.dirname(os.path.dirname(step_dir)) if in_run else step_dir), in_run


def run_trackers(run_dir, in_run):
    """The `train` section of the run's config.json (its --tensorboard, --wandb), checked before the
    demonstration runs: a tracker the run used must be importable here."""
    train = {}
    if in_run and os.path.isfile(os.path.join(run_dir, "config.json")):
        with open(os.path.join(run_dir, "config.json")) as fh:
            train = json.load(fh)["train"]
    for package in ("tensorboard", "wandb"):  # the config's fields are named as the packages
        if train.get(package) and not installed(package):
            fail(f"the run logged to {package}, which is not installed here: pip install {package}")
    return train


def demo(args, model, ckpt, device):
    """--demo: the synthetic demonstration into demo.json, demo_samples.txt, the figure and the run's
    trackers; returns its summary."""
    if ckpt["config"]["data"]["dataset"] != "synthetic":
        print("no demo: the run is not on the built-in synthetic task")
        return None
    run_dir, in_run = demo_dirs(args.ckpt)
    train = run_trackers(run_dir, in_run)
    draw = bool(args.figure or train.get("tensorboard") or train.get("wandb"))
    if draw and not installed("matplotlib"):
        print("the run's trackers get the demonstration's numbers, not its figure: pip install matplotlib")
        draw = False
    summary, samples = synthetic_demo(model, device, args.seed)
    with open(os.path.join(run_dir, "demo.json"), "w") as fh:
        json.dump(summary, fh, indent=1)
    figure = block_start_figure(summary) if draw else None
    if args.figure:
        figure.savefig(os.path.join(run_dir, "demo_block_starts.png"))
        print(f"saved {os.path.join(run_dir, 'demo_block_starts.png')}")
    runs_report.demo_to_trackers(run_dir, train, ckpt["step"], summary, figure)
    with open(os.path.join(run_dir, "demo_samples.txt"), "w") as fh:
        fh.write("\n".join(s.replace("\n", "|") for s in samples) + "\n")
    print("\n".join(s.replace("\n", "|") for s in samples[:4] + samples[8:12]))
    for name in ("fixed_z", "fresh_z"):
        print(f"{summary['arch']} {name}: same block start {100 * summary[name]['same_start_share']:.1f}% "
              f"of a batch, well formed {100 * summary[name]['well_formed_share']:.1f}%, "
              f"a '!' shared by {100 * summary[name]['same_noise_share']:.1f}% of the other samples")
    print(f"entropy of the block start under fresh Z: {summary['fresh_z']['start_entropy']:.2f} nats "
          f"(uniform over the {data_lib.SYNTH_BODY - data_lib.SYNTH_BLOCK + 1} starts: "
          f"{summary['uniform_start_entropy']:.2f}); fresh Z is the reference for fixed Z, not uniform starts")
    print(f"saved {os.path.join(run_dir, 'demo.json')} and demo_samples.txt")
    return summary


if __name__ == "__main__":
    main()
