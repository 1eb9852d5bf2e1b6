"""Does the Free Transformer use Z? A lean one-device run on the synthetic task, for studies of
the latent at many widths at once (several runs can share one GPU), and the run
tests/test_latent_use.py makes at a small width on the CPU.

    python tests/latent_probe.py --n-layer 6 --d-model 384 --n-head 6 --latent-bits 16 --steps 3000 \
        --set latent_init=bits --out runs/probe.jsonl

The loop is the trainer's (AdamW, decay on >= 2-D weights, linear warm-up then cosine to 10 %,
clip 1.0, global batch 64, bf16 autocast on a GPU, fp32 on the CPU) without distribution or
checkpoints. Every --eval-every steps it writes a JSON line: validation CE and KL with Z from
the encoder, CE with Z from the prior (the gap is what the decoder reads from Z), r_rms_ratio
and z_swap_kl (how far the decoder's predictions move when Z is redrawn).
At the end the synthetic demonstration (sample.py) gives the fixed-Z / fresh-Z same-start shares.
"""

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import data as data_lib  # noqa: E402
import model as model_lib  # noqa: E402
import sample  # noqa: E402


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="free")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--latent-bits", type=int, default=8)
    p.add_argument("--kappa-bits", type=float, default=0.5)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--stop-after", type=int, default=0, help="end after this many steps (the schedule spans --steps)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-rows", type=int, default=512)
    p.add_argument("--demo-batches", type=int, default=8)
    p.add_argument("--set", nargs="*", default=[], help="ModelConfig field=value overrides")
    p.add_argument("--tag", default="")
    p.add_argument("--out", default="")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args(argv)


def model_config(a, vocab):
    cfg = model_lib.ModelConfig(arch=a.arch, n_layer=a.n_layer, d_model=a.d_model, n_head=a.n_head,
                                latent_bits=a.latent_bits, kappa=a.kappa_bits * math.log(2), vocab_size=vocab)
    types = {f.name: f.type for f in dataclasses.fields(cfg)}
    for item in a.set:
        key, value = item.split("=", 1)
        kind = types[key] if isinstance(types[key], type) else eval(types[key])
        setattr(cfg, key, value.lower() == "true" if kind is bool else kind(value))
    return model_lib.resolve_model_config(cfg)


@torch.no_grad()
def evaluate(model, data, a, device, ctx):
    """Validation with its own random numbers: the run's trajectory does not depend on how
    often it is evaluated."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        return evaluate_rows(model, data, a, device, ctx)


def evaluate_rows(model, data, a, device, ctx):
    model.eval()
    sums, n = {}, min(a.eval_rows, data.n_val)
    for s in range(0, n, 128):
        x, y = (t.to(device) for t in data.val_batch(s, min(128, n - s)))
        with ctx():
            logits, latent = model(x)
            _, parts = model_lib.lm_loss(logits, y, latent)
            if latent is not None:
                prior_logits, _ = model(x, mode="inference")
                parts["prior_ce"] = model_lib.lm_loss(prior_logits, y)[0]
                parts["z_swap_kl"] = swap_kl(prior_logits, model(x, mode="inference")[0])
        for k, v in parts.items():
            sums[k] = sums.get(k, 0.0) + float(v) * x.shape[0]
    model.train()
    return {f"val_{k}": v / n for k, v in sums.items()}


def swap_kl(logits_a, logits_b):
    """Mean KL per token between the predictions under two draws of Z: how much the decoder's output
    depends on Z, whether or not Z carries anything about the row yet."""
    log_a, log_b = logits_a.float().log_softmax(-1), logits_b.float().log_softmax(-1)
    return (log_a.exp() * (log_a - log_b)).sum(-1).mean()


def main(argv=None):
    a = parse(argv)
    torch.manual_seed(a.seed)
    device = torch.device(a.device)
    data = data_lib.open_dataset(data_lib.DataConfig(), a.seed)
    cfg = model_config(a, data.vocab_size)
    model = model_lib.build_model(cfg).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                                  lr=a.lr, betas=(0.9, 0.95))

    def ctx():
        if device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return torch.autocast("cpu", enabled=False)

    out = open(a.out, "a") if a.out else sys.stdout
    head = {"tag": a.tag, "arch": a.arch, "shape": f"{a.n_layer}x{a.d_model}", "H": a.latent_bits,
            "kappa_bits": a.kappa_bits, "lr": a.lr, "seed": a.seed, "set": a.set}
    t0 = time.time()
    for step in range(a.steps):
        if step < a.warmup:
            lr = a.lr * (step + 1) / a.warmup
        else:
            prog = (step - a.warmup) / max(1, a.steps - 1 - a.warmup)
            lr = a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * prog)))
        for g in optimizer.param_groups:
            g["lr"] = lr
        x, y = (t.to(device) for t in data.train_batch(step, a.batch, 0, a.batch))
        with ctx():
            logits, latent = model(x)
            loss, parts = model_lib.lm_loss(logits, y, latent, cfg.kappa)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % a.eval_every == 0 or step + 1 == a.steps:
            rec = {**head, "step": step + 1, "seconds": round(time.time() - t0, 1),
                   **{f"train_{k}": round(float(v), 4) for k, v in parts.items()},
                   **{k: round(v, 4) for k, v in evaluate(model, data, a, device, ctx).items()}}
            print(json.dumps(rec), file=out, flush=True)
        if step + 1 == a.stop_after:
            break
    if a.demo_batches:
        model.eval()
        summary, _ = sample.synthetic_demo(model, device, a.seed, n_batches=a.demo_batches)
        rec = {**head, "final": True, **rec, "fixed_z": round(summary["fixed_z"]["same_start_share"], 3),
               "fresh_z": round(summary["fresh_z"]["same_start_share"], 3)}
        print(json.dumps(rec), file=out, flush=True)


if __name__ == "__main__":
    main()
