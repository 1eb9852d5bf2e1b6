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
