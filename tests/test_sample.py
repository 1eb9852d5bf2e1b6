"""sample.py on a Free Transformer trained a few steps on text with a char tokenizer: --fixed-z
gives every sample the same Z (also the demonstration's fixed Z), and prompt characters outside
the tokenizer's vocabulary are named on one line instead of silently read as <unk>."""
import os
import random
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
import script_runner  # noqa: E402

import model as M  # noqa: E402
import sample  # noqa: E402
from test_distributed import clean_env  # noqa: E402


@pytest.fixture(scope="module")
def char_run(tmp_path_factory):
    """A Free Transformer, 2 steps on a corpus of a few letters, spaces and newlines, char tokenizer."""
    tmp = tmp_path_factory.mktemp("sample")
    rng = random.Random(0)
    lines = [" ".join(rng.choice(["ka", "lo", "mi", "ne", "ru"]) * rng.randint(1, 3) for _ in range(8))
             for _ in range(400)]
    (tmp / "corpus.txt").write_text("\n".join(lines) + "\n")
    run = tmp / "run"
    trained = script_runner.run("train_fsdp.py", [
        "--strategy", "none", "--arch", "free", "--latent-bits", "4", "--n-layer", "2", "--d-model", "32", "--n-head",
        "2", "--max-steps", "2", "--global-batch", "8", "--seq-len", "32", "--param-dtype", "fp32", "--eval-samples",
        "8", "--dataset", tmp / "corpus.txt", "--tokenizer-type", "char", "--cache-dir", tmp / "cache", "--out-dir",
        run], ROOT, clean_env())
    assert trained.returncode == 0, trained.stderr[-3000:]
    return str(run)


def recorded_z(monkeypatch):
    """Every z that sample.py passes to the model's generate, as a list that fills."""
    seen, load = [], sample.load_model

    def load_and_record(path, device):
        model, ckpt = load(path, device)
        generate = model.generate

        def record(*args, z=None, **kwargs):
            seen.append(z)
            return generate(*args, z=z, **kwargs)
        model.generate = record
        return model, ckpt

    monkeypatch.setattr(sample, "load_model", load_and_record)
    return seen


def test_fixed_z_shares_one_z_across_the_samples(char_run, monkeypatch, capsys):
    seen = recorded_z(monkeypatch)
    base = ["--ckpt", char_run, "--device", "cpu", "--num-samples", "4", "--prompt", "ka lo", "--max-new-tokens", "6"]
    sample.main(base + ["--fixed-z", "--temperature", "0"])
    z = seen[-1]
    assert z.shape == (4, 5 + 6) and bool((z == z[:1]).all()) and z.max() < 16
    greedy = capsys.readouterr().out.splitlines()
    assert len(greedy) == 4 and len(set(greedy)) == 1  # same prompt, same Z, greedy: the same text
    sample.main(base)
    assert seen[-1] is None  # without --fixed-z the model draws Z for each sample itself


def test_the_demonstrations_fixed_z_is_one_draw_for_the_batch(monkeypatch):
    cfg = M.resolve_model_config(M.ModelConfig(arch="free", vocab_size=32, n_layer=2, d_model=32, n_head=4,
                                               latent_bits=4))
    torch.manual_seed(0)
    model = M.build_model(cfg).eval()
    seen, generate = [], model.generate

    def record(*args, z=None, **kwargs):
        seen.append(z)
        return generate(*args, z=z, **kwargs)

    model.generate = record
    sample.synthetic_demo(model, torch.device("cpu"), seed=0, n_batches=2, batch=4)
    fixed, fresh = seen[0::2], seen[1::2]
    assert len(fixed) == 2 and all(z.shape[0] == 4 and bool((z == z[:1]).all()) for z in fixed)
    assert not torch.equal(fixed[0], fixed[1]) and fresh == [None, None]


def test_prompt_characters_outside_a_char_vocabulary_are_named(char_run, capsys):
    base = ["--ckpt", char_run, "--device", "cpu", "--num-samples", "1", "--max-new-tokens", "2"]
    sample.main(base + ["--prompt", "ka Zé中 lo"])
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("note: --prompt characters ['Z', 'é', '中']"), err
    assert "<unk>" in err[0]
    sample.main(base + ["--prompt", "ka lo\nmi"])
    assert capsys.readouterr().err == ""
