"""--optimizer muon on CPU with gloo: fsdp2 (each matrix orthogonalised whole, by one rank) and ddp on
2 processes give one process's losses (fp32, accumulation, a SwiGLU of 97 rows that 2 ranks cannot
split evenly); a resume is exact (sharded under fsdp2, full under ddp) and resharding fsdp2's
checkpoint onto one process stays within 1e-5; a resume that switches --optimizer and Muon under FSDP1
are refused in one line; --init-from an AdamW run's weights works; which parameters take Muon."""
import os
import sys

import pytest
import torch

from test_checkpoint import cli, cmd_args, error_line, interrupted_copy, losses_of, resumed_step
from test_distributed import ROOT, assert_same, comms, launch

sys.path.insert(0, ROOT)
import model as model_lib  # noqa: E402
import muon  # noqa: E402
import train_fsdp  # noqa: E402

MUON = ["--optimizer", "muon", "--ffn-hidden", "97", "--micro-batch", "2", "--max-steps", "6", "--save-every", "3"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("muon")
    two = launch(tmp, 2, {"fsdp2": ["--strategy", "fsdp2"] + MUON,
                          "ddp": ["--strategy", "ddp", "--checkpoint-type", "full"] + MUON,
                          "adamw": ["--strategy", "fsdp2", "--ffn-hidden", "97", "--max-steps", "3"]},
                 "two", record=True)
    for name in ("fsdp2", "ddp"):
        interrupted_copy(two[name][2], tmp / f"resumed-{name}", at=3)
    interrupted_copy(two["fsdp2"][2], tmp / "one-resharded", at=3)
    adamw_weights = os.path.join(two["adamw"][2], "checkpoints", "step_0000003")
    one = launch(tmp, 1, {"none": ["--strategy", "none"] + MUON,
                          "resharded": ["--strategy", "none"] + MUON,
                          "init": ["--strategy", "fsdp2", "--init-from", adamw_weights] + MUON}, "one", record=True)
    again = launch(tmp, 2, {"fsdp2": ["--strategy", "fsdp2"] + MUON,
                            "ddp": ["--strategy", "ddp", "--checkpoint-type", "full"] + MUON}, "resumed")
    return tmp, two, one, again


def test_two_processes_match_one(runs):
    _, two, one, _ = runs
    assert_same(two["fsdp2"][0], one["none"][0])
    assert_same(two["ddp"][0], one["none"][0])
    assert one["none"][0][-1] < 0.9 * one["none"][0][0]  # it learns
    assert two["adamw"][0][:3] != two["fsdp2"][0][:3]  # another optimizer: other losses


def test_fsdp2_orthogonalises_each_matrix_once(runs):
    """Each rank orthogonalises its share of the matrices (14 here: 8 of 32 x 32, 4 of 97 x 32, 2 of 32 x 97), whole:
    the ranks' Newton-Schulz FLOPs add up to one process's, step by step (every rank doing every matrix
    would double them; a rank orthogonalising shards would do fewer)."""
    _, two, one, _ = runs
    per_rank = [[s["newton_schulz_flops"] for s in comms(two["fsdp2"], rank)] for rank in (0, 1)]
    single = [s["newton_schulz_flops"] for s in comms(one["none"])]
    assert [a + b for a, b in zip(*per_rank)] == single and len(single) == 6, (per_rank, single)
    assert 0 < min(per_rank[0] + per_rank[1]) and max(per_rank[0] + per_rank[1]) < single[0]


def test_resume_is_exact_and_reshards(runs):
    tmp, two, one, again = runs
    for name in ("fsdp2", "ddp"):
        resumed = tmp / f"resumed-{name}"
        assert resumed_step(resumed) == 3
        assert losses_of(resumed) == two[name][0]  # steps 1-3 kept, 4-6 trained again: bit-identical
    resharded = losses_of(tmp / "one-resharded")
    assert resharded[:3] == two["fsdp2"][0][:3]
    assert_same(resharded[3:] * 2, two["fsdp2"][0][3:] * 2)  # fsdp2 on 2 processes, resumed on 1


def test_init_from_adamw_weights(runs):
    _, _, one, _ = runs
    assert len(one["init"][0]) == 6 and one["init"][0][0] < one["none"][0][0]  # starts from trained weights


def test_switching_optimizer_on_resume_and_fsdp1_are_refused(runs, tmp_path):
    tmp, two, _, _ = runs
    run_dir = two["fsdp2"][2]
    before = os.listdir(run_dir)
    line = error_line(cli(cmd_args(run_dir, tmp / "cache", ["--strategy", "none", "--ffn-hidden", "97",
                                                              "--micro-batch", "2", "--max-steps", "8"])), 2)
    assert "optimizer" in line, line
    assert os.listdir(run_dir) == before
    line = error_line(cli(cmd_args(tmp_path / "r", tmp / "cache", ["--strategy", "fsdp", "--optimizer", "muon"])), 2)
    assert "fsdp2" in line and not os.path.exists(tmp_path / "r"), line


def test_which_parameters_take_muon():
    cfg = model_lib.ModelConfig(arch="free", n_layer=2, d_model=32, n_head=2, vocab_size=20, latent_bits=4,
                                ffn_hidden=64)
    free = model_lib.build_model(cfg)
    hidden = muon.hidden_matrices(free, {model_lib.DecoderBlock})
    assert "latent.encoder.readout.weight" in hidden and "blocks.1.mlp.w2.weight" in hidden
    assert not hidden & {"tok_emb.weight", "lm_head.weight", "latent.post_sampler", "norm.weight"}
    assert all(p.dim() == 2 for n, p in free.named_parameters() if n in hidden)

    class Block(torch.nn.Module):  # a model without muon_filter: the 2-D weights of its unit classes
        def __init__(self):
            super().__init__()
            self.fc, self.norm = torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)
    plain = torch.nn.Sequential(torch.nn.Embedding(10, 4), Block(), torch.nn.Linear(4, 10))
    assert muon.hidden_matrices(plain, {Block}) == {"1.fc.weight"}


def test_muons_rate_is_twice_lr_unless_set_and_a_resume_keeps_its_own():
    """--muon-lr 0 gives Muon twice --lr (BENCHMARKS: Muon); --muon-lr sets it. A checkpoint's
    param groups hold the ratio, so a run saved under another default resumes at its own rate."""
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 10))
    about = {"decay_names": {"1.weight", "2.weight"}, "hidden": {"1.weight"}}

    def ratio(argv, state=None):
        cfg = train_fsdp.parse_config(["--optimizer", "muon", "--lr", "1e-3", *argv])
        optimizer = train_fsdp.build_optimizer(model, cfg, 1e-3, torch.device("cpu"), about)
        if state:
            optimizer.load_state_dict(state)
        (group,) = [g for g in optimizer.param_groups if g.get("muon")]
        return group["lr_ratio"], optimizer

    assert ratio([])[0] == 2.0 and ratio(["--muon-lr", "5e-4"])[0] == pytest.approx(0.5)
    _, old = ratio(["--muon-lr", "1e-3"])  # the default before: --lr itself
    assert ratio([], old.state_dict())[0] == 1.0
