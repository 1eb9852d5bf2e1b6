"""What Z carries on text: samples of a Free Transformer under one shared Z against fresh Z.

    python tools/ft_text_probe.py RUN [BASELINE_RUN] [--samples 32] [--tokens 256] [--seed 0]

Measure: from one prompt, draw a batch of samples twice, once with a single prior draw of Z
shared by every sample (fixed Z) and once with a draw per sample (fresh Z), and compare how
alike the samples of a batch are. Two similarities between every pair of samples:
- position agreement: the share of positions where the two samples hold the same token (what
  a latent that fixes layout or timing raises: line breaks, speaker turns, word lengths);
- word overlap: the Jaccard index of their sets of words (what a latent that fixes the topic or
  the vocabulary raises, wherever the words fall).
A model that ignores Z gives the same figures under both draws (the baseline's samples are the
reference: they have no Z). The ratio fixed / fresh says how much one Z makes samples alike;
the difference between the posterior CE and the prior CE (logged by the trainer) says how many
nats per token Z carries about the row it was read from. Prints a JSON line and writes
examples next to the run (ft_text_probe.json, ft_text_samples.txt).
"""
import argparse
import itertools
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sample  # noqa: E402


def similarity(texts, ids):
    pairs = list(itertools.combinations(range(len(texts)), 2))
    pos = sum((ids[i] == ids[j]).float().mean().item() for i, j in pairs) / len(pairs)
    words = [set(re.findall(r"[A-Za-z']+", t.lower())) for t in texts]
    jac = sum(len(words[i] & words[j]) / max(1, len(words[i] | words[j])) for i, j in pairs) / len(pairs)
    return {"position_agreement": pos, "word_overlap": jac}


def draw(model, sp, prompt, n, tokens, seed, device, fixed):
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = torch.tensor([sp.encode(prompt)] * n, device=device)
    z = None
    if fixed and model.cfg.arch == "free":
        one = torch.randint(0, 2 ** model.cfg.latent_bits, (1, ids.shape[1] + tokens), device=device, generator=gen)
        z = one.expand(n, -1).contiguous()
    with torch.no_grad():
        out, _ = model.generate(ids, tokens, z=z, generator=gen)
    new = out[:, ids.shape[1]:].cpu()
    return [sp.decode(row.tolist()) for row in new], new


def probe(run, args, device):
    model, ckpt = sample.load_model(run, device)
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=ckpt["tokenizer"])
    result, examples = {}, []
    for name, fixed in (("fixed_z", True), ("fresh_z", False)):
        sims = []
        for b in range(args.batches):
            texts, ids = draw(model, sp, args.prompt, args.samples, args.tokens, args.seed + b, device, fixed)
            sims.append(similarity(texts, ids))
            if b == 0:
                examples.append(f"=== {name} (first 3 of batch 0)\n" + "\n---\n".join(texts[:3]))
        result[name] = {k: sum(s[k] for s in sims) / len(sims) for k in sims[0]}
    return model.cfg.arch, result, examples


def main():
    p = argparse.ArgumentParser()
    p.add_argument("runs", nargs="+")
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--prompt", default="\n")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for run in args.runs:
        arch, result, examples = probe(run, args, device)
        line = {"run": run, "arch": arch, **result}
        if arch == "free":
            line["ratio"] = {k: result["fixed_z"][k] / max(result["fresh_z"][k], 1e-9) for k in result["fixed_z"]}
        print(json.dumps(line))
        with open(os.path.join(run, "ft_text_probe.json"), "w") as fh:
            json.dump(line, fh, indent=1)
        with open(os.path.join(run, "ft_text_samples.txt"), "w") as fh:
            fh.write("\n\n".join(examples) + "\n")


if __name__ == "__main__":
    main()
