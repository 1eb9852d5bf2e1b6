"""KV-cache generation, reproducible sampling, sample.py and the demonstration's parser."""
import math
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import script_runner  # noqa: E402

import model as M  # noqa: E402
import sample  # noqa: E402
from test_distributed import clean_env  # noqa: E402


def tiny(arch, **kw):
    cfg = M.resolve_model_config(M.ModelConfig(arch=arch, vocab_size=32, n_layer=4, d_model=32, n_head=4,
                                               n_kv_head=2, latent_bits=6, init_std=0.2, **kw))
    torch.manual_seed(0)
    return M.build_model(cfg).eval()


def uncached(model, prompt, new, codes, temperature, top_k, gen):
    """Reference: the full forward over the growing sequence at every step, Z fixed per position."""
    out = prompt
    for _ in range(new):
        logits, _ = model(out, z=None if codes is None else codes[:, :out.shape[1]])
        out = torch.cat([out, M.sample_next(logits[:, -1], temperature, top_k, gen)], dim=1)
    return out


@pytest.mark.parametrize("arch, prompt_z", [("baseline", "prior"), ("free", "prior"), ("free", "encoder")])
@pytest.mark.parametrize("temperature, top_k", [(0.0, 0), (1.0, 0), (0.8, 5)])
def test_cached_generation_equals_uncached(arch, prompt_z, temperature, top_k):
    model = tiny(arch)
    prompt = torch.randint(0, 32, (3, 5), generator=torch.Generator().manual_seed(1))
    out, codes = model.generate(prompt, 12, temperature, top_k, prompt_z=prompt_z,
                                generator=torch.Generator().manual_seed(2))
    gen = torch.Generator().manual_seed(2)
    if arch == "free":  # replay the generator draws that chose Z, then decode without a cache
        model.latent_codes(prompt, 17, None, prompt_z, gen)
    ref = uncached(model, prompt, 12, codes, temperature, top_k, gen)
    assert torch.equal(out, ref)
    assert out.shape == (3, 17) and torch.equal(out[:, :5], prompt)


def test_same_seed_same_samples_and_explicit_z_is_reproducible():
    model = tiny("free")
    prompt = torch.zeros(4, 3, dtype=torch.long)
    a, za = model.generate(prompt, 10, generator=torch.Generator().manual_seed(7))
    b, zb = model.generate(prompt, 10, generator=torch.Generator().manual_seed(7))
    c, _ = model.generate(prompt, 10, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and torch.equal(za, zb) and not torch.equal(a, c)
    # Greedy decoding with an explicit Z is deterministic whatever the generator.
    z = torch.randint(0, 64, (4, 13), generator=torch.Generator().manual_seed(3))
    g1, _ = model.generate(prompt, 10, temperature=0, z=z, generator=torch.Generator().manual_seed(1))
    g2, _ = model.generate(prompt, 10, temperature=0, z=z, generator=torch.Generator().manual_seed(99))
    assert torch.equal(g1, g2)


def test_z_changes_the_samples_and_prompt_z_modes():
    model = tiny("free")
    prompt = torch.zeros(2, 3, dtype=torch.long)
    z1 = torch.zeros(2, 23, dtype=torch.long)
    z2 = torch.full((2, 23), 63, dtype=torch.long)
    a, _ = model.generate(prompt, 20, temperature=0, z=z1)
    b, _ = model.generate(prompt, 20, temperature=0, z=z2)
    assert not torch.equal(a, b)  # Z reaches the decoder
    _, codes = model.generate(prompt, 4, prompt_z="prior", generator=torch.Generator().manual_seed(0))
    assert codes.shape == (2, 7) and codes.max() < 64
    # The default takes the prompt's Z from the prior (what training fits), not the encoder.
    _, default = model.generate(prompt, 4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(default, codes)
    _, enc = model.generate(prompt, 4, prompt_z="encoder", generator=torch.Generator().manual_seed(0))
    assert not torch.equal(enc[:, :3], codes[:, :3])
    with pytest.raises(ValueError, match="prompt_z"):
        model.generate(prompt, 4, prompt_z="posterior")
    with pytest.raises(ValueError, match="z has shape"):
        model.generate(prompt, 4, z=z1)


def test_block_parser():
    assert sample.block_start("____" + "KKKKKKKK" + "_" * 52, "K") == (4, True)
    assert sample.block_start("____" + "K!KKKKKK" + "!" + "_" * 51, "K") == (4, True)   # noise inside
    assert sample.block_start("_" * 56 + "KKKKKKKK", "K") == (56, True)
    assert sample.block_start("____" + "KKKK____KKKK" + "_" * 48, "K") == (4, False)   # split block
    assert sample.block_start("____" + "KKKKKKKK" + "_" * 51 + "J", "K") == (4, False)  # another letter
    assert sample.block_start("_" * 64, "K") == (None, False)
    assert sample.block_start("____KKKK", "K") == (4, False)                           # too short
    share, ok, starts = sample.batch_stats(["K>" + "KKKKKKKK" + "_" * 56] * 3 + ["K>" + "_" * 64], "K")
    assert share == 0.75 and ok == 0.75 and starts == [0, 0, 0]
    assert sample.entropy([3, 3, 3]) == 0.0 and abs(sample.entropy([1, 2]) - math.log(2)) < 1e-12


def test_sample_cli_and_demo_on_a_saved_run(tmp_path):
    """Train 3 steps, then sample.py decodes from the checkpoint and --demo writes its files."""
    env = clean_env()
    run = tmp_path / "run"
    trained = script_runner.run("train_fsdp.py", ["--strategy", "none", "--n-layer", "2", "--d-model", "32",
                                                  "--n-head", "2", "--latent-bits", "4", "--max-steps", "3",
                                                  "--global-batch", "8", "--param-dtype", "fp32", "--eval-samples",
                                                  "8", "--out-dir", run], ROOT, env)
    assert trained.returncode == 0, trained.stderr[-3000:]
    res = script_runner.run("sample.py", ["--ckpt", run, "--num-samples", "3", "--fixed-z", "--prompt", "K>",
                                          "--max-new-tokens", "10"], ROOT, env)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("'K>") for line in lines)
    summary = sample.main(["--ckpt", str(run), "--demo", "--device", "cpu"])
    assert set(summary) >= {"fixed_z", "fresh_z"} and (run / "demo.json").exists()
    assert all(0 <= summary[k]["same_noise_share"] <= 1 for k in ("fixed_z", "fresh_z"))
    assert 0 <= summary["fresh_z"]["start_entropy"] <= summary["uniform_start_entropy"] == math.log(57)
    assert (run / "demo_samples.txt").read_text().count("[fixed_z") == 8 * 8
    bad = script_runner.run("sample.py", ["--ckpt", tmp_path / "nope"], ROOT, env)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ")


def test_same_noise_share():
    shared = "K>" + "!___" * 16  # every sample writes its '!' at the same 16 places
    assert sample.same_noise_share([shared] * 4) == 1.0
    a, b = "K>" + "!_" * 32, "K>" + "_!" * 32  # never at the same place
    assert sample.same_noise_share([a, b]) == 0.0
    assert sample.same_noise_share([a, a, b, b]) == pytest.approx(1 / 3)  # each '!' shared by 1 of the 3 others
    assert sample.same_noise_share(["K>" + "_" * 64] * 3) is None  # no noise to compare
