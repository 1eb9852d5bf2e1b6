"""--float8 on one process: the missing package, and a float8 checkpoint that any run resumes.
The strategies' agreement and the checkpoint layout are in test_distributed.py."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_fsdp  # noqa: E402
from test_distributed import TINY  # noqa: E402

# Five steps of the CPU's float8 matmul (a slow reference implementation) take seconds: fewer rows.
FLOAT8 = TINY + ["--strategy", "none", "--global-batch", "2", "--eval-samples", "4"]


def test_a_missing_torchao_is_bad_input(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # `import torchao` now raises ImportError
    with pytest.raises(train_fsdp.BadInput) as e:
        train_fsdp.main(FLOAT8 + ["--float8", "tensorwise", "--out-dir", str(tmp_path / "run")])
    assert str(e.value) == "--float8 needs the torchao package, which is not installed: pip install torchao"
    assert os.listdir(tmp_path) == []


def test_a_float8_run_resumes_without_float8(tmp_path):
    """The weights of a --float8 rowwise run are plain fp32 tensors: its checkpoint resumes with float8 off
    (said as a change), and the resumed run computes in fp32 from the saved weights."""
    pytest.importorskip("torchao", reason="pip install torchao (.ci/run does)")
    run, cache = str(tmp_path / "run"), str(tmp_path / "cache")
    train_fsdp.main(FLOAT8 + ["--float8", "rowwise", "--max-steps", "2", "--out-dir", run, "--cache-dir", cache])
    saved = torch.load(os.path.join(run, "checkpoints", "step_0000002", "model.pt"), weights_only=True)
    assert {v.dtype for v in saved["model"].values()} == {torch.float32}
    train_fsdp.main(FLOAT8 + ["--max-steps", "3", "--out-dir", run, "--cache-dir", cache])
    with open(os.path.join(run, "training_log.txt")) as fh:
        log = fh.read()
    assert "resumed from" in log and "changed on resume: fsdp.float8: 'rowwise' -> ''" in log, log


def test_float8_with_nothing_to_convert_is_bad_input(tmp_path):
    """A model whose blocks hold no Linear layer with sides that are multiples of 16 (d_model 24)
    would silently train in bf16: refused in one line, nothing written."""
    pytest.importorskip("torchao", reason="pip install torchao (.ci/run does)")
    with pytest.raises(train_fsdp.BadInput) as e:
        train_fsdp.main(FLOAT8 + ["--d-model", "24", "--float8", "tensorwise", "--out-dir", str(tmp_path / "run"),
                                  "--cache-dir", str(tmp_path / "cache")])
    assert str(e.value) == "--float8 needs Linear layers in the blocks with sides multiples of 16"
    assert not (tmp_path / "run").exists()


def test_float8_layers_start_from_the_models_init_under_meta_init(tmp_path):
    """torchao swaps each Linear for a new Float8Linear, before --meta-init initialises the model:
    the new layer keeps the marks model.py set (residual_out: std / sqrt(2 * n_layer)), so the
    weights start as without float8. One step at a rate of 1e-9 moves them by about 1e-9."""
    pytest.importorskip("torchao", reason="pip install torchao (.ci/run does)")
    weights = {}
    for name, flags in (("bf16", []), ("float8", ["--float8", "tensorwise"])):
        run = str(tmp_path / name)
        train_fsdp.main(FLOAT8 + flags + ["--meta-init", "--max-steps", "1", "--lr", "1e-9", "--out-dir", run,
                                          "--cache-dir", str(tmp_path / "cache")])
        path = os.path.join(run, "checkpoints", "step_0000001", "model.pt")
        weights[name] = torch.load(path, weights_only=True)["model"]
    assert weights["float8"].keys() == weights["bf16"].keys()
    for key, w in weights["bf16"].items():
        torch.testing.assert_close(weights["float8"][key], w, rtol=0, atol=1e-6, msg=key)


def test_lora_layers_keep_their_adapters():
    """torchao would swap a LoRA layer (an nn.Linear subclass) for a Float8Linear without its adapters:
    only the plain Linear layers convert."""
    pytest.importorskip("torchao")
    import float8
    import model as model_lib
    cfg = model_lib.resolve_model_config(model_lib.ModelConfig(arch="baseline", n_layer=2, d_model=64, n_head=2,
                                                               vocab_size=64, lora_rank=4))
    m = model_lib.build_model(cfg)
    assert float8.to_float8(list(m.blocks), "tensorwise") == 2 * 3  # each block's MLP
    assert sum(isinstance(x, model_lib.LoRALinear) for x in m.modules()) == 2 * 4
    assert sum(p.requires_grad for p in m.parameters()) == 2 * 4 * 2
