"""The Free Transformer's evaluation: compiled with ragged validation batches (the last one
smaller than the micro-batch, and on 2 ranks one rank with a dummy row), and the figures that
compare with a baseline's CE: nll_bound = CE + KL and prior_ce (Z from the prior). --keep-best
ranks Free Transformer checkpoints by nll_bound, the validation `loss`."""
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
import model as model_lib  # noqa: E402
from test_distributed import FREE, VAL_ROWS, launch  # noqa: E402

# 11 validation rows against micro-batches of 4: the last validation batch is ragged (on two processes rank 1 has
# none left and runs a dummy row). The same micro-batch on one process and two: the second reuses the compiled graphs.
COMPILED = FREE + ["--compile", "--max-steps", "4", "--micro-batch", "4", "--eval-samples", str(VAL_ROWS),
                   "--eval-every", "2", "--log-every", "2"]


def val_records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [r for r in map(json.loads, fh) if "val_loss" in r]


def check_evaluations(run_dir):
    vals = val_records(run_dir)
    assert [r["step"] for r in vals] == [2, 4]
    for r in vals:
        assert r["val_nll_bound"] == pytest.approx(r["val_ce"] + r["val_kl"], rel=1e-6)
        assert r["val_loss"] == r["val_nll_bound"]  # the figure runs are compared and ranked by
        assert r["val_prior_ce"] > 0
    assert os.path.isdir(os.path.join(run_dir, "checkpoints", "step_0000004"))
    with open(os.path.join(run_dir, "training_log.txt")) as fh:
        assert "validation: loss = nll_bound = CE + KL" in fh.read()  # the start-up says which figure compares


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("free1"), 1,
                  {"none": COMPILED + ["--strategy", "none", "--keep-best", "--save-every", "2"]}, "free1")


def test_compiled_free_transformer_evaluates_ragged_batches_on_one_process(one):
    check_evaluations(one["none"][2])


def test_compiled_free_transformer_evaluates_ragged_batches_under_fsdp_on_two_processes(tmp_path):
    """The root FSDP's one unit (--auto-wrap auto, the default at this size): the forward compiled in place is the
    whole model's, whose graphs the one-process run compiled already."""
    check_evaluations(launch(tmp_path, 2, {"fsdp": COMPILED + ["--auto-wrap", "auto"]}, "free2")["fsdp"][2])


def test_keep_best_ranks_free_transformer_checkpoints_by_the_bound(one):
    run_dir = one["none"][2]
    by_step = {r["step"]: r["val_nll_bound"] for r in val_records(run_dir)}
    root = os.path.join(run_dir, "checkpoints")
    for step, bound in by_step.items():
        with open(os.path.join(root, f"step_{step:07d}", "meta.json")) as fh:
            assert json.load(fh)["val_loss"] == bound
    with open(os.path.join(root, "best")) as fh:
        assert fh.read().strip() == f"step_{min(by_step, key=by_step.get):07d}"


def test_posterior_ce_equals_prior_ce_when_the_encoder_is_uniform():
    """With every bit-logit 0 the posterior draws Z from the prior's distribution, and from the
    same RNG state the very same codes: the two CEs are then equal, and the KL is 0."""
    cfg = model_lib.ModelConfig(arch="free", n_layer=2, d_model=32, n_head=2, latent_bits=4, vocab_size=17)
    model_lib.resolve_model_config(cfg)
    torch.manual_seed(0)
    model = model_lib.build_model(cfg).eval()
    enc = model.latent.encoder
    last = enc.readout  # the projection to the H bit-logits
    with torch.no_grad():
        last.weight.zero_()
        if last.bias is not None:
            last.bias.zero_()
    x = torch.randint(0, 17, (3, 12))
    y = torch.randint(0, 17, (3, 12))
    with torch.no_grad():
        torch.manual_seed(1)
        logits, latent = model(x)
        _, parts = model_lib.lm_loss(logits, y, latent)
        torch.manual_seed(1)
        _, comparable = model_lib.comparable_losses(model, x, y, parts)
    assert latent["z_logits"].abs().max() == 0 and parts["kl"] == 0
    assert comparable["prior_ce"] == parts["ce"]
    assert comparable["nll_bound"] == parts["ce"]


def test_prior_ce_reads_z_from_the_prior_not_the_encoder():
    """An encoder that is sure of every bit picks other codes than the prior does: prior_ce is the
    CE of the forward that draws Z uniformly (mode="inference", same RNG state), not of one that
    reads Z from the encoder, which would flatter the Free Transformer."""
    cfg = model_lib.resolve_model_config(model_lib.ModelConfig(
        arch="free", n_layer=2, d_model=32, n_head=2, latent_bits=4, vocab_size=17))
    torch.manual_seed(0)
    model = model_lib.build_model(cfg).eval()
    with torch.no_grad():
        model.latent.encoder.readout.weight.mul_(1000)  # bit-logits far from 0: Z is the encoder's choice
        model.lm_head.weight.mul_(50)  # confident predictions, which Z moves
    x, y = torch.randint(0, 17, (3, 12)), torch.randint(0, 17, (3, 12))

    def ce(mode):
        torch.manual_seed(1)
        logits, latent = model(x, mode=mode)
        return model_lib.lm_loss(logits, y, latent)[1]

    with torch.no_grad():
        parts = ce("training")
        torch.manual_seed(1)
        _, comparable = model_lib.comparable_losses(model, x, y, parts)
        prior = ce("inference")
    assert parts["kl"] > 1  # the encoder's Z is far from uniform
    assert comparable["prior_ce"] == prior["ce"]
    assert abs(comparable["prior_ce"] - parts["ce"]) > 0.05
