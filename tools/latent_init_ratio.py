"""rms(R) / rms(what R is added to) at initialisation, the paper's injection against this
repository's, at several widths (BENCHMARKS.md, issue 11):  python tools/latent_init_ratio.py"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data as D  # noqa: E402
import model as M  # noqa: E402

d = D.open_dataset(D.DataConfig(), 0)
x, _ = d.train_batch(0, 8, 0, 8)
for shape in [(4, 64, 4, 8), (4, 128, 4, 8), (6, 384, 6, 16), (12, 768, 12, 16), (16, 2048, 32, 16)]:
    L, W, nh, H = shape
    row = []
    for name, kw in (("old", dict(latent_init="random", latent_inject="pre_norm", latent_std=0.02)), ("new", {})):
        torch.manual_seed(0)
        cfg = M.resolve_model_config(M.ModelConfig(n_layer=L, d_model=W, n_head=nh, latent_bits=H, vocab_size=32, **kw))
        with torch.no_grad():
            _, lat = M.build_model(cfg)(x)
        row.append(f"{name} {lat['r_rms_ratio'].item():.3f}")
    print(f"{L}x{W} H{H}: " + ", ".join(row), flush=True)
