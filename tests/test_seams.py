"""The trainer's seams: a model, loss and batch source defined here (not in model.py / data.py)
train through train_fsdp.main with FSDP on 2 processes, with the same losses as one process.

Run as a script under torchrun by the test below.
"""
import ast
import json
import os
import subprocess
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import train_fsdp  # noqa: E402

VOCAB, SEQ = 16, 12


class ResidualMLP(nn.Module):
    """The user's repeated block: the FSDP unit and the checkpointing unit."""

    def __init__(self, d):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class TokenMLP(nn.Module):
    def __init__(self, d=32, n=3):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(ResidualMLP(d) for _ in range(n))
        self.head = nn.Linear(d, VOCAB)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


class ReverseTask:
    """Predict (15 - token): every row is a function of (seed, global row index). It has what the
    trainer reads from a batch source (train_fsdp.BatchSource)."""
    vocab_size, seq_len, n_val, tokenizer_path = VOCAB, SEQ, 32, ""

    def _rows(self, ids):
        g = torch.Generator().manual_seed(0)
        table = torch.randint(0, VOCAB, (100_000, SEQ), generator=g)
        x = table[torch.as_tensor(ids) % table.shape[0]]
        return x, VOCAB - 1 - x

    def train_batch(self, step, global_batch, start, count):
        return self._rows(range(step * global_batch + start, step * global_batch + start + count))

    def val_batch(self, start, count):
        return self._rows(range(50_000 + start, 50_000 + start + count))

    def steps_per_epoch(self, global_batch):
        return 100


def build_model(cfg):
    return TokenMLP(), {ResidualMLP}, {ResidualMLP}


def compute_loss(model, x, y, cfg):
    loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
    return loss, {}


def load_dataset(cfg, rank):
    return ReverseTask()


def test_the_seams_need_nothing_model_specific():
    """This file imports neither model.py nor data.py, and its batch source is a BatchSource."""
    tree = ast.parse(open(__file__).read())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported.isdisjoint({"model", "data"}), imported
    assert isinstance(ReverseTask(), train_fsdp.BatchSource)
    assert not isinstance(object(), train_fsdp.BatchSource)


def test_custom_model_through_the_seams(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env["OMP_NUM_THREADS"] = "1"
    losses = {}
    for name, nproc, extra in [("fsdp2", 2, ["--strategy", "fsdp", "--activation-checkpointing"]),
                               ("single", 1, ["--strategy", "none"])]:
        out = tmp_path / name
        cmd = [os.path.abspath(__file__), "--out-dir", str(out), *extra]
        if nproc > 1:
            cmd = ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", "0",
                   "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0"] + cmd
        res = subprocess.run([sys.executable] + cmd, env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-4000:]
        with open(out / "metrics.jsonl") as fh:
            losses[name] = [r["loss"] for r in map(json.loads, fh) if "loss" in r]
        ckpt = torch.load(out / "checkpoints" / "step_0000008" / "model.pt", weights_only=True)
        assert ckpt["model"].keys() == TokenMLP().state_dict().keys()
    assert len(losses["single"]) == 8
    for a, b in zip(losses["fsdp2"], losses["single"]):
        assert abs(a - b) <= 1e-5 * b
    assert losses["single"][-1] < 0.7 * losses["single"][0]  # it learns


if __name__ == "__main__":
    # The flags are the trainer's own; the seams replace model, loss and data.
    argv = ["--max-steps", "8", "--global-batch", "8", "--log-every", "1", "--eval-samples", "8",
            "--param-dtype", "fp32", "--warmup-steps", "1", "--lr", "1e-2"] + sys.argv[1:]
    train_fsdp.main(argv, build_model=build_model, compute_loss=compute_loss, load_dataset=load_dataset)
